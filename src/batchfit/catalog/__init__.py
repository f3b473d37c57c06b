"""Offline data: published model configs, derived parameter tables, and a GPU table."""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from typing import Any


@cache
def load(name: str) -> Any:
    """Load ``catalog/<name>.json`` shipped with the package (cached)."""
    text = resources.files(__name__).joinpath(f"{name}.json").read_text(encoding="utf-8")
    return json.loads(text)
