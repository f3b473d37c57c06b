"""What a traced step found, without torch: each moment's peak, and depth extrapolation.

Kept apart from the tracing itself (``dry_run``) so that results read back from the cache
need neither torch nor transformers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

CATEGORIES = ("weights", "gradients", "optimizer_state", "activations", "other")

PHASES = ("forward", "backward", "optimizer-step", "zero-grad")


@dataclass(frozen=True)
class PhaseResult:
    """Components at one moment's peak (bytes).

    ``phase`` is forward, backward, optimizer-step or zero-grad; ``moment`` says which part of
    it (``s2m1`` = step 2, first micro-step; ``.0below``, ``.0bottom``, ``.0middle``, ``.0top``
    = below the layer stack, in its bottom, a middle or its top layer; ``.head`` = the output
    head and loss: after the stack in forward, before it in backward).
    """

    phase: str
    components: dict[str, int]
    moment: str = ""

    @property
    def total(self) -> int:
        return sum(self.components.values())

    @property
    def key(self) -> str:
        return f"{self.phase}|{self.moment}"

    def describe(self) -> str:
        """The moment in words, e.g. "backward (step 2, in the top layer)"."""
        head, _, where = self.moment.partition(".")
        parts = []
        if head.startswith("s"):
            step, _, micro = head[1:].partition("m")
            parts.append(f"step {step}")
            if micro == "2":
                parts.append("a later micro-step, gradients held")
        if where:
            stack = where.rstrip("abcdefghijklmnopqrstuvwxyz")
            name = where[len(stack) :]
            layer = _WHERE.get(name, name)
            if self.phase == "forward" and name == "head":
                layer = "after the layer stack (head, loss)"
            parts.append(f"{layer} of stack {int(stack) + 1}" if stack not in ("", "0") else layer)
        return f"{self.phase} ({', '.join(parts)})" if parts else self.phase


_WHERE = {
    "head": "before the layer stack (loss, head)",
    "top": "in the top layer",
    "middle": "in a middle layer",
    "bottom": "in the bottom layer",
    "below": "below the layer stack (embeddings)",
}


@dataclass(frozen=True)
class LayerLog:
    """Which layer made each allocation event of a dry run, for unrolling it to full depth.

    ``event_layers[n]``: the ``(stack, index)`` of the layer running at event ``n`` (None
    outside the stacks); ``key_layers``: the layer each storage belongs to (made in it, a
    parameter of it, or optimizer state and temporaries of its parameters);
    ``stack_depths``: each stack's traced depth.
    """

    event_layers: tuple[tuple[int, int] | None, ...]
    key_layers: dict[int, tuple[int, int]]
    stack_depths: tuple[int, ...]


@dataclass
class PhasePeak:
    """The largest live total seen in one moment of a phase, and the event count then."""

    total: int = -1
    event_index: int = 0


@dataclass(frozen=True)
class MomentLog:
    """What turns a dry run's allocation history into its moments' peaks.

    ``events``: the history the moments are read from (the dry run's own, where the result's
    ``events`` may be a rebuilt first step and the measured one); ``marks``: where the
    moments changed, as (event count, the ``phase|moment`` keys then, whether their peak is
    checked there: a phase entered keeps its old moments until they are set); ``categories``
    and ``modules``: each storage's category and the module whose forward made it.
    """

    events: tuple[tuple[int, int], ...]
    marks: tuple[tuple[int, tuple[str, ...], bool], ...]
    categories: dict[int, str]
    modules: dict[int, str]
    # each sample's FLOPs in one micro-step (forward; backward with any recompute), then the
    # bytes its other operators move (forward; backward): the same at every micro-batch size,
    # so a result read at another size keeps them
    flops: tuple[float, ...] = (0.0, 0.0, 0.0, 0.0)


def moment_peaks(
    events: tuple[tuple[int, int], ...] | list[tuple[int, int]],
    marks: tuple[tuple[int, tuple[str, ...], bool], ...] | list[tuple[int, tuple[str, ...], bool]],
) -> dict[str, PhasePeak]:
    """Each moment's largest live total and the event count then: checked after every
    allocation, and where moments are set (a moment may peak as it begins).

    Example:
        >>> marks = [(0, ("forward|",), True), (2, ("backward|",), True)]
        >>> peaks = moment_peaks([(0, 10), (1, 5), (0, -10), (2, 1)], marks)
        >>> {k: (p.total, p.event_index) for k, p in peaks.items()}
        {'forward|': (15, 2), 'backward|': (15, 2)}
    """
    peaks: dict[str, PhasePeak] = {}
    keys: tuple[str, ...] = ()
    live = 0
    following = iter(marks)
    mark = next(following, None)

    def note(count: int) -> None:
        for key in keys:
            peak = peaks.setdefault(key, PhasePeak())
            if live > peak.total:
                peak.total, peak.event_index = live, count

    for count in range(len(events) + 1):
        while mark is not None and mark[0] <= count:
            keys = mark[1]
            if mark[2]:
                note(count)
            mark = next(following, None)
        if count < len(events):
            delta = events[count][1]
            live += delta
            if delta > 0:
                note(count + 1)
    return peaks


def live_after(events: Sequence[tuple[int, int]], count: int) -> set[int]:
    """The storages alive after the first ``count`` events of ``events`` (replaying them)."""
    live: set[int] = set()
    for key, delta in events[:count]:
        if delta > 0:
            live.add(key)
        else:
            live.discard(key)
    return live


def moments_of(
    events: tuple[tuple[int, int], ...], log: MomentLog
) -> tuple[tuple[PhaseResult, ...], tuple[tuple[str, int], ...]]:
    """Each moment's components at its peak, in the order the peaks came, and the ten
    modules whose activations are largest at the overall peak."""
    peaks = moment_peaks(events, log.marks)
    wanted = sorted(
        (peak.event_index, name)
        for name, peak in peaks.items()
        if name.partition("|")[0] in PHASES and peak.total >= 0
    )
    phases = []
    live: dict[int, int] = {}
    done = 0
    for index, name in wanted:  # one replay of the history serves every moment
        for key, delta in events[done:index]:
            if delta > 0:
                live[key] = delta
            else:
                live.pop(key, None)
        done = index
        components = dict.fromkeys(CATEGORIES, 0)
        for key, size in live.items():
            components[log.categories.get(key, "other")] += size
        phase, _, moment = name.partition("|")
        phases.append(PhaseResult(phase, components, moment))
    best = max(phases, key=lambda p: p.total)
    sizes = {key: delta for key, delta in events if delta > 0}  # a storage is allocated once
    by_module: dict[str, int] = {}
    for key in live_after(events, peaks[best.key].event_index):
        if log.categories.get(key) == "activations" and key in log.modules:
            name = log.modules[key]
            by_module[name] = by_module.get(name, 0) + sizes[key]
    top = tuple(sorted(by_module.items(), key=lambda kv: -kv[1])[:10])
    return tuple(phases), top


@dataclass(frozen=True)
class TraceResult:
    """What a traced step allocated: each moment's peak, and the overall peak."""

    phases: tuple[PhaseResult, ...]
    seconds: float
    top_modules: tuple[tuple[str, int], ...] = ()
    events: tuple[tuple[int, int], ...] = field(default=(), repr=False)
    reserved_bytes: int = 0  # from the caching allocator simulation (CUDA runs only)
    # each sample's FLOPs in one micro-step: forward, and backward with any recompute (the
    # matmuls, convolutions and attention), then the bytes the other operators move, forward
    # and backward (``MomentLog.flops``)
    flops: tuple[float, ...] = (0.0, 0.0, 0.0, 0.0)
    # the dry run's whole allocation history (``tracker.Timeline``), for the timeline
    # picture; only on a result fresh from a dry run (not extrapolated, not cached)
    timeline: Any = field(default=None, repr=False, compare=False)
    # which layer made each event, for the unrolled replay (fresh results only, like events)
    layers: LayerLog | None = field(default=None, repr=False, compare=False)
    # what the moments were read from, for a result at another micro-batch size (``sized``;
    # fresh results only, like events)
    moments: MomentLog | None = field(default=None, repr=False, compare=False)

    @property
    def peak(self) -> PhaseResult:
        return max(self.phases, key=lambda p: p.total)


