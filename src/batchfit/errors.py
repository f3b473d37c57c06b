"""The one exception type for bad user input.

It subclasses ``ValueError`` so library callers can catch it as the standard error for a bad
value; the CLI turns it into exit code 2 and one line on stderr.
"""

from __future__ import annotations


class UsageError(ValueError):
    """Bad input from the user: the message says what is wrong and how to fix it."""


class NoFitError(UsageError):
    """Not even the smallest micro-batch fits in the memory given (probe, ``find_batch_size``).

    A ``UsageError``, so the CLI prints it as one line with exit code 2 on every device, and
    library callers may catch either.
    """


class RankFailure(RuntimeError):
    """A process of a multi-rank run died (a crash, a signal): there is no result.

    Not the user's input: the CLI prints it as one line with exit code 1.
    """
