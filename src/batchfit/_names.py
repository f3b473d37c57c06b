"""Name matching for catalog look-ups, with close-match suggestions."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def normalise(name: str) -> str:
    """Case-insensitive key; ``_`` and spaces count as ``-``."""
    return name.strip().lower().replace("_", "-").replace(" ", "-")


def suggest(name: str, choices: Iterable[str]) -> str:
    """``' (did you mean: a, b?)'`` or an empty string."""
    key, pool = normalise(name), list(choices)
    prefixed = [c for c in pool if c.startswith(key)]  # `a100` -> a100-40gb, a100-80gb
    matches = prefixed[:4] or difflib.get_close_matches(key, pool, n=3, cutoff=0.5)
    return f" (did you mean: {', '.join(matches)}?)" if matches else ""
