"""The probe's child process on the CPU: started with its environment, read line by line,
bound to its parent's life, its data segment limited to the budget."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from batchfit import _libc
from batchfit._memwatch import status_bytes
from batchfit.errors import UsageError
from batchfit.search._trials import SearchResult


def child_env() -> dict[str, str]:
    """Environment for a budgeted CPU child: freed blocks go back to the kernel at once."""
    return {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "HF_HUB_OFFLINE": "1"}


def run_child(spec: dict[str, Any], on_line: Callable[[dict[str, Any]], None]) -> SearchResult:
    """Run the probe in a fresh process; stream its trial lines; return its result.

    The child dies with this process (see :func:`_die_with_parent`), and is killed and reaped
    here when this process is interrupted (Ctrl-C, SIGTERM) or fails.
    """
    proc = subprocess.Popen(
        [sys.executable, "-m", "batchfit.search.probe", json.dumps(spec, allow_nan=False)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**child_env(), _PARENT_ENV: str(os.getpid())},
    )
    try:
        final, err = _read_child(proc, on_line)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    if final is None:
        if proc.returncode < 0:
            number = -proc.returncode
            raise UsageError(
                f"the trial process was killed by signal {number}"
                f"{' (out of memory?)' if number == signal.SIGKILL else ''}: no result; "
                "try again with a smaller --memory-budget or --max-micro-batch"
            )
        tail = err.strip().splitlines()[-1] if err.strip() else f"exit code {proc.returncode}"
        raise RuntimeError(f"the probe process failed: {tail}")
    if "usage_error" in final:
        raise UsageError(final["usage_error"])
    return SearchResult.from_json(final["result"])


def _read_child(
    proc: subprocess.Popen[str], on_line: Callable[[dict[str, Any]], None]
) -> tuple[dict[str, Any] | None, str]:
    assert proc.stdout is not None and proc.stderr is not None
    final: dict[str, Any] | None = None
    for line in proc.stdout:
        try:
            message = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "trial" in message or "start" in message:
            on_line(message)
        else:
            final = message
    return final, proc.stderr.read()


# The parent's pid, for the child to notice that it was orphaned.
_PARENT_ENV = "BATCHFIT_PROBE_PARENT"


def die_with_parent() -> None:
    """End this child when its parent dies, however it dies (SIGKILL included): the kernel
    sends SIGKILL on Linux (``PR_SET_PDEATHSIG``); elsewhere a thread polls the parent's pid."""
    parent = int(os.environ.get(_PARENT_ENV, "0")) or os.getppid()
    lib = _libc.libc() if sys.platform == "linux" else None
    if lib is not None:
        _libc.die_with_parent(lib)
    else:
        threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    if os.getppid() != parent:  # the parent died before the line above
        os._exit(1)


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


@contextlib.contextmanager
def limit_data(budget: int | None) -> Iterator[None]:
    if budget is None:
        yield
        return
    old = resource.getrlimit(resource.RLIMIT_DATA)
    resource.setrlimit(resource.RLIMIT_DATA, (status_bytes("VmData") + budget, old[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, old)
