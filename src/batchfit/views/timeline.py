"""The step as a picture: memory over one traced training step, by category, and the same
allocation stream in PyTorch's memory-snapshot format.

The step's timeline (``memory.trace.timeline``: a dry run of the whole model) holds each
allocation and free with its category; the picture stacks weights, gradients, optimizer
state, activations and other over the step's allocation events, marks the phases (forward,
backward, optimizer step, zero-grad, per micro-step) and the peak, labelled with its moment
and the modules holding the most activation memory there. On CUDA estimates the caching
allocator's simulated reserve is drawn as a line.

The snapshot (``torch.cuda.memory._snapshot()``'s layout: ``segments`` and ``device_traces``
with ``segment_alloc`` / ``alloc`` / ``free_completed`` / ``segment_free`` actions) opens in
PyTorch's memory visualiser (https://pytorch.org/memory_viz) and in
``python -m torch.cuda._memory_viz`` (``stats``, ``trace_plot``, ``segment_plot``). It is taken
where a real ``_snapshot()`` after a step would be: what the step leaves allocated (weights,
optimizer state, gradients unless zero-grad set them to None) is still in its segments; the
dry run's teardown afterwards is not in it. Each allocation's ``frames`` say what the trace
knows of it: its category, the module whose forward made it, and the phase (which step and
micro-step). Addresses are made up (each allocation a segment of its own, so nothing is
cached), sizes and order are the dry run's.
"""

from __future__ import annotations

import itertools
import os
import pickle
from pathlib import Path
from typing import Any

from batchfit.errors import UsageError
from batchfit.memory.device.allocator import round_size
from batchfit.memory.trace.result import CATEGORIES
from batchfit.memory.trace.timeline import ModuleGroup, StepTimeline
from batchfit.views import plots as _plots

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


def plot(
    tl: StepTimeline,
    path: Path,
    title: str,
    gpu_bytes: int | None = None,
    peak_bytes: int | None = None,
) -> None:
    """The stacked picture (GiB over allocation events), phases shaded, the peak marked."""
    _plots.save(figure(tl, title, gpu_bytes, peak_bytes), path, "--timeline")


def peak_text(tl: StepTimeline, peak_bytes: int | None = None) -> str:
    """The peak box's first line: ``peak_bytes`` (the estimate's figure, as its table gives
    it) where given, and this whole-step dry run's own peak, named as such, where it differs.

    Example:
        >>> t = StepTimeline({"weights": [0, 2 << 30]}, [], 1, "backward", [], None,
        ...                  [(0, 2 << 30, "weights")])
        >>> peak_text(t, 2 << 30)
        'peak 2.00 GiB (the estimate): backward'
        >>> print(peak_text(t, 3 << 30))
        peak 3.00 GiB (the estimate): backward
        (this whole-step dry run's own peak: 2.00 GiB)
    """
    own = _plots.gib(tl.peak_bytes)
    if peak_bytes is None:
        return f"peak {own:.2f} GiB: {tl.peak_label}"
    shown = _plots.gib(peak_bytes)
    text = f"peak {shown:.2f} GiB (the estimate): {tl.peak_label}"
    if f"{own:.2f}" != f"{shown:.2f}":
        text += f"\n(this whole-step dry run's own peak: {own:.2f} GiB)"
    return text


def figure(
    tl: StepTimeline, title: str, gpu_bytes: int | None = None, peak_bytes: int | None = None
) -> Any:
    """:func:`plot`'s matplotlib figure, laid out: the legend right of the axes, the peak's
    label above everything drawn (the y axis is stretched to leave it room). ``peak_bytes``:
    the estimate's peak, which the box gives (the figure of the estimate's table)."""
    plt = _plots.pyplot()
    fig, ax = plt.subplots(figsize=(11, 5))
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
    top = max(lower, default=0.0)
    if tl.reserved is not None:
        reserved = [_plots.gib(tl.reserved[i]) for i in xs]
        ax.step(xs, reserved, where="mid", color="black", lw=1, label="reserved")
        top = max(top, *reserved)
    if gpu_bytes:
        ax.axhline(_plots.gib(gpu_bytes), color="black", linestyle=":", lw=1, label="GPU memory")
        top = max(top, _plots.gib(gpu_bytes))
    ax.set_xlim(0, max(1, n - 1))
    ax.set_ylim(0, max(top, 1e-3) * 1.05)
    ax.set_xlabel("allocation events of the traced step (forward, backward, optimizer step)")
    ax.set_ylabel("GiB")
    ax.set_title(title)
    # outside the axes: inside, its seven entries covered the curve's right half
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=9)
    if n:
        peak = _plots.gib(tl.peak_bytes)
        # the marker sits just above the peak, pointing at it
        ax.plot([tl.peak_index], [peak * 1.04], "v", color="black", markersize=8)
        label = ax.annotate(
            f"{peak_text(tl, peak_bytes)}\n{peak_modules_text(tl.top_modules)}",
            (tl.peak_index, peak * 1.06),
            xytext=(0.01, 0.98),
            textcoords="axes fraction",
            va="top",
            fontsize=9,
            bbox={"boxstyle": "round", "facecolor": "white", "alpha": 0.9, "lw": 0.5},
            arrowprops={"arrowstyle": "->", "lw": 0.8},
        )
        _make_room_for(fig, ax, label, max(top, peak * 1.08))
    return fig


