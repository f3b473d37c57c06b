"""Rendering of ``batchfit monitor``: the live line on a terminal, the drift warning and the
summary, all on stderr (stdout is the command's, or the JSON object's)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from batchfit._units import BYTES_IN_GIB, human_bytes

if TYPE_CHECKING:
    from batchfit.monitor import MonitorResult, Sample


class LiveLine:
    """One line on stderr, rewritten at each sample: current, peak, and the plan's figure."""

    def __init__(self, *, enabled: bool, planned: int | None) -> None:
        self.enabled, self.planned, self.peak = enabled, planned, 0

    def show(self, sample: Sample) -> None:
        self.peak = max(self.peak, sample.total_bytes)
        if not self.enabled:
            return
        gib = sample.total_bytes / BYTES_IN_GIB
        line = f"monitor: {gib:.2f} GiB now, peak {self.peak / BYTES_IN_GIB:.2f} GiB"
        if self.planned:
            line += f", plan {self.planned / BYTES_IN_GIB:.2f} GiB"
        sys.stderr.write("\r" + line[:120].ljust(80))
        sys.stderr.flush()

    def clear(self) -> None:
        if self.enabled:
            sys.stderr.write("\r" + " " * 80 + "\r")
            sys.stderr.flush()


def drift_warning(measured: int, seconds: float, model: str, planned: int | None) -> str:
    """The line the moment a run passes its plan's figure by more than the headroom."""
    return (
        f"batchfit monitor: warning: {human_bytes(measured)} at "
        f"{seconds:.0f} s is above the plan for {model} ({human_bytes(planned or 0)}) "
        f"by more than its headroom"
    )


def summary(result: MonitorResult, planned: int | None, runtime: int | None) -> str:
    """The last line: the peak, how long, how many samples, the exit code, the plan."""
    return (
        f"batchfit monitor: peak {human_bytes(result.peak_bytes)} ({result.source}) over "
        f"{result.seconds:.1f} s, {len(result.samples)} samples, exit code {result.exit_code}"
        + (f"; plan {human_bytes(planned)}" if planned else "")
        + (f" (with {human_bytes(runtime)} of runtime: interpreter, torch)" if runtime else "")
    )
