"""The step as a picture: memory over one traced training step, by category, and the same
allocation stream in PyTorch's memory-snapshot format (issue #14, part 1).

A dry run of the whole model (not extrapolated: every layer's allocations are in the stream)
records each allocation and free with its category; the picture stacks weights, gradients,
optimizer state, activations and other over the step's allocation events, marks the phases
(forward, backward, optimizer step, zero-grad, per micro-step) and the peak, labelled with
its moment and the modules holding the most activation memory there. On CUDA estimates the
caching allocator's simulated reserve is drawn as a line.

The snapshot (``torch.cuda.memory._snapshot()``'s layout: ``segments`` and ``device_traces``
with ``alloc`` / ``free_completed`` actions) opens in PyTorch's memory visualiser
(https://pytorch.org/memory_viz) and in ``python -m torch.cuda._memory_viz``. Addresses are
made up (each allocation its own), sizes and order are the dry run's.
"""

from __future__ import annotations

import itertools
import os
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from batchfit.errors import UsageError
from batchfit.hardware import GpuSpec
from batchfit.memory._trace_result import CATEGORIES
from batchfit.models import ModelInfo
from batchfit.spec import TrainingSetup

_PHASE_COLOURS = {
    "forward": "#e8f0fb",
    "backward": "#fbeee6",
    "optimizer-step": "#eaf6ea",
    "zero-grad": "#f3f3f3",
}
_CATEGORY_COLOURS = {
    "weights": "tab:blue",
    "gradients": "tab:orange",
    "optimizer_state": "tab:green",
    "activations": "tab:red",
    "other": "tab:gray",
}


@dataclass(frozen=True)
class StepTimeline:
    """Bytes held after each allocation event, by category; where the phases begin; the peak.

    ``series[c][i]`` is what category ``c`` holds after event ``i``; ``reserved`` the caching
    allocator's reserve then (CUDA estimates), else None.
    """

    series: dict[str, list[int]]
    phases: list[tuple[int, str]]
    peak_index: int
    peak_label: str
    top_modules: list[tuple[str, int]]
    reserved: list[int] | None
    events: list[tuple[int, int, str]]  # (key, +bytes / -bytes, category), for the snapshot

    @property
    def peak_bytes(self) -> int:
        return sum(s[self.peak_index] for s in self.series.values()) if self.events else 0


def step_timeline(
    model: ModelInfo,
    setup: TrainingSetup,
    *,
    micro_batch_size: int,
    seq_len: int,
    device: Literal["cpu", "cuda"],
    gpu: GpuSpec | None,
    grad_accum_steps: int = 1,
) -> StepTimeline:
    """Dry-run the whole step of ``model`` (``setup`` resolved) once and return its timeline."""
    from batchfit.memory._device import gpu_extras
    from batchfit.memory._hf_trace import trace_once

    result = trace_once(
        model,
        setup,
        micro=micro_batch_size,
        seq=seq_len,
        device=device,
        workspace=gpu_extras(gpu, setup).workspace if device == "cuda" else 0,
        depth=None,
        grad_accum_steps=min(grad_accum_steps, 2),
    )
    return from_trace(result, cuda=device == "cuda", setup=setup)


def from_trace(result: Any, *, cuda: bool, setup: TrainingSetup) -> StepTimeline:
    """The timeline of a fresh dry run's result (``TraceResult.timeline``)."""
    timeline = result.timeline
    if timeline is None:
        raise ValueError("the result holds no allocation history (cached or extrapolated)")
    held = dict.fromkeys(CATEGORIES, 0)
    series: dict[str, list[int]] = {c: [] for c in CATEGORIES}
    events = []
    for key, delta in timeline.events:
        category = timeline.category(key)
        held[category] += delta
        for c in CATEGORIES:
            series[c].append(held[c])
        events.append((key, delta, category))
    totals = [sum(series[c][i] for c in CATEGORIES) for i in range(len(events))]
    peak_index = max(range(len(totals)), key=totals.__getitem__) if totals else 0
    reserved = _reserved_series(timeline.events, setup) if cuda else None
    return StepTimeline(
        series=series,
        phases=list(timeline.phase_marks),
        peak_index=peak_index,
        peak_label=result.peak.describe(),
        top_modules=[(str(m[0]), int(m[1])) for m in result.top_modules[:3]],
        reserved=reserved,
        events=events,
    )


def _reserved_series(events: list[tuple[int, int]], setup: TrainingSetup) -> list[int]:
    from batchfit.memory.allocator import CachingAllocator

    alloc = CachingAllocator(setup.expandable_segments)
    out = []
    for handle, delta in events:
        if delta > 0:
            alloc.malloc(handle, delta)
        elif delta < 0:
            alloc.free(handle)
        out.append(alloc.reserved)
    return out


