"""Versions reported in every JSON object, read without importing torch or transformers."""

from __future__ import annotations

from functools import cache

__version__ = "0.1.0"


@cache
def versions() -> dict[str, str | None]:
    # importlib.metadata costs most of `import batchfit` (email, zipfile, csv): load it here,
    # where it is needed, not at import.
    from importlib import metadata

    out: dict[str, str | None] = {"batchfit": __version__}
    for dist in ("torch", "transformers"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out
