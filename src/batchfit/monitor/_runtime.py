"""What a Python training process holds before its first tensor (the CPU plan's baseline)."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from batchfit import _cache
from batchfit._units import BYTES_IN_KIB

# What a Python training process holds before it makes a tensor: the interpreter, torch and
# transformers (their code, and the allocator's and the libraries' own pages)
_RUNTIME_PROBE = (
    "import torch\n"
    "try:\n    import transformers, transformers.modeling_utils\n"
    "except ImportError:\n    pass\n"
    "torch.zeros(1).sum()\n"
    "print([l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM:')][0])\n"
)


def python_of(command: list[str]) -> str:
    """The interpreter ``command`` runs: its first word when that is a python, else this one."""
    first = Path(command[0]).name if command else ""
    if first.startswith("python"):
        return shutil.which(command[0]) or sys.executable
    return sys.executable


def _installed(python: str) -> dict[str, Any] | None:
    """What the baseline of ``python`` depends on: the interpreter's file, its environment's
    package folders (pip installing or removing a package changes a folder's mtime), the
    user's site folders and PYTHONPATH; None where no package folder is found beside it (a
    pyenv or conda shim, whose packages live elsewhere: measured every time)."""
    path = Path(python)
    prefix = path.parent.parent  # <prefix>/bin/python, a virtual environment's or not

    def folders(*roots: Path) -> list[str]:
        return [
            folder
            for root in roots
            for kind in ("site-packages", "dist-packages")
            for folder in glob.glob(str(root / "lib" / "python*" / kind))
        ]

    own = folders(prefix, prefix / "local")
    if not own:
        return None
    found = own + folders(Path.home() / ".local")
    stamps: dict[str, Any] = {
        "python": str(path.absolute()),
        "pythonpath": os.environ.get("PYTHONPATH", ""),
    }
    for name in [str(path.resolve()), *sorted(found)]:
        try:
            stat = os.stat(name)
        except OSError:
            continue
        stamps[name] = [stat.st_size, stat.st_mtime_ns]
    return stamps


def cached_runtime_bytes(python: str) -> int | None:
    """``runtime_bytes(python)`` as last measured for the same interpreter and packages (None:
    not measured yet, they changed, or they cannot be told apart)."""
    key = _installed(python)
    record = _cache.load("runtime", key) if key is not None else None
    value = record.get("bytes") if record else None
    return value if isinstance(value, int) else None


def runtime_bytes(python: str, timeout: float = 120.0) -> int | None:
    """The resident high-water mark of ``python`` after importing torch and transformers and
    running one op (what a CPU run holds besides its tensors); None where that fails. Kept in
    the cache for ``cached_runtime_bytes``."""
    try:
        done = subprocess.run(
            [python, "-c", _RUNTIME_PROBE],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        measured = int(done.stdout.strip().splitlines()[-1]) * BYTES_IN_KIB
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None
    key = _installed(python)
    if key is not None:
        _cache.store("runtime", key, {"bytes": measured})
    return measured