def extrapolate(
    shallow: TraceResult, deep: TraceResult, depth_shallow: int, depth_deep: int, depth: int
) -> TraceResult:
    """Per moment and category, extend two traces of a homogeneous stack to ``depth`` layers.

    Each moment (the start of backward, its end, the optimizer step, ...) is a line in the
    depth on its own; the peak is the largest moment at ``depth``. Extrapolating each phase's
    peak instead mixes moments when the peak moves between the traced depths.
    """
    scale = (depth - depth_shallow) / (depth_deep - depth_shallow)
    phases = []
    deep_by = {p.key: p for p in deep.phases}
    for low in shallow.phases:
        high = deep_by.get(low.key)
        if high is None:
            continue
        phases.append(
            PhaseResult(
                low.phase,
                {
                    c: max(
                        0,
                        round(low.components[c] + scale * (high.components[c] - low.components[c])),
                    )
                    for c in CATEGORIES
                },
                low.moment,
            )
        )
    # The allocator's reserve is not a line in the depth: the caller replays it
    # (``estimate._reserve``). FLOPs are a line in the depth too.
    flops = tuple(
        low + scale * (high - low) for low, high in zip(shallow.flops, deep.flops, strict=True)
    )
    return TraceResult(tuple(phases), shallow.seconds + deep.seconds, deep.top_modules, flops=flops)


def result_to_json(result: TraceResult) -> dict[str, Any]:
    """A cacheable record of ``result`` (the allocation log is left out)."""
    return {
        "phases": [[p.phase, p.moment, p.components] for p in result.phases],
        "seconds": result.seconds,
        "top_modules": [list(m) for m in result.top_modules],
        "reserved_bytes": result.reserved_bytes,
        "flops": list(result.flops),
    }


def result_from_json(record: dict[str, Any]) -> TraceResult:
    """The inverse of :func:`result_to_json`; KeyError/TypeError/ValueError on a bad record."""
    phases = tuple(
        PhaseResult(str(phase), {str(k): int(v) for k, v in comps.items()}, str(moment))
        for phase, moment, comps in record["phases"]
    )
    if not phases:
        raise ValueError("a trace result without phases")
    flops = tuple(float(f) for f in record.get("flops", (0.0,) * 4))
    if len(flops) != 4:
        raise ValueError("a trace result's FLOPs and bytes are four figures")
    return TraceResult(
        phases,
        float(record["seconds"]),
        tuple((str(name), int(size)) for name, size in record["top_modules"]),
        reserved_bytes=int(record["reserved_bytes"]),
        flops=flops,
    )
