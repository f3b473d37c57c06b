"""Dry runs read from the histories of neighbouring setups, not traced.

``sized`` reads a size from two other sizes of the same setup. Two more neighbours are read
here, event for event, where their histories show that nothing else differs:

- a step of one micro-step from the step of two at the same size (the later micro-step left
  out): the plan's size where it is the whole per-GPU batch, searched with two;
- a setup that differs only in its optimizer from one whose line is known (its sibling): the
  forward and backward are the same operators on the same shapes, the optimizer's work does
  not depend on the batch, so the setup at a new size is its one traced size moved along the
  sibling's line, storage by storage.

Torch-free, like ``sized``.
"""

from __future__ import annotations

from dataclasses import replace

from batchfit.memory.trace.result import MomentLog, TraceResult
from batchfit.memory.trace.sized import kept, kept_or_read, read, siblings

__all__ = ["from_sibling", "one_micro_step"]


def one_micro_step(runs: tuple[TraceResult, ...] | None) -> tuple[TraceResult, ...] | None:
    """The dry runs of a step of one micro-step, from ``runs`` of the same setup and size with
    two (kept as ``remember`` keeps them); None where they do not show the cut.

    The step of two runs the one micro-step's forward and backward (on no gradients), then a
    later micro-step's (which adds into the gradients the first made) before the optimizer
    step. Where that later micro-step frees all it made and nothing else (the gradient it
    adds is freed once added), leaving it out of the history is the step of one micro-step,
    event for event: the optimizer step and what follows see the same storages.
    """
    if runs is None:
        return None
    out = []
    for run in runs:
        cut = _without_later_micro_step(run)
        if cut is None:
            return None
        out.append(cut)
    return tuple(out)


def _without_later_micro_step(run: TraceResult) -> TraceResult | None:
    log = run.moments
    if log is None:
        return None
    starts = [(n, keys) for n, keys, _ in log.marks]
    later = [i for i, (_, keys) in enumerate(starts) if any(map(_later, keys))]
    if not later or later != list(range(later[0], later[-1] + 1)) or later[-1] + 1 >= len(starts):
        return None  # none, or more than one run of them (every step traced whole)
    begin, end = starts[later[0]][0], starts[later[-1] + 1][0]
    if not _phase(starts[later[-1] + 1][1], "optimizer-step"):
        return None
    balance: dict[int, tuple[int, int]] = {}  # each storage's bytes and events in the cut
    for key, delta in log.events[begin:end]:
        net, count = balance.get(key, (0, 0))
        balance[key] = (net + delta, count + 1)
    made = set(balance)
    left = any(net or count % 2 for net, count in balance.values())
    if left or any(key in made for key, _ in log.events[:begin] + log.events[end:]):
        return None  # it left something it made, or freed what it did not make
    cut = end - begin
    history = log.events[:begin] + log.events[end:]
    marks = tuple(
        (n - cut if n >= end else n, keys, checked)
        for i, (n, keys, checked) in enumerate(log.marks)
        if i not in later
    )
    if log.events is run.events:
        drop = set(range(begin, end))
        events = history
    else:
        # the rebuilt first step copied the measured step's micro-steps under new keys, in
        # the order they were made, numbered on from the dry run's largest key
        # (allocations of 0 bytes are not copied)
        first = next(n for n, keys in starts if _phase(keys, "forward"))
        top = max(key for key, _ in log.events)
        before = sum(1 for _, delta in log.events[first:begin] if delta > 0)
        copied = {key for key, delta in log.events[begin:end] if delta > 0}
        copies = set(range(top + 1 + before, top + 1 + before + len(copied)))
        drop = {i for i, (key, _) in enumerate(run.events) if key in made or key in copies}
        if len(drop) != cut + sum(1 for key, _ in log.events[begin:end] if key in copied):
            return None
        events = tuple(e for i, e in enumerate(run.events) if i not in drop)
    layers = run.layers
    if layers is not None:
        remaining = tuple(w for i, w in enumerate(layers.event_layers) if i not in drop)
        layers = replace(layers, event_layers=remaining)
    return read(layers, replace(log, marks=marks), events, history)


def _phase(keys: tuple[str, ...], phase: str) -> bool:
    return any(k.startswith(f"{phase}|") for k in keys)


def _later(key: str) -> bool:
    """Whether moment ``key`` is a later micro-step's forward or backward (``s2m2``...)."""
    phase, _, moment = key.partition("|")
    head = moment.partition(".")[0]
    return phase in ("forward", "backward") and head.startswith("s") and head.endswith("m2")


