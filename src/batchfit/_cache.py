"""A disk cache of dry-run results, so that a repeated ``plan`` or ``gpus`` answers at once.

Records are JSON files under ``<cache dir>/<namespace>/<sha256>.json``; the cache dir is
``platformdirs.user_cache_dir("batchfit")`` unless ``BATCHFIT_CACHE_DIR`` names another. A key
is the caller's parts (model config, setup, sizes, device ...) plus the versions of batchfit,
torch and transformers (read from package metadata: torch is never imported here), and the
file keeps the parts it was stored under, so a stale or colliding file is a miss.

The cache never fails a command: a missing, corrupt, unreadable or foreign file is a miss (the
next store rewrites it), and a store that cannot write does nothing. What went wrong is logged
on ``logging.getLogger("batchfit.cache")`` (the CLI shows it under ``--verbose``). It is off
inside :func:`disabled` (``--no-cache``) and when ``BATCHFIT_NO_CACHE`` is set (to anything but
0, false or no).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import platformdirs

log = logging.getLogger("batchfit.cache")

MAX_ENTRIES = 2000  # per namespace; the oldest go first beyond it
_off = False


@functools.cache
def _versions() -> dict[str, str | None]:
    """Package versions, and a digest of batchfit's own sources (an edited checkout with an
    unchanged version number must not read results of its older code)."""
    out: dict[str, str | None] = {}
    for name in ("batchfit", "torch", "transformers", "peft"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    here = Path(__file__).parent
    stamp = hashlib.sha256()
    for source in sorted(here.rglob("*.py")):
        info = source.stat()
        stamp.update(f"{source.relative_to(here)}:{info.st_size}:{info.st_mtime_ns}".encode())
    out["batchfit-sources"] = stamp.hexdigest()[:16]
    return out


def cache_dir() -> Path:
    """Where records live (``BATCHFIT_CACHE_DIR`` or the user's cache dir)."""
    override = os.environ.get("BATCHFIT_CACHE_DIR")
    if override:
        return Path(override)

    return Path(platformdirs.user_cache_dir("batchfit"))


def enabled() -> bool:
    # any value but an empty one, 0, false or no switches the cache off
    flag = os.environ.get("BATCHFIT_NO_CACHE", "").strip().lower()
    return not _off and flag in ("", "0", "false", "no")


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """No reads and no writes inside the ``with`` (``--no-cache``)."""
    global _off
    before, _off = _off, True
    try:
        yield
    finally:
        _off = before


def _canonical(parts: dict[str, Any]) -> str:
    return json.dumps({**parts, "versions": _versions()}, sort_keys=True, default=str)


def _path(namespace: str, canonical: str) -> Path:
    digest = hashlib.sha256(canonical.encode()).hexdigest()
    return cache_dir() / namespace / f"{digest}.json"


def load(namespace: str, parts: dict[str, Any]) -> dict[str, Any] | None:
    """The record stored under ``parts``, or None (a miss, whatever the reason)."""
    if not enabled():
        return None
    canonical = _canonical(parts)
    path = _path(namespace, canonical)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        log.info("cache: cannot read %s (%s); computing instead", path, e)
        return None
    try:
        record = json.loads(text)
    except ValueError:
        log.info("cache: %s is not JSON; computing instead, it will be rewritten", path)
        return None
    if (
        not isinstance(record, dict)
        or record.get("key") != canonical
        or not isinstance(record.get("value"), dict)
    ):
        log.info("cache: %s holds another record; computing instead", path)
        return None
    value: dict[str, Any] = record["value"]
    return value


def store(namespace: str, parts: dict[str, Any], value: dict[str, Any]) -> None:
    """Keep ``value`` under ``parts`` (atomically: a reader sees the old file or the new)."""
    if not enabled():
        return
    canonical = _canonical(parts)
    path = _path(namespace, canonical)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump({"key": canonical, "value": value}, f)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        _prune(path.parent)
    except (OSError, TypeError, ValueError) as e:
        log.info("cache: cannot write %s (%s); the answer is not cached", path, e)


def _prune(folder: Path) -> None:
    """Drop the oldest records beyond ``MAX_ENTRIES`` (checked on one store in 50)."""
    if int.from_bytes(os.urandom(1), "big") % 50:
        return
    entries = sorted(folder.glob("*.json"), key=lambda p: p.stat().st_mtime)
    for old in entries[: max(0, len(entries) - MAX_ENTRIES)]:
        with contextlib.suppress(OSError):
            old.unlink()
