"""Where a monitored run goes besides the terminal: the JSONL log and the memory plot."""

from __future__ import annotations

from pathlib import Path
from typing import IO

from batchfit.monitor._result import MonitorResult
from batchfit.views import plots as _plots


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
