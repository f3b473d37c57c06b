"""Launch a worker on two CPU ranks under ``torchrun`` (gloo), for the distributed tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun(
    worker: Path,
    *args: object,
    attempts: int = 3,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``worker *args`` on 2 ranks; the last attempt's process (returncode 0 if one passed).

    Two ranks import torch on a 2-core machine: under load that is slow, and a free port can be
    taken between choosing and binding it; gloo has also aborted at teardown under the full
    suite ("terminate called without an active exception"). Retries, each a fresh port.
    ``env`` adds to the environment (PYTHONPATH is the repository, one OpenMP thread a rank).
    """
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    for _attempt in range(attempts):
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc_per_node",
                "2",
                "--master_addr",
                "127.0.0.1",
                "--master_port",
                str(_free_port()),
                str(worker),
                *(str(a) for a in args),
            ],
            env=full_env,
            capture_output=True,
            text=True,
            timeout=900,  # two ranks importing torch and DeepSpeed under a loaded suite
            check=False,
        )
        if proc.returncode == 0:
            break
    return proc
