"""The C library through ctypes, without torch: a child between fork and exec may call it
(importing torch there cost the monitored command 2 s and 300 MiB, counted as its own)."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import signal

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


@functools.cache
def libc() -> ctypes.CDLL | None:
    """glibc (or the platform's C library); None where it cannot be loaded."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


def die_with_parent(lib: ctypes.CDLL | None) -> None:
    """Ask Linux to SIGKILL this process when its parent dies (``PR_SET_PDEATHSIG``)."""
    if lib is not None:
        lib.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