def _make_room_for(fig: Any, ax: Any, label: Any, top: float) -> None:
    """Stretch the y axis so that everything drawn (up to ``top``, in data units) stays below
    ``label``, a box placed in axes fraction at the top: the box's height is known only once
    drawn, in the layout the picture is saved with."""
    fig.tight_layout()
    fig.canvas.draw()
    box = label.get_bbox_patch().get_window_extent()
    bottom = ax.transAxes.inverted().transform((0, box.y0))[1]  # axes fraction
    ax.set_ylim(0, top / max(0.2, bottom - 0.02))


_PLOT_POINTS = 500  # about 2 pixels a bin at the picture's width


def peak_modules_text(top_modules: list[ModuleGroup]) -> str:
    """The peak label's second part: the modules holding the most activation memory, one a
    line so that long module paths stay readable; a stack's layers as one line, with their
    count and each one's size (or the total, when their sizes differ).

    Example:
        >>> from batchfit.memory.trace.timeline import group_modules
        >>> print(peak_modules_text(group_modules({
        ...     **{f"h.{i}.mlp": 84 << 20 for i in range(12)},
        ...     **{f"h.{i}.attn": (i + 80) << 20 for i in range(12)},
        ...     "lm_head": 5 << 20,
        ... })))
        most activation memory:
          h.*.attn: 12 layers, 1.00 GiB
          h.*.mlp: 12 × 84.0 MiB
          lm_head: 5.0 MiB
    """
    if not top_modules:
        return "most activation memory: -"
    lines = [f"  {g.name}: {_group_size_text(g)}" for g in top_modules]
    return "\n".join(["most activation memory:", *lines])


def _group_size_text(group: ModuleGroup) -> str:
    if group.count == 1:
        return _size_text(group.total_bytes)
    if group.each_bytes is not None:
        return f"{group.count} × {_size_text(group.each_bytes)}"
    return f"{group.count} layers, {_size_text(group.total_bytes)}"


def _size_text(nbytes: int) -> str:
    """GiB from 1 GiB up (two decimals), MiB below (one decimal)."""
    if nbytes >= 1 << 30:
        return f"{nbytes / (1 << 30):.2f} GiB"
    return f"{nbytes / (1 << 20):.1f} MiB"


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
    """The allocation stream in the layout of ``torch.cuda.memory._snapshot()``, taken at the
    end of the step: ``segments`` hold what is still allocated then, ``device_traces`` the
    step's events. Each allocation is a segment of its own (``segment_alloc`` before its
    ``alloc``, ``segment_free`` after its ``free_completed``), so PyTorch's segment view can
    replay the trace backwards from the final state; trace sizes are the bytes asked for (the
    trace's peak is ``peak_bytes``), blocks and segments the 512 B-rounded ones."""
    live: dict[int, tuple[int, int, list[dict[str, Any]]]] = {}  # key -> (addr, size, frames)
    trace: list[dict[str, Any]] = []
    next_addr = 1 << 32

    def event(action: str, addr: int, size: int, frames: list[dict[str, Any]]) -> None:
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

    for key, delta, category in tl.events:
        if delta > 0:
            frames = _frames(tl, key, category)
            live[key] = (next_addr, delta, frames)
            event("segment_alloc", next_addr, round_size(delta), frames)
            event("alloc", next_addr, delta, frames)
            next_addr += round_size(delta)
        elif delta < 0 and key in live:
            addr, size, frames = live.pop(key)
            event("free_completed", addr, size, frames)
            event("segment_free", addr, round_size(size), frames)
        # delta == 0: an empty storage, nothing to draw
    segments = []
    for addr, size, frames in live.values():
        block_size = round_size(size)
        block = {
            "address": addr,
            "size": block_size,
            "requested_size": size,
            "state": "active_allocated",
            "frames": frames,
        }
        segments.append(
            {
                "device": 0,
                "address": addr,
                "total_size": block_size,
                "allocated_size": block_size,
                "active_size": block_size,
                "requested_size": size,
                "stream": 0,
                "segment_type": "small" if block_size <= 1 << 20 else "large",
                "segment_pool_id": (0, 0),
                "is_expandable": False,
                "frames": frames,
                "blocks": [block],
            }
        )
    return {
        "segments": segments,
        "device_traces": [trace],
        "allocator_settings": {},
        "device": device,
    }


def _frames(tl: StepTimeline, key: int, category: str) -> list[dict[str, Any]]:
    """What the visualiser shows as an allocation's stack, innermost first: the module whose
    forward made it (when the trace knows it) with its category, then the phase."""
    phase, module = tl.origins.get(key, ("", ""))
    return [
        {"filename": module or "(outside any module's forward)", "line": 0, "name": category},
        {"filename": phase or "batchfit dry run", "line": 0, "name": "batchfit dry run"},
    ]


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
