"""The command's process group: signals forwarded to it, and what is left of it ended."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import Any

from batchfit._libc import die_with_parent

_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
GRACE_SECONDS = 3.0  # between SIGTERM and SIGKILL for what is left of the command's group


def _signal_group(pgid: int, signum: int) -> bool:
    """Send ``signum`` to every process of group ``pgid``; False when none is left."""
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:
        return False
    except PermissionError:  # a member changed its user (setuid): it is its own now
        return True
    return True


def _group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` is still running (zombies, awaiting their reaper,
    are not)."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # after the command name: state, ppid, pgrp (proc(5))
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            return True
    return False


def end_group(pgid: int, grace: float = GRACE_SECONDS) -> None:
    """SIGTERM what is left of group ``pgid``; SIGKILL it when it outlives ``grace`` seconds."""
    if not _signal_group(pgid, signal.SIGTERM):
        return
    try:
        _wait_group(pgid, grace)
    finally:  # also when a second Ctrl-C cuts the grace short
        if _signal_group(pgid, signal.SIGKILL):
            _wait_group(pgid, 1.0)  # SIGKILL is delivered, not awaited: see it land


def _wait_group(pgid: int, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and _group_alive(pgid):
        time.sleep(0.05)


@contextlib.contextmanager
def forwarding_signals(proc: subprocess.Popen[bytes]) -> Iterator[None]:
    """Send SIGINT, SIGTERM and SIGHUP on to the child's whole process group while it runs
    (main thread only): a shell that runs python does not pass them on itself."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def forward(signum: int, _frame: Any) -> None:
        _signal_group(proc.pid, signum)

    previous = {s: signal.signal(s, forward) for s in _FORWARDED}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def child_setup(lib: ctypes.CDLL | None) -> None:
    """In the command's process, before it starts: die with this process, and take the
    signals it forwards with their default meaning (a shell starts background jobs with
    SIGINT ignored, and an ignored signal stays ignored across exec). Nothing is imported
    here: whatever this does between fork and exec counts in the command's ``ru_maxrss``."""
    for signum in _FORWARDED:
        signal.signal(signum, signal.SIG_DFL)
    # Only the direct child: PDEATHSIG is per process and not inherited across fork, so
    # when this process is SIGKILLed (no ``finally`` runs) the command dies but processes
    # it started may outlive it; every other way out ends the whole group (end_group).
    die_with_parent(lib)
