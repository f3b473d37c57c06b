"""Argument checks shared by the training runtime, with one-line errors that name the fix."""

from __future__ import annotations


def check_positive_int(name: str, value: object, *, meaning: str = "", fix: str = "") -> None:
    """Raise ``ValueError`` unless ``value`` is an ``int`` >= 1 (a ``bool`` is not).

    Args:
        name: The argument, as the caller spells it.
        value: What was passed.
        meaning: What the number counts, said in parentheses after "a positive integer".
        fix: What to pass instead, appended after a semicolon.

    Example:
        >>> check_positive_int("grad_accum_steps", 0, fix="use 1 for no accumulation")
        Traceback (most recent call last):
        ...
        ValueError: grad_accum_steps must be a positive integer, got 0; use 1 for no accumulation
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        what = f" ({meaning})" if meaning else ""
        then = f"; {fix}" if fix else ""
        raise ValueError(f"{name} must be a positive integer{what}, got {value!r}{then}")
