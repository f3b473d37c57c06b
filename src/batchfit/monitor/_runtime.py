"""What a Python training process holds before its first tensor (the CPU plan's baseline)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

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


def runtime_bytes(python: str, timeout: float = 120.0) -> int | None:
    """The resident high-water mark of ``python`` after importing torch and transformers and
    running one op (what a CPU run holds besides its tensors); None where that fails."""
    try:
        done = subprocess.run(
            [python, "-c", _RUNTIME_PROBE],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        return int(done.stdout.strip().splitlines()[-1]) * BYTES_IN_KIB
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None
