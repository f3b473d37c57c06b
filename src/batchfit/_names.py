"""Name matching for catalog look-ups, with close-match suggestions."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def normalise(name: str) -> str:
    """Case-insensitive key; ``_`` and spaces count as ``-``."""
    return name.strip().lower().replace("_", "-").replace(" ", "-")


def suggest(name: str, choices: Iterable[str]) -> str:
    """``' (did you mean: a, b?)'`` or an empty string."""
    matches = difflib.get_close_matches(normalise(name), list(choices), n=3, cutoff=0.5)
    return f" (did you mean: {', '.join(matches)}?)" if matches else ""
