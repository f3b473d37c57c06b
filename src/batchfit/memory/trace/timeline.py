"""The step's timeline: one dry run of the whole step, its allocation stream turned into
what each category holds after every event, where the phases begin, the peak and the modules
holding the most activation memory there (``views.timeline`` draws it and writes it as a PyTorch
memory snapshot).

A dry run of the whole model (not extrapolated: every layer's allocations are in the stream)
records each allocation and free with its category; on CUDA estimates the caching allocator's
simulated reserve follows the stream too. The timeline ends where the step does: the dry run's
teardown afterwards is not in it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

from batchfit.hardware import GpuSpec
from batchfit.memory.device.allocator import CachingAllocator
from batchfit.memory.device.totals import gpu_extras
from batchfit.memory.trace.result import CATEGORIES
from batchfit.models import ModelInfo
from batchfit.spec import TrainingSetup


@dataclass(frozen=True)
class ModuleGroup:
    """Modules holding activation memory at the peak whose names differ only in a layer index
    (``transformer.h.*.mlp.act`` for ``transformer.h.0.mlp.act`` ... ``transformer.h.11.mlp.act``),
    or one module (``count`` 1, its own name).

    ``each_bytes`` is what every member holds when they all hold the same, else None.
    """

    name: str
    count: int
    total_bytes: int
    each_bytes: int | None


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
    top_modules: list[ModuleGroup]  # the largest by total bytes at the peak, at most three
    reserved: list[int] | None
    events: list[tuple[int, int, str]]  # (key, +bytes / -bytes, category), for the snapshot
    # key -> (phase, module): where each allocation was made, for the snapshot's frames
    origins: dict[int, tuple[str, str]] = field(default_factory=dict)

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
    # lazy: torch and transformers (~2 s), only when a timeline is drawn
    from batchfit.memory.trace.hf import trace_once

    result = trace_once(
        model,
        setup,
        micro=micro_batch_size,
        seq=seq_len,
        device=device,
        workspace=gpu_extras(gpu, setup).workspace if device == "cuda" else 0,
        depth=None,
        grad_accum_steps=traced_micro_steps(grad_accum_steps),
        whole_first_step=True,  # the picture draws both steps
    )
    return from_trace(result, cuda=device == "cuda", setup=setup)


def traced_micro_steps(grad_accum_steps: int) -> int:
    """How many micro-steps each traced optimizer step runs of the ``grad_accum_steps`` asked
    for: at most two. The second holds the gradients the first left, as every later one does,
    so the micro-steps after it are not traced (as for the estimate, ``memory.trace.estimate``)."""
    return min(grad_accum_steps, 2)


def from_trace(result: Any, *, cuda: bool, setup: TrainingSetup) -> StepTimeline:
    """The timeline of a fresh dry run's result (``TraceResult.timeline``).

    It ends where the step does: ``result.events`` was copied when the traced steps returned,
    while the model and optimizer still lived; the frees after it (``timeline.events`` goes
    on when the dry run's tensors are collected) are teardown, which a real step never does.
    """
    timeline = result.timeline
    if timeline is None:
        raise ValueError("the result holds no allocation history (cached or extrapolated)")
    step_events = timeline.events[: len(result.events) or len(timeline.events)]
    held = dict.fromkeys(CATEGORIES, 0)
    series: dict[str, list[int]] = {c: [] for c in CATEGORIES}
    events = []
    origins: dict[int, tuple[str, str]] = {}
    forwards = [p for _, p in timeline.phase_marks if p in ("forward", "zero-grad")]
    # micro-steps are named only when a step has several (gradient accumulation)
    accumulating = "forward,forward" in ",".join(forwards)
    marks = iter([*timeline.phase_marks, (len(step_events) + 1, "")])
    next_mark = next(marks)
    phase, steps_done, micro = "setup", 0, 0
    for i, (key, delta) in enumerate(step_events):
        while next_mark[0] <= i:
            phase = next_mark[1]
            if phase == "forward":
                micro += 1
            elif phase == "zero-grad":
                steps_done, micro = steps_done + 1, 0
            next_mark = next(marks)
        category = timeline.category(key)
        held[category] += delta
        for c in CATEGORIES:
            series[c].append(held[c])
        events.append((key, delta, category))
        if delta > 0 and key not in origins:
            origins[key] = (
                _phase_words(phase, steps_done + 1, micro if accumulating else 0),
                timeline.module_of.get(key, ""),
            )
    totals = [sum(series[c][i] for c in CATEGORIES) for i in range(len(events))]
    peak_index = max(range(len(totals)), key=totals.__getitem__) if totals else 0
    reserved = _reserved_series(step_events, setup) if cuda else None
    return StepTimeline(
        series=series,
        phases=list(timeline.phase_marks),
        peak_index=peak_index,
        peak_label=result.peak.describe(),
        top_modules=group_modules(_activations_by_module(timeline, result.peak.key))[:3],
        reserved=reserved,
        events=events,
        origins=origins,
    )


def _activations_by_module(timeline: Any, peak_key: str) -> dict[str, int]:
    """Activation bytes each module's forward made that are alive at the peak moment
    ``peak_key``; every module, where ``TraceResult.top_modules`` keeps ten (a 12-layer
    stack's twelfth layer would be left out of its group)."""
    by_module: dict[str, int] = {}
    for key in timeline.live_at(timeline.phase_peaks[peak_key].event_index):
        if timeline.category(key) == "activations" and key in timeline.module_of:
            name = timeline.module_of[key]
            by_module[name] = by_module.get(name, 0) + timeline.sizes[key]
    return by_module


_LAYER_INDEX = re.compile(r"(?<![^.])\d+(?![^.])")  # a dotted path component of digits only


def group_modules(by_module: dict[str, int]) -> list[ModuleGroup]:
    """Modules whose names differ only in their first numeric component (a layer of a stack)
    as one group each, largest total first.

    Example:
        >>> mlp = {f"h.{i}.mlp": 3 << 20 for i in range(12)}
        >>> attn = {f"h.{i}.attn": (i + 1) << 20 for i in range(12)}
        >>> for g in group_modules({**mlp, **attn, "lm_head": 50 << 20}):
        ...     print(g)
        ModuleGroup(name='h.*.attn', count=12, total_bytes=81788928, each_bytes=None)
        ModuleGroup(name='lm_head', count=1, total_bytes=52428800, each_bytes=52428800)
        ModuleGroup(name='h.*.mlp', count=12, total_bytes=37748736, each_bytes=3145728)
    """
    members: dict[str, list[tuple[str, int]]] = {}
    for name, nbytes in by_module.items():
        members.setdefault(_LAYER_INDEX.sub("*", name, count=1), []).append((name, nbytes))
    groups = []
    for pattern, found in members.items():
        sizes = {nbytes for _, nbytes in found}
        groups.append(
            ModuleGroup(
                pattern if len(found) > 1 else found[0][0],
                len(found),
                sum(nbytes for _, nbytes in found),
                sizes.pop() if len(sizes) == 1 else None,
            )
        )
    return sorted(groups, key=lambda g: (-g.total_bytes, g.name))


def _phase_words(phase: str, step: int, micro: int) -> str:
    """E.g. "forward (step 2, micro-step 1)"; "setup" for what exists before the first step."""
    if phase in ("", "setup"):
        return "setup (before the step)"
    if phase in ("forward", "backward") and micro:
        return f"{phase} (step {step}, micro-step {micro})"
    return f"{phase} (step {step})"


def _reserved_series(events: list[tuple[int, int]], setup: TrainingSetup) -> list[int]:
    alloc = CachingAllocator(setup.expandable_segments)
    out = []
    for handle, delta in events:
        if delta > 0:
            alloc.malloc(handle, delta)
        elif delta < 0:
            alloc.free(handle)
        out.append(alloc.reserved)
    return out
