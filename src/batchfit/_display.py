"""Jupyter's rich display of batchfit's values, with the pages drawn where pictures are drawn.

Jupyter asks a value itself for its HTML (``_repr_html_``), but the values (an estimate, a plan,
a probe's result) live in layers that compute and never import rendering. So a value hands its
JSON to :func:`html` under its kind, and ``batchfit.views.html`` registers the page for each
kind. ``import batchfit`` imports that module (cheap: neither torch nor matplotlib), so every
value that exists can be shown.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Page = Callable[[dict[str, Any]], str]

_PAGES: dict[str, Page] = {}


def register_html(kind: str, page: Page) -> None:
    """Draw values of ``kind`` (``"estimate"``, ``"plan"``, ``"probe"``) with ``page``."""
    _PAGES[kind] = page


def html(kind: str, data: dict[str, Any]) -> str:
    """The page registered for ``kind``, drawn from ``data`` (a value's ``to_json()``)."""
    return _PAGES[kind](data)
