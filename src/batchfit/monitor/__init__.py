"""``batchfit monitor -- CMD ...``: run a training command and watch its memory against a plan.

The command runs as a child in its own process group (stdin, stdout and stderr its own, or its
stdout sent elsewhere), and the whole group gets the signals this process gets (SIGINT, SIGTERM,
SIGHUP): ``monitor -- bash train.sh`` reaches the python that the script starts. When the
command ends, or this process does, what is left of the group gets SIGTERM, then SIGKILL after
``GRACE_SECONDS``; the command also dies if this process is SIGKILLed. Every ``interval``
seconds the memory of its whole process tree is sampled: per-process GPU memory through NVML when
``nvidia-ml-py`` is installed and a GPU is there (what nvidia-smi shows per process), else
the resident set (RSS) from ``/proc``, with each process's high-water mark (VmHWM) and, for
a tree of several processes, pages they share counted once (PSS). Each sample can go to a
JSONL log as it is taken; the result (``MonitorResult``) says the peak, per process too, and
the command's exit code, which the CLI exits with.

Seed 003 asks for "nvidia-smi to verify memory usage matches predictions" and a
``watch -n 1 nvidia-smi`` loop; this is that loop, with the prediction beside it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import IO

from batchfit._libc import libc
from batchfit.monitor._group import GRACE_SECONDS, child_setup, end_group, forwarding_signals
from batchfit.monitor._output import plot, write_log_path
from batchfit.monitor._procfs import command_line, process_tree, pss_bytes, rss_bytes
from batchfit.monitor._result import MonitorResult, Sample, exit_status
from batchfit.monitor._runtime import cached_runtime_bytes, python_of, runtime_bytes

__all__ = [
    "GRACE_SECONDS",
    "INHERITED_SLACK",
    "MonitorResult",
    "Sample",
    "cached_runtime_bytes",
    "command_line",
    "end_group",
    "exit_status",
    "plot",
    "process_tree",
    "pss_bytes",
    "python_of",
    "rss_bytes",
    "run",
    "runtime_bytes",
    "samples_gpu",
    "write_log_path",
]

# what the command may touch between fork and exec beyond the pages it shares with batchfit
INHERITED_SLACK = 16 * 2**20


class _Nvml:
    """GPU memory per process through NVML, when nvidia-ml-py and a GPU are there."""

    def __init__(self) -> None:
        import pynvml  # optional (nvidia-ml-py), and only a GPU run needs NVML's start-up

        pynvml.nvmlInit()
        self.nvml = pynvml
        self.handles = [
            pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())
        ]
        if not self.handles:
            raise RuntimeError("no GPU")

    def usage(self) -> dict[int, int]:
        used: dict[int, int] = {}
        for handle in self.handles:
            for p in self.nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                used[p.pid] = used.get(p.pid, 0) + int(p.usedGpuMemory or 0)
        return used

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.nvml.nvmlShutdown()


def _gpu_reader() -> _Nvml | None:
    try:
        return _Nvml()
    except Exception:  # no nvidia-ml-py, no driver, no GPU: fall back to RSS
        return None


def samples_gpu() -> bool:
    """Whether ``run`` would sample GPU memory here (NVML answers), not resident memory."""
    reader = _gpu_reader()
    if reader is None:
        return False
    reader.close()
    return True


def run(
    command: list[str],
    *,
    interval: float = 1.0,
    log: IO[str] | None = None,
    limit_bytes: int | None = None,
    on_sample: Callable[[Sample, MonitorResult], None] | None = None,
    on_drift: Callable[[Sample], None] | None = None,
    gpu: bool | None = None,
    compare: Callable[[Sample], int] | None = None,
    stdout: int | None = None,
) -> MonitorResult:
    """Run ``command``, sample its process tree every ``interval`` seconds until it exits.

    ``limit_bytes``: ``on_drift`` is called once, the first time a sample passes it (the
    sample's total, or what ``compare`` takes of it: a per-GPU plan is compared with the
    largest process, one rank per GPU). ``gpu``:
    None samples GPU memory when NVML answers, else RSS; False always RSS. ``stdout``: a file
    descriptor for the command's standard output (``2``: this process's stderr), None its
    own. A command that cannot start gives exit code 127 (126 when it is not executable), as
    a shell would, and no samples. The command runs in a process group of its own; what is
    left of it when the command ends (or this function raises) is ended with ``end_group``.

    Example:
        >>> r = run([sys.executable, "-c", "import time; time.sleep(0.3)"], interval=0.05,
        ...         gpu=False)
        >>> r.exit_code, r.samples[0].total_bytes > 0
        (0, True)
    """
    reader = _gpu_reader() if gpu is not False else None
    result = MonitorResult(exit_code=0, seconds=0.0, source="nvml" if reader else "rss")
    start = time.monotonic()
    proc = _start(command, stdout, result)
    if proc is None:
        return result
    watch = _Watch(log, limit_bytes, on_sample, on_drift, compare)
    try:
        with forwarding_signals(proc):
            while True:
                done = _reap(proc, result)
                sample = _sample(proc.pid, reader, time.monotonic() - start, result)
                if sample is not None:
                    watch.record(sample, result)
                if done:
                    break
                _wait(proc, result, interval)
    finally:
        # the command has ended, or this process is ending (an exception): the processes the
        # command started go too (background jobs, a script's python)
        end_group(proc.pid)
        proc.wait()
        if reader is not None:
            reader.close()
    result.exit_code = exit_status(proc.returncode)
    result.seconds = time.monotonic() - start
    return result


def _start(
    command: list[str], stdout: int | None, result: MonitorResult
) -> subprocess.Popen[bytes] | None:
    """The command, started in a session of its own; None when it cannot start (the exit
    code, 127 or 126, and why, are in ``result``)."""
    try:
        proc = subprocess.Popen(
            command,
            stdout=stdout,
            # a group of its own, for the signals and the clean-up; a session of its own, so
            # that the group is not stopped (SIGTTIN/SIGTTOU) for using the terminal from the
            # background
            start_new_session=True,
            preexec_fn=functools.partial(child_setup, libc()) if sys.platform == "linux" else None,
        )
    except FileNotFoundError:
        result.exit_code = 127
        return None
    except OSError as e:  # a folder, no execute permission, not a program (ENOEXEC)
        result.exit_code = 126
        result.start_error = e.strerror or str(e)
        return None
    result.inherited_bytes = rss_bytes(os.getpid(), "VmHWM")
    return proc


@dataclasses.dataclass(frozen=True)
class _Watch:
    """What ``run`` does with each sample: log it, pass it on, compare it with the limit."""

    log: IO[str] | None
    limit_bytes: int | None
    on_sample: Callable[[Sample, MonitorResult], None] | None
    on_drift: Callable[[Sample], None] | None
    compare: Callable[[Sample], int] | None

    def record(self, sample: Sample, result: MonitorResult) -> None:
        result.samples.append(sample)
        if self.log is not None:
            self.log.write(json.dumps(sample.to_json()) + "\n")
            self.log.flush()
        if self.on_sample is not None:
            self.on_sample(sample, result)
        measured = self.compare(sample) if self.compare is not None else sample.total_bytes
        if self.limit_bytes is None or result.drifted_at is not None:
            return
        if measured > self.limit_bytes:
            result.drifted_at = sample.seconds
            if self.on_drift is not None:
                self.on_drift(sample)


def _reap(proc: subprocess.Popen[bytes], result: MonitorResult) -> bool:
    """Whether the command has ended; when it has, reaped here (``os.wait4``) so that its own
    resident high-water mark (``ru_maxrss``, the kernel's) is kept: the growth after the last
    sample is not missed."""
    if proc.returncode is not None:
        return True
    if sys.platform != "linux":
        return proc.poll() is not None
    try:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
    except ChildProcessError:  # reaped elsewhere
        return proc.poll() is not None
    if pid == 0:
        return False
    proc.returncode = os.waitstatus_to_exitcode(status)
    # ru_maxrss (KiB) is the largest resident set of the command or of a descendant it waited
    # for, over its whole life: before exec too, when it held this process's pages (fork), so
    # it can be no larger than this process's own high-water mark then. Above that mark it can
    # only come from after exec: growth after the last sample, kept. At or below it, it may
    # be ours (a small command would report batchfit's ~270 MiB), so it is not used.
    grown = usage.ru_maxrss * 1024
    if grown > result.inherited_bytes + INHERITED_SLACK:
        # the largest process of the tree, not necessarily the command itself: it counts
        # toward the run's peak, not toward any one process's
        result.reaped_peak = grown
    return True


def _wait(proc: subprocess.Popen[bytes], result: MonitorResult, seconds: float) -> None:
    """Sleep ``seconds``, or less when the command ends first."""
    end = time.monotonic() + seconds
    pause = 0.0005
    while not _reap(proc, result):
        left = end - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(pause, left))
        pause = min(pause * 2, 0.05)


def _sample(
    root: int, reader: _Nvml | None, seconds: float, result: MonitorResult
) -> Sample | None:
    pids = process_tree(root)
    if reader is not None:
        used = reader.usage()
        usage = {pid: used[pid] for pid in pids if pid in used}
    else:
        usage = {pid: b for pid in pids if (b := rss_bytes(pid)) > 0}
        for pid in usage:
            if (hwm := rss_bytes(pid, "VmHWM")) > 0:
                result.high_water[pid] = hwm
    for pid in usage:
        # read again each time: a forked worker shows its parent's command line until it
        # execs its own
        result.commands[pid] = command_line(pid) or result.commands.get(pid, "")
    if not usage and reader is None:
        return None  # the tree is gone
    shared_once = None
    if reader is None and len(usage) > 1:
        pss = [pss_bytes(pid) for pid in usage]
        if all(p is not None for p in pss):
            shared_once = sum(p for p in pss if p is not None)
    return Sample(seconds, usage, shared_once)
