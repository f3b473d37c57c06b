"""What a monitored run gives: memory samples of its process tree and the run's result."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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
