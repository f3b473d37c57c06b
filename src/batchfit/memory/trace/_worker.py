"""A second process that traces one dry run of a pair while this process traces the other.

A dry run is single-threaded Python (fake-tensor dispatch), and a cut model is traced at two
depths that do not depend on each other: on a machine with two cores or more, one helper
process runs the shallower while this one runs the deeper, so a pair costs about one dry run.
The helper starts when the first dry run is needed, before this process imports torch, so the
two imports run side by side too; it serves every pair of the process after that, and ends
when this process does (its requests' pipe closes; on Linux the kernel also kills it).

Requests and answers are pickles on the helper's standard input and output, each behind its
length. Anything the helper cannot answer (it did not start, died, or raised) is traced here
instead, so the result and any error are the ones a dry run in this process gives.
``BATCHFIT_TRACE_JOBS=1`` turns the helper off.

Importing this module imports neither torch nor transformers.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pickle
import select
import struct
import subprocess
import sys
import time
from typing import IO, Any

__all__ = ["Helper", "helper", "jobs", "trace_here"]

JOBS_ENV = "BATCHFIT_TRACE_JOBS"
_LENGTH = struct.Struct("<Q")


def trace_here(model: Any, setup: Any, **kw: Any) -> Any:
    """``hf.trace_once`` in this process, imported on first use: torch and transformers (~5 s)
    only when no cached result answers, and after the dry run is announced (the live line's
    clock runs through the import)."""
    from batchfit.memory.trace import hf

    return hf.trace_once(model, setup, **kw)


def jobs() -> int:
    """How many processes trace side by side: ``BATCHFIT_TRACE_JOBS``, else 2 where this
    process may run on two cores or more, else 1 (always 1 on Windows)."""
    if sys.platform == "win32":  # the answer's wait polls a pipe (select), POSIX only
        return 1
    given = os.environ.get(JOBS_ENV, "").strip()
    if given.isdigit() and int(given) >= 1:
        return min(int(given), 2)  # a pair is the unit: a third process has nothing to do
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return 2 if cores >= 2 else 1


def _send(stream: IO[bytes], obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_LENGTH.pack(len(data)) + data)
    stream.flush()


def _read_exactly(fd: int, size: int, deadline: float | None) -> bytes:
    """``size`` bytes from ``fd``; EOFError where it ends, TimeoutError past ``deadline``
    (``time.monotonic()``; None waits as long as it takes)."""
    chunks, left = [], size
    while left:
        wait = None if deadline is None else deadline - time.monotonic()
        if wait is not None and (wait <= 0 or not select.select([fd], [], [], wait)[0]):
            raise TimeoutError
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _receive(fd: int, deadline: float | None = None) -> Any:
    """The next object on ``fd`` (its length, then its pickle); EOFError where the pipe ended,
    TimeoutError past ``deadline``."""
    size = _LENGTH.unpack(_read_exactly(fd, _LENGTH.size, deadline))[0]
    return pickle.loads(_read_exactly(fd, size, deadline))


class Helper:
    """The helper process; one request at a time. ``command`` runs another program in its
    place (tests)."""

    def __init__(self, command: list[str] | None = None) -> None:
        self._proc = subprocess.Popen(
            command or [sys.executable, "-m", __name__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        self._pending = False

    @property
    def alive(self) -> bool:
        return self._proc.poll() is None

    def submit(self, request: tuple[Any, ...]) -> bool:
        """Send ``(model, setup, keywords)`` for ``trace_once``; False where it cannot be sent."""
        assert self._proc.stdin is not None and not self._pending
        try:
            _send(self._proc.stdin, request)
        except (OSError, pickle.PicklingError, TypeError, AttributeError):
            self.close()
            return False
        self._pending = True
        return True

    def result(self, timeout: float) -> Any | None:
        """The submitted dry run's result; None where the helper failed it, died, or gave no
        answer within ``timeout`` seconds (then it is stopped)."""
        assert self._proc.stdout is not None and self._pending
        self._pending = False
        try:
            status, value = _receive(self._proc.stdout.fileno(), time.monotonic() + timeout)
        except (OSError, EOFError, pickle.UnpicklingError, AttributeError, ImportError):
            self.close()  # TimeoutError is an OSError
            return None
        return value if status == "ok" else None

    def close(self) -> None:
        for stream in (self._proc.stdin, self._proc.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()


_helper: list[Helper | None] = [None]
_failed: list[bool] = [False]


def helper() -> Helper | None:
    """This process's helper, started on first use; None where one process traces (one core,
    ``BATCHFIT_TRACE_JOBS=1``), or where it could not start or died (then none is tried
    again)."""
    current = _helper[0]
    if current is not None and current.alive:
        return current
    if current is not None or _failed[0] or jobs() < 2:
        _failed[0] = _failed[0] or current is not None
        return None
    try:
        started = _helper[0] = Helper()
    except OSError:
        _failed[0] = True
        return None
    atexit.register(started.close)
    return started


def _serve() -> None:
    """The helper's loop: import the trace engine, then answer requests until the pipe ends."""
    import signal

    from batchfit import _libc

    # Ctrl-C reaches the whole process group: the parent decides; the helper ends with it
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform == "linux":
        parent = os.getppid()
        _libc.die_with_parent(_libc.libc())
        if os.getppid() != parent:
            os._exit(0)
    answers = os.fdopen(os.dup(1), "wb")
    requests = sys.stdin.fileno()
    quiet = os.open(os.devnull, os.O_WRONLY)
    os.dup2(quiet, 1)  # nothing the libraries print may corrupt the answers
    from batchfit.memory.trace.hf import trace_once

    while True:
        try:
            model, setup, keywords = _receive(requests)
        except EOFError:
            return
        try:
            answer: tuple[str, Any] = ("ok", trace_once(model, setup, **keywords))
        except Exception as error:  # the parent traces it again, and raises it there
            answer = ("error", repr(error))
        try:
            _send(answers, answer)
        except (OSError, pickle.PicklingError):
            return


if __name__ == "__main__":
    _serve()
