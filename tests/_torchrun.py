"""Launch a worker on two CPU ranks (gloo), as torchrun would, for the distributed tests."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RANKS = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_env(rank: int, port: str) -> dict[str, str]:
    """The variables torchrun gives rank ``rank`` of ``RANKS`` on this host."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(RANKS),
        "LOCAL_WORLD_SIZE": str(RANKS),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": port,
    }


def _once(
    worker: Path, args: list[str], env: dict[str, str], timeout: float
) -> tuple[int, str, str]:
    """Both ranks started with torchrun's environment; the first to fail ends the other after a
    grace period (a rank waiting on a dead peer in a collective never returns)."""
    port = str(_free_port())
    with contextlib.ExitStack() as files:
        outs = [files.enter_context(tempfile.TemporaryFile("w+")) for _ in range(RANKS)]
        errs = [files.enter_context(tempfile.TemporaryFile("w+")) for _ in range(RANKS)]
        procs: list[subprocess.Popen[str]] = []
        try:
            for rank in range(RANKS):
                procs.append(
                    subprocess.Popen(
                        [sys.executable, str(worker), *args],
                        env={**env, **_rank_env(rank, port)},
                        stdout=outs[rank],
                        stderr=errs[rank],
                        text=True,
                    )
                )
            deadline, failed_at = time.monotonic() + timeout, None
            while any(p.poll() is None for p in procs):
                now = time.monotonic()
                if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
                    failed_at = now
                if now > deadline or (failed_at is not None and now > failed_at + 30):
                    break
                time.sleep(0.05)
        finally:  # a rank still running (timed out, or waiting on a dead peer) is ended
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        code = next((p.returncode for p in procs if p.returncode), 0)
        texts = []
        for streams in (outs, errs):
            text = ""
            for f in streams:
                f.seek(0)
                text += f.read()
            texts.append(text)
    return code, texts[0], texts[1]


def torchrun(
    worker: Path,
    *args: object,
    attempts: int = 3,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``worker *args`` on 2 ranks; the last attempt's outcome (returncode 0 if one passed),
    stdout and stderr rank 0's then rank 1's.

    The ranks are started directly with the variables torchrun sets (``RANK``, ``LOCAL_RANK``,
    ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``): torchrun's own
    process would import torch once more for nothing. Two ranks import torch on a 2-core
    machine: under load that is slow, and a free port can be taken between choosing and binding
    it; gloo has also aborted at teardown under the full suite ("terminate called without an
    active exception"). Retries, each a fresh port. ``env`` adds to the environment
    (PYTHONPATH is the repository, one OpenMP thread a rank).
    """
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    argv = [str(a) for a in args]
    code, out, err = 1, "", ""
    for _attempt in range(attempts):
        # 900 s: two ranks importing torch and DeepSpeed under a loaded suite
        code, out, err = _once(worker, argv, full_env, timeout=900)
        if code == 0:
            break
    return subprocess.CompletedProcess([sys.executable, str(worker), *argv], code, out, err)
