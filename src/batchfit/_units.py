"""Byte sizes: parsing user input and formatting for people."""

from __future__ import annotations

import math
import re

from batchfit.errors import UsageError

BYTES_IN_KIB = 1024
BYTES_IN_MIB = 1024**2
BYTES_IN_GIB = 1024**3
# No machine holds an exbibyte: a larger size is a typo, and would overflow OS limits.
MAX_SIZE_BYTES = 2**60

# KB/MB/GB are powers of 10 (SI), KiB/MiB/GiB powers of 2 (IEC 80000-13).
_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")
_COUNT_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([KMBT]?)\s*$", re.IGNORECASE)
_COUNT_UNITS = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


def parse_size(text: str | int | float, *, what: str = "size", allow_zero: bool = False) -> int:
    """Parse a memory size such as ``16GiB``, ``500MB`` or ``1048576`` into bytes.

    Example:
        >>> parse_size("16GiB"), parse_size("500MB"), parse_size(1024)
        (17179869184, 500000000, 1024)
    """
    if isinstance(text, int | float):
        value, unit = float(text), ""
    else:
        match = _SIZE_RE.match(text)
        if not match or match.group(2).upper() not in _SIZE_UNITS:
            raise UsageError(
                f"{what} {text!r} is not a size: write bytes or a number with a unit, "
                "e.g. 16GiB, 24GB, 500MiB"
            )
        value, unit = float(match.group(1)), match.group(2).upper()
    if not math.isfinite(value) or value * _SIZE_UNITS[unit] > MAX_SIZE_BYTES:
        raise UsageError(f"{what} {text!r} is too large: give at most 1 EiB, e.g. 16GiB")
    size_bytes = int(value * _SIZE_UNITS[unit])
    if size_bytes < 0 or (size_bytes == 0 and not allow_zero):
        raise UsageError(f"{what} must be positive, got {text!r}")
    return size_bytes


def parse_count(text: str) -> int:
    """Parse a parameter count such as ``7B``, ``350M`` or ``1.5B``.

    Example:
        >>> parse_count("7B"), parse_count("350m"), parse_count("1.5B")
        (7000000000, 350000000, 1500000000)
    """
    match = _COUNT_RE.match(text)
    if not match:
        raise UsageError(f"{text!r} is not a parameter count such as 7B or 350M")
    count = int(float(match.group(1)) * _COUNT_UNITS[match.group(2).upper()])
    if count <= 0:
        raise UsageError(f"parameter count must be positive, got {text!r}")
    return count


def looks_like_count(text: str) -> bool:
    """True for ``7B``/``350M``-style sizes (a unit letter is required)."""
    match = _COUNT_RE.match(text)
    return bool(match and match.group(2))


def gib_figure(num_bytes: float, decimals: int = 2) -> str:
    """Bytes as a number of GiB, for a column headed GiB: ``'14.96'``."""
    return f"{num_bytes / BYTES_IN_GIB:,.{decimals}f}"


def gib(num_bytes: float) -> str:
    """Format bytes as GiB for people: ``'14.96 GiB'``."""
    return f"{gib_figure(num_bytes)} GiB"


def human_bytes(num_bytes: float) -> str:
    """Format bytes for people, in MiB below a GiB: ``'600 MiB'``, ``'4.50 GiB'``."""
    if num_bytes >= BYTES_IN_GIB:
        return gib(num_bytes)
    return f"{num_bytes / 2**20:,.0f} MiB"


def human_count(count: float) -> str:
    """Format a parameter count: ``'8.03B'``, ``'124.4M'``."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(count) >= scale:
            return f"{count / scale:.3g}{unit}" if scale >= 1e9 else f"{count / scale:.4g}{unit}"
    return f"{count:g}"


def human_duration(seconds: float) -> str:
    """``seconds`` in the largest unit that keeps it readable (the terminal's and the HTML's).

    Example:
        >>> human_duration(90), human_duration(5400), human_duration(36000), human_duration(9e5)
        ('90 s', '90 min', '10.0 h', '10.4 days')
    """
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} min"
    if seconds < 3 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


def ordinal(k: int) -> str:
    """``2nd``, ``3rd``, ``4th``: for the layer counts in messages.

    Example:
        >>> ordinal(2), ordinal(3), ordinal(4), ordinal(21)
        ('2nd', '3rd', '4th', '21st')
    """
    if k % 100 in (11, 12, 13):
        return f"{k}th"
    return f"{k}{ {1: 'st', 2: 'nd', 3: 'rd'}.get(k % 10, 'th') }"


def usd(amount: float) -> str:
    """Dollars as the plan and its report print them: cents below $100, whole dollars above.

    Example:
        >>> usd(1.02), usd(1234.5)
        ('$1.02', '$1,234')
    """
    return f"${amount:,.{0 if amount >= 100 else 2}f}"
