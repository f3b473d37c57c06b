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
import ctypes
import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from batchfit._libc import die_with_parent, libc
from batchfit._units import BYTES_IN_KIB

_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
GRACE_SECONDS = 3.0  # between SIGTERM and SIGKILL for what is left of the command's group
# what the command may touch between fork and exec beyond the pages it shares with batchfit
INHERITED_SLACK = 16 * 2**20


@dataclass(frozen=True)
class Sample:
    """One look at the process tree: seconds since start, bytes per process (pid -> bytes).

    ``shared_once``: the tree's total with pages that several processes share counted once
    (the sum of their PSS, /proc/PID/smaps_rollup), where the tree has more than one process
    on the CPU; a forked DataLoader worker shares the parent's libraries and tensors, and the
    sum of RSS counts them in every process. None: the plain sum.
    """

    seconds: float
    processes: dict[int, int]
    shared_once: int | None = None

    @property
    def total_bytes(self) -> int:
        if self.shared_once is not None:
            return self.shared_once
        return sum(self.processes.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "seconds": round(self.seconds, 3),
            "bytes": self.total_bytes,
            "processes": {str(pid): b for pid, b in self.processes.items()},
        }


@dataclass
class MonitorResult:
    """What a monitored run did: its exit code, time, memory samples and peaks."""

    exit_code: int
    seconds: float
    source: str  # "nvml" (GPU memory per process) or "rss" (resident memory, /proc)
    samples: list[Sample] = field(default_factory=list)
    commands: dict[int, str] = field(default_factory=dict)  # pid -> command line
    drifted_at: float | None = None  # seconds into the run when memory first passed the limit
    # pid -> the kernel's resident high-water mark (VmHWM) last read: on the CPU a process's
    # peak between two samples is not missed
    high_water: dict[int, int] = field(default_factory=dict)
    # this process's resident high-water mark once the command started: the most the command
    # can have held before its exec (its pages were ours)
    inherited_bytes: int = 0
    # the kernel's peak of the largest process in the tree, read when the command was reaped
    # (0 where it could be batchfit's own pages)
    reaped_peak: int = 0
    start_error: str = ""  # why the command could not start (exit code 126)

    @property
    def peak_bytes(self) -> int:
        sampled = max((s.total_bytes for s in self.samples), default=0)
        return max(sampled, max(self.high_water.values(), default=0), self.reaped_peak)

    def process_peaks(self) -> dict[int, int]:
        peaks: dict[int, int] = dict(self.high_water)
        for s in self.samples:
            for pid, b in s.processes.items():
                peaks[pid] = max(peaks.get(pid, 0), b)
        return peaks

    def to_json(self) -> dict[str, Any]:
        """``peak_bytes``, ``samples``, ``exit_code``, ``seconds``, ``processes``
        (docs/design.md)."""
        return {
            "peak_bytes": self.peak_bytes,
            "samples": len(self.samples),
            "exit_code": self.exit_code,
            "seconds": round(self.seconds, 3),
            "source": self.source,
            "drifted_at_seconds": self.drifted_at,
            "processes": [
                {"pid": pid, "peak_bytes": peak, "command": self.commands.get(pid, "")}
                for pid, peak in sorted(self.process_peaks().items())
            ],
        }


def exit_status(returncode: int) -> int:
    """A shell's exit status for a child's return code (killed by signal N: 128 + N)."""
    return 128 - returncode if returncode < 0 else returncode


def _children() -> dict[int, list[int]]:
    """Parent pid -> child pids, for every process in /proc."""
    tree: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # the command name (field 2) may hold spaces and parentheses: split after the last ')'
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        tree.setdefault(ppid, []).append(int(entry.name))
    return tree


def process_tree(root: int) -> list[int]:
    """``root`` and all its descendants that are alive."""
    tree = _children()
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(tree.get(pid, ()))
    return found


def rss_bytes(pid: int, field: str = "VmRSS") -> int:
    """Resident memory of ``pid`` (0 once it is gone); ``field="VmHWM"``: its high-water mark."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) * BYTES_IN_KIB
    except OSError:
        pass
    return 0


def pss_bytes(pid: int) -> int | None:
    """Proportional resident memory of ``pid`` (a page shared by N processes counts 1/N);
    None where the kernel does not say (no smaps_rollup: Linux before 4.14, or gone)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * BYTES_IN_KIB
    except OSError:
        pass
    return None


def command_line(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


class _Nvml:
    """GPU memory per process through NVML, when nvidia-ml-py and a GPU are there."""

    def __init__(self) -> None:
        import pynvml

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
def _forward_signals(proc: subprocess.Popen[bytes]) -> Iterator[None]:
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


def _child_setup(lib: ctypes.CDLL | None) -> None:
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
    try:
        proc = subprocess.Popen(
            command,
            stdout=stdout,
            # a group of its own, for the signals and the clean-up; a session of its own, so
            # that the group is not stopped (SIGTTIN/SIGTTOU) for using the terminal from the
            # background
            start_new_session=True,
            preexec_fn=functools.partial(_child_setup, libc()) if sys.platform == "linux" else None,
        )
    except FileNotFoundError:
        result.exit_code = 127
        return result
    except OSError as e:  # a folder, no execute permission, not a program (ENOEXEC)
        result.exit_code = 126
        result.start_error = e.strerror or str(e)
        return result
    result.inherited_bytes = rss_bytes(os.getpid(), "VmHWM")
    try:
        with _forward_signals(proc):
            while True:
                done = _reap(proc, result)
                sample = _sample(proc.pid, reader, time.monotonic() - start, result)
                if sample is not None:
                    result.samples.append(sample)
                    if log is not None:
                        log.write(json.dumps(sample.to_json()) + "\n")
                        log.flush()
                    if on_sample is not None:
                        on_sample(sample, result)
                    measured = compare(sample) if compare is not None else sample.total_bytes
                    if (
                        limit_bytes is not None
                        and result.drifted_at is None
                        and measured > limit_bytes
                    ):
                        result.drifted_at = sample.seconds
                        if on_drift is not None:
                            on_drift(sample)
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


def write_log_path(path: Path) -> IO[str]:
    """Open ``path`` for the JSONL log (line-buffered)."""
    return open(path, "w", buffering=1)


def plot(
    result: MonitorResult,
    path: Path,
    limit_bytes: int | None,
    planned: int | None,
    plan_label: str = "plan",
) -> None:
    """Memory over time (GiB, seconds): the total, the plan's figure and its limit."""
    from batchfit.views import plots as _plots

    plt = _plots.pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    xs = [s.seconds for s in result.samples]
    ax.plot(
        xs,
        [_plots.gib(s.total_bytes) for s in result.samples],
        color="tab:blue",
        label=result.source,
    )
    if planned:
        ax.axhline(_plots.gib(planned), color="tab:green", linestyle="--", label=plan_label)
    if limit_bytes:
        ax.axhline(_plots.gib(limit_bytes), color="tab:red", linestyle=":", label="plan + headroom")
    if result.samples:
        peak = max(result.samples, key=lambda s: s.total_bytes)
        ax.plot([peak.seconds], [_plots.gib(peak.total_bytes)], "*", color="black", markersize=12)
    ax.set_xlabel("seconds")
    ax.set_ylabel("GiB")
    ax.set_ylim(bottom=0)
    ax.set_title(
        f"peak {_plots.gib(result.peak_bytes):.2f} GiB ({result.source}), exit code "
        f"{result.exit_code}"
    )
    ax.legend(loc="lower right")
    _plots.save(fig, path)


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
    import shutil

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