def from_sibling(
    setup_key: str, family: str, micro: int, workspace: int, between_sizes: bool = True
) -> tuple[TraceResult, ...] | None:
    """The dry runs of ``setup_key`` at ``micro`` from one size of its own traced in this
    process and the line of a sibling in ``family`` (another optimizer) through that size and
    ``micro``; None where no sibling answers or the histories do not line up."""
    own = {m: r for m, r in kept(setup_key, workspace).items() if m > 1}
    if not own or micro < 2:
        return None
    base = min(own)
    for sibling in siblings(family, setup_key):
        at_base = kept_or_read(sibling, base, workspace, between_sizes)
        at_micro = kept_or_read(sibling, micro, workspace, between_sizes)
        if at_base is None or at_micro is None or len(at_base) != len(own[base]):
            continue
        moved = [_moved(*runs) for runs in zip(own[base], at_base, at_micro, strict=True)]
        if all(run is not None for run in moved):
            return tuple(run for run in moved if run is not None)
    return None


def _sizes(events: tuple[tuple[int, int], ...]) -> dict[int, int]:
    """Each storage's bytes (its first allocation)."""
    out: dict[int, int] = {}
    for key, delta in events:
        if delta > 0:
            out.setdefault(key, delta)
    return out


def _moved(own: TraceResult, low: TraceResult, high: TraceResult) -> TraceResult | None:
    """``own`` moved by what each storage of the sibling grows from ``low`` to ``high``."""
    mine, theirs = own.moments, low.moments
    if mine is None or theirs is None or high.moments is None:
        return None
    if [keys for _, keys, _ in mine.marks] != [keys for _, keys, _ in theirs.marks]:
        return None  # not the same moments in the same order
    twin = _twins(mine, theirs)
    if twin is None:
        return None
    growth = {}
    for a, b in ((low.events, high.events), (theirs.events, high.moments.events)):
        if [k for k, _ in a] != [k for k, _ in b]:
            return None
        start, end = _sizes(a), _sizes(b)
        growth.update({k: end[k] - start[k] for k in start if end.get(k, 0) != start[k]})
    # the rebuilt first step's copies: numbered on from each run's largest key, in one order
    top_mine, top_theirs = max(k for k, _ in mine.events), max(k for k, _ in theirs.events)
    mine_sizes, theirs_sizes = _sizes(own.events), _sizes(low.events)
    for key in mine_sizes:
        if key > top_mine:
            twin[key] = key - top_mine + top_theirs
    if any(theirs_sizes.get(twin[k]) != size for k, size in mine_sizes.items() if k in twin):
        return None  # a twin of another size
    if set(growth) - set(twin.values()):
        return None  # the sibling grows a storage this setup has no twin of
    grow = {k: growth.get(t, 0) for k, t in twin.items()}

    def moved(events: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...] | None:
        out = []
        for key, delta in events:
            step = grow.get(key, 0)
            value = delta + step if delta > 0 else delta - step if delta < 0 else delta
            if step and (delta == 0 or (value > 0) != (delta > 0)):
                return None
            out.append((key, value))
        return tuple(out)

    history = moved(mine.events)
    events = history if own.events is mine.events else moved(own.events)
    if history is None or events is None:
        return None
    return read(own.layers, mine, events, history)


def _twins(mine: MomentLog, theirs: MomentLog) -> dict[int, int] | None:
    """Each storage of ``mine`` made in a forward or backward, and its twin in ``theirs``:
    the same event of the same moment; None where a forward's or backward's events differ."""
    twin: dict[int, int] = {}
    ends_mine = [n for n, _, _ in mine.marks[1:]] + [len(mine.events)]
    ends_theirs = [n for n, _, _ in theirs.marks[1:]] + [len(theirs.events)]
    for (n, keys, _), (m, _, _), end, other in zip(
        mine.marks, theirs.marks, ends_mine, ends_theirs, strict=True
    ):
        if not (_phase(keys, "forward") or _phase(keys, "backward")):
            continue
        ours, its = mine.events[n:end], theirs.events[m:other]
        if len(ours) != len(its):
            return None
        for (key, delta), (other_key, other_delta) in zip(ours, its, strict=True):
            if delta != other_delta or twin.setdefault(key, other_key) != other_key:
                return None
    if len(set(twin.values())) != len(twin):
        return None
    return twin