def plot(tl: StepTimeline, path: Path, title: str, gpu_bytes: int | None = None) -> None:
    """The stacked picture (GiB over allocation events), phases shaded, the peak marked."""
    from batchfit import _plots

    plt = _plots.pyplot()
    fig, ax = plt.subplots(figsize=(10, 5))
    n = len(tl.events)
    xs = _binned(tl, _PLOT_POINTS)
    lower = [0.0] * len(xs)
    for c in CATEGORIES:  # stacked, drawn as steps: a one-event spike keeps its bin's width
        upper = [lo + _plots.gib(tl.series[c][i]) for lo, i in zip(lower, xs, strict=True)]
        ax.fill_between(
            xs,
            lower,
            upper,
            step="mid",
            color=_CATEGORY_COLOURS[c],
            alpha=0.85,
            lw=0,
            label=c.replace("_", " "),
        )
        lower = upper
    marks = [*tl.phases, (n, "")]
    shown: set[str] = set()
    for (start, phase), (end, _) in itertools.pairwise(marks):
        if end > start and phase in _PHASE_COLOURS:
            ax.axvspan(start, end, color=_PHASE_COLOURS[phase], zorder=0, lw=0)
            if phase not in shown and end - start > n / 30:
                ax.text((start + end) / 2, 0, phase, ha="center", va="bottom", fontsize=9)
                shown.add(phase)
    if tl.reserved is not None:
        reserved = [_plots.gib(tl.reserved[i]) for i in xs]
        ax.step(xs, reserved, where="mid", color="black", lw=1, label="reserved")
    if gpu_bytes:
        ax.axhline(_plots.gib(gpu_bytes), color="black", linestyle=":", lw=1, label="GPU memory")
    if n:
        peak = _plots.gib(tl.peak_bytes)
        # the marker sits just above the peak, pointing at it
        ax.plot([tl.peak_index], [peak * 1.04], "v", color="black", markersize=8)
        modules = ", ".join(m for m, _ in tl.top_modules) or "-"
        ax.annotate(
            f"peak {peak:.2f} GiB: {tl.peak_label}\nmost activation memory: {modules}",
            (tl.peak_index, peak * 1.06),
            xytext=(0.02, 0.97),
            textcoords="axes fraction",
            va="top",
            fontsize=9,
            bbox={"boxstyle": "round", "facecolor": "white", "alpha": 0.9, "lw": 0.5},
            arrowprops={"arrowstyle": "->", "lw": 0.8},
        )
    ax.set_xlim(0, max(1, n - 1))
    ax.set_ylim(bottom=0)
    ax.set_xlabel("allocation events of the traced step (forward, backward, optimizer step)")
    ax.set_ylabel("GiB")
    ax.set_title(title)
    ax.legend(loc="upper right", fontsize=9)
    _plots.save(fig, path, "--timeline")


_PLOT_POINTS = 500  # about 2 pixels a bin at the picture's width


def _binned(tl: StepTimeline, points: int) -> list[int]:
    """Event indices to draw: in each of ``points`` bins the one holding the most, so that a
    one-event spike (the logits) stays visible at any width; the peak always among them."""
    n = len(tl.events)
    if n <= points:
        return list(range(n))
    totals = [sum(tl.series[c][i] for c in CATEGORIES) for i in range(n)]
    width = n / points
    chosen = {tl.peak_index}
    for b in range(points):
        lo, hi = int(b * width), min(n, int((b + 1) * width))
        if hi > lo:
            chosen.add(max(range(lo, hi), key=totals.__getitem__))
    return sorted(chosen)


def snapshot(tl: StepTimeline, device: str) -> dict[str, Any]:
    """The allocation stream in the layout of ``torch.cuda.memory._snapshot()``."""
    addresses: dict[int, tuple[int, int]] = {}
    trace: list[dict[str, Any]] = []
    next_addr = 1 << 32
    for key, delta, category in tl.events:
        if delta == 0:  # empty storages: nothing to draw
            continue
        frames = [{"filename": f"batchfit dry run ({category})", "line": 0, "name": category}]
        if delta > 0:
            size = delta
            addresses[key] = (next_addr, size)
            action, addr = "alloc", next_addr
            next_addr += (size + 511) // 512 * 512
        else:
            addr, size = addresses.pop(key, (0, -delta))
            action = "free_completed"
        trace.append(
            {
                "action": action,
                "addr": addr,
                "size": size,
                "stream": 0,
                "frames": frames,
                "time_us": len(trace),
            }
        )
    blocks = [
        {
            "address": addr,
            "size": size,
            "requested_size": size,
            "state": "active_allocated",
            "frames": [],
        }
        for addr, size in addresses.values()
    ]
    segments = [
        {
            "device": 0,
            "address": b["address"],
            "total_size": b["size"],
            "allocated_size": b["size"],
            "active_size": b["size"],
            "requested_size": b["size"],
            "stream": 0,
            "segment_type": "large",
            "segment_pool_id": (0, 0),
            "is_expandable": False,
            "frames": [],
            "blocks": [b],
        }
        for b in blocks
    ]
    return {
        "segments": segments,
        "device_traces": [trace],
        "allocator_settings": {},
        "device": device,
    }


def write_snapshot(tl: StepTimeline, path: Path, device: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            pickle.dump(snapshot(tl, device), f)
        os.replace(tmp, path)
    except OSError as e:
        raise UsageError(f"cannot write --snapshot {path}: {e.strerror}") from None
    finally:
        if tmp.exists():
            tmp.unlink()
