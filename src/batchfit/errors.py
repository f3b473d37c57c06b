"""The one exception type for bad user input.

It subclasses ``ValueError`` so library callers can catch it as the standard error for a bad
value; the CLI turns it into exit code 2 and one line on stderr.
"""

from __future__ import annotations

import os
import re

# Set by the command line while it runs (and so seen by the processes it starts): its errors
# name options (``--global-batch``); a Python caller's name arguments (``global_batch``).
CLI_SPELLING_ENV = "BATCHFIT_ERRORS_NAME_OPTIONS"
# the options whose Python argument is not the option's name with dashes as underscores
_PYTHON_NAMES = {
    "micro-batch": "micro_batch_size",
    "grad-accum": "grad_accum_steps",
    "headroom": "headroom_bytes",
}
_OPTION = re.compile(r"--([a-z][a-z0-9-]*)( auto\b)?")


def python_spelling(message: str) -> str:
    """``message`` with each command-line option named as the Python argument it matches.

    Example:
        >>> python_spelling("--global-batch must be positive; --max-gpus goes with --num-gpus auto")
        'global_batch must be positive; max_gpus goes with num_gpus="auto"'
        >>> python_spelling("--micro-batch 3 does not divide 64")
        'micro_batch_size 3 does not divide 64'
    """

    def named(match: re.Match[str]) -> str:
        option = match.group(1)
        name = _PYTHON_NAMES.get(option, option.replace("-", "_"))
        return f'{name}="auto"' if match.group(2) else name

    return _OPTION.sub(named, message)


class UsageError(ValueError):
    """Bad input from the user: the message says what is wrong and how to fix it.

    Messages are written with the command line's option names; raised in a Python program,
    ``str()`` names the arguments instead (``global_batch``, not ``--global-batch``).
    """

    def __str__(self) -> str:
        message = super().__str__()
        if os.environ.get(CLI_SPELLING_ENV) == "1":
            return message
        return python_spelling(message)


class NoFitError(UsageError):
    """Not even the smallest micro-batch fits in the memory given (probe, ``find_batch_size``).

    A ``UsageError``, so the CLI prints it as one line with exit code 2 on every device, and
    library callers may catch either.
    """


class RankFailure(RuntimeError):
    """A process of a multi-rank run died (a crash, a signal): there is no result.

    Not the user's input: the CLI prints it as one line with exit code 1.
    """
