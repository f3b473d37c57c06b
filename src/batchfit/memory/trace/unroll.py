"""Unroll a dry run of a shallow layer stack into the allocation history of the full depth.

The caching allocator's reserve depends on the order and sizes of every allocation, not on a
per-layer line: a shallow trace's overhead beyond its peak does not extrapolate (GPT-2 with
gradient checkpointing, 8 x 256: 176, 114, 450, 387 and 267 MiB at 1, 2, 3, 4 and 6 layers).
So the full depth's history is rebuilt from the shallow one and replayed through the allocator:
the bottom layer's events stand for the bottom layer, the top's for the top, and a middle
layer's (the top's, in a 2-layer trace) for every layer between, in the order the step runs
them (up the stack in forward and the optimizer step, down it in backward).

Tensors correspond between layers by their role: which pass over the stack made them and their
rank among what the layer made in it (layers of one stack run the same code on the same shapes).
A tensor one layer makes and another frees (a checkpointed layer's input, the previous layer's
output) is freed by the layer at the same distance at full depth. Where the trace does not fit
this pattern (a tensor whose counterpart is missing or of another size) nothing is unrolled and
the caller falls back.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from batchfit.memory.trace.result import LayerLog

Layer = tuple[int, int]
_Role = tuple[str, int, int]


def full_layers(source: int, traced: int, full: int) -> range:
    """The full-depth layers that traced layer ``source`` of a ``traced``-layer stack stands
    for: the layers below its middle one and above it for themselves, the middle one for the
    rest.

    Example:
        >>> list(full_layers(1, 2, 5)), list(full_layers(3, 4, 7))
        ([1, 2, 3, 4], [6])
    """
    middle, tail = traced // 2, traced - traced // 2 - 1
    if source < middle:
        return range(source, source + 1)
    if source > middle:
        return range(source + full - traced, source + full - traced + 1)
    return range(middle, full - tail)


@dataclass
class _Run:
    """Consecutive events made while one layer ran (or outside every layer)."""

    layer: Layer | None
    begin: int
    end: int


class _Mismatch(Exception):
    """The trace does not fit the per-layer pattern."""


def _runs(event_layers: Sequence[Layer | None]) -> list[_Run]:
    runs: list[_Run] = []
    for n, layer in enumerate(event_layers):
        if runs and runs[-1].layer == layer:
            runs[-1].end = n + 1
        else:
            runs.append(_Run(layer, n, n + 1))
    return runs


def _passes(runs: list[_Run]) -> list[list[_Run]]:
    """Runs grouped into passes: one run outside the stacks, or consecutive runs of one stack's
    layers (a forward up it, a backward down it)."""
    groups: list[list[_Run]] = []
    for run in runs:
        last = groups[-1][-1] if groups else None
        if (
            run.layer is not None
            and last is not None
            and last.layer is not None
            and last.layer[0] == run.layer[0]
        ):
            groups[-1].append(run)
        else:
            groups.append([run])
    return groups


def _roles(
    events: Sequence[tuple[int, int]], log: LayerLog, groups: list[list[_Run]]
) -> dict[int, _Role]:
    """Each layer's tensor's role: the same for its counterparts in the other layers."""
    roles: dict[int, _Role] = {}
    for g, group in enumerate(groups):
        counts: dict[Layer | None, int] = {}
        for run in group:
            if run.layer is not None:
                counts = {}  # in a layer's run: its rank among what that layer made
            for key, delta in events[run.begin : run.end]:
                tag = log.key_layers.get(key)
                if delta <= 0 or tag is None:
                    continue
                n = counts.get(tag, 0)
                counts[tag] = n + 1
                roles[key] = ("layer" if run.layer is not None else "outside", g, n)
    return roles


class _Unroller:
    def __init__(
        self, events: Sequence[tuple[int, int]], log: LayerLog, depths: Sequence[int]
    ) -> None:
        self.events = events
        self.log = log
        self.traced = log.stack_depths
        self.full = depths
        self.groups = _passes(_runs(log.event_layers))
        self.roles = _roles(events, log, self.groups)
        self.next_id = max((key for key, _ in events), default=0) + 1
        self.live: dict[tuple[int, int, _Role], tuple[int, int]] = {}  # -> (id, bytes)
        self.out: list[tuple[int, int]] = []
        self.follows = self._successor_roles()

    def _successor_roles(self) -> set[tuple[int, _Role]]:
        """The middle layer that stands for the layers between is followed in the trace by
        its own successors only (in a 2-layer trace by none: it is the top). The roles whose
        tensor the next layer frees in the layer below it (the one below the middle) where the
        middle's is freed elsewhere (by the head, as the top's output; under FSDP, the
        parameters it gathers ahead for the top): every copy but the last dies as the layer
        below the middle's does."""
        died: dict[int, tuple[object, ...]] = {}
        for g, group in enumerate(self.groups):
            for run in group:
                for key, delta in self.events[run.begin : run.end]:
                    tag = self.log.key_layers.get(key)
                    if delta < 0 and tag is not None:
                        where = "outside" if run.layer is None else run.layer[1] - tag[1]
                        died[key] = (g, where)
        keys: dict[tuple[int, int, _Role], int] = {}
        for key, role in self.roles.items():
            stack, index = self.log.key_layers[key]
            keys[(stack, index, role)] = key
        successor = set()
        for (stack, index, role), lower in keys.items():
            middle = keys.get((stack, index + 1, role))
            if index + 1 != self.traced[stack] // 2 or middle is None:
                continue
            below, above = died.get(lower), died.get(middle)
            if below != above and below is not None and below[1] == 1:
                successor.add((stack, role))
        return successor

    def _dies_here(self, stack: int, layer: int, role: _Role, source: int) -> bool:
        """Whether full-depth ``layer``'s tensor of ``role`` dies where traced layer
        ``source``'s does (see :meth:`_successor_roles`)."""
        traced, full = self.traced[stack], self.full[stack]
        middle = traced // 2
        last = full - (traced - middle - 1) - 1  # the middle's last copy, followed as it is
        if not middle <= layer < last:
            return True
        # where the two die alike, the layer below the middle's frees come from the middle's
        # runs (for every copy but the last) and the middle's from its successor's (the last)
        return (stack, role) not in self.follows or source == middle - 1

    def copies(self, layer: Layer) -> range:
        stack, index = layer
        return full_layers(index, self.traced[stack], self.full[stack])

    def emit(self, key: int, delta: int, stack: int, layer: int) -> None:
        """The event of ``key`` as full-depth layer ``layer`` of ``stack`` makes it."""
        if delta == 0:  # an empty storage (FSDP1's parameters once flattened)
            return
        role = self.roles.get(key)
        if role is None or not 0 <= layer < self.full[stack]:
            raise _Mismatch
        if delta < 0 and not self._dies_here(stack, layer, role, self.log.key_layers[key][1]):
            return
        name = (stack, layer, role)
        if delta > 0:
            if name in self.live:
                raise _Mismatch
            self.live[name] = (self.next_id, delta)
            self.out.append((self.next_id, delta))
            self.next_id += 1
            return
        found = self.live.pop(name, None)
        if found is None or found[1] != -delta:
            raise _Mismatch
        self.out.append((found[0], delta))

    def outside(self, run: _Run) -> None:
        """Events outside the stacks: a layer's tensors (its parameters' optimizer state and
        gradients) are made and freed in blocks, one per full-depth layer. A list op over every
        parameter (a foreach optimizer's) makes, or frees, all its tensors in one wave across
        the layers: each layer's part of a wave is a block of its own."""
        crossing = self._crossing(run)
        blocks = self._blocks(run, crossing)
        self._check_lifetimes(blocks, crossing)
        for begin, end in blocks:
            key = self.events[begin][0]
            tag = self.log.key_layers.get(key)
            if tag is None:
                self.out.extend(self.events[begin:end])
                continue
            for layer in self.copies(tag):
                for key, delta in self.events[begin:end]:
                    self.emit(key, delta, tag[0], layer)

    def _check_lifetimes(self, blocks: list[tuple[int, int]], waves: dict[int, bool]) -> None:
        """Refuse a layer's tensor made in one block and freed in a later one unless both are
        parts of waves across the layers (a foreach op makes all, then frees all): a loop over
        the parameters that holds one parameter's temporary until the next one's is made
        would, played block by block, keep every copy's temporaries alive at once."""
        events, tags = self.events, self.log.key_layers
        born_in: dict[int, int] = {}
        for b, (begin, end) in enumerate(blocks):
            for n in range(begin, end):
                key, delta = events[n]
                tag = tags.get(key)
                if delta > 0:
                    born_in[key] = b
                elif (
                    delta < 0
                    and tag is not None
                    and born_in.get(key, b) != b
                    and len(self.copies(tag)) > 1
                    and not (waves[blocks[born_in[key]][0]] and waves[n])
                ):
                    raise _Mismatch

    def _crossing(self, run: _Run) -> dict[int, bool]:
        """For each event of ``run``: whether its wave (consecutive allocations, or frees)
        crosses layers."""
        events, tags = self.events, self.log.key_layers
        out: dict[int, bool] = {}
        begin = run.begin
        for n in range(run.begin, run.end + 1):
            if n == run.end or (n > begin and (events[n][1] > 0) != (events[n - 1][1] > 0)):
                crossing = len({tags.get(events[m][0]) for m in range(begin, n)}) > 1
                out.update(dict.fromkeys(range(begin, n), crossing))
                begin = n
        return out

    def _blocks(self, run: _Run, crossing: dict[int, bool]) -> list[tuple[int, int]]:
        """``run`` cut where the layer changes, and at the ends of waves (consecutive
        allocations, or frees) that cross layers (``crossing``, by event)."""
        events, tags = self.events, self.log.key_layers
        blocks: list[tuple[int, int]] = []
        last: object = None
        wave = 0
        for n in range(run.begin, run.end):
            if n > run.begin and (events[n][1] > 0) != (events[n - 1][1] > 0):
                wave += 1
            mark = (tags.get(events[n][0]), wave if crossing[n] else None)
            if blocks and mark == last:
                blocks[-1] = (blocks[-1][0], n + 1)
            else:
                blocks.append((n, n + 1))
            last = mark
        return blocks

    def stack(self, group: list[_Run]) -> None:
        """A pass over a stack: each run once per full-depth layer it stands for, in the order
        of the pass (up, or down)."""
        indices = [run.layer[1] for run in group if run.layer is not None]
        down = len(indices) > 1 and indices[1] < indices[0]
        if any((b < a) != down or a == b for a, b in itertools.pairwise(indices)):
            raise _Mismatch  # a pass that is neither up nor down the stack
        first = group[0].layer
        assert first is not None
        if sorted(indices) != list(range(self.traced[first[0]])):
            raise _Mismatch  # a pass that skips a layer (a module outside the stack ran in it)
        for run in group:
            assert run.layer is not None
            stack, index = run.layer
            copies = self.copies(run.layer)
            # a tensor from outside the stack freed here is freed once: by the top layer if
            # the run stands for it, else by the first layer the run stands for
            once = copies[-1] if index == self.traced[stack] - 1 else copies[0]
            events = self._events(run, index)
            top_only = None
            if self.traced[stack] == 2 and index == 1:
                top_only = events
                events = self._with_successor(run, group)
            for layer in reversed(copies) if down else copies:
                if layer == self.full[stack] - 1 and top_only is not None:
                    todo = top_only  # the top: no layer after it
                else:
                    todo = events
                for key, delta, at in todo:
                    tag = self.log.key_layers.get(key)
                    if tag is None or tag[0] != stack:
                        if delta > 0:
                            raise _Mismatch  # made in a layer, so it should be the layer's
                        if layer == once:
                            self.out.append((self._outside_key(key, tag), delta))
                        continue
                    self.emit(key, delta, stack, layer - (at - tag[1]))

    def _events(self, run: _Run, index: int) -> list[tuple[int, int, int]]:
        """``run``'s events, each with the traced layer whose run it is."""
        return [(key, delta, index) for key, delta in self.events[run.begin : run.end]]

    def _with_successor(self, run: _Run, group: list[_Run]) -> list[tuple[int, int, int]]:
        """A 2-layer trace's top-layer ``run`` as a middle layer runs it: with what the bottom
        layer's run in the same pass frees of the layer after it (in backward, the gradient
        the next layer up handed down). Those frees go after as many allocations as in the
        bottom's run (where, between two allocations, changes neither peak nor reserve)."""
        assert run.layer is not None
        stack = run.layer[0]
        partner = next((r for r in group if r.layer == (stack, 0)), None)
        if partner is None:
            return self._events(run, 1)
        extra: dict[int, list[tuple[int, int, int]]] = {}
        made = 0
        for key, delta in self.events[partner.begin : partner.end]:
            if delta > 0:
                made += 1
            elif self.log.key_layers.get(key) == (stack, 1):
                extra.setdefault(made, []).append((key, delta, 0))
        out = [*extra.pop(0, [])]
        made = 0
        for event in self._events(run, 1):
            out.append(event)
            if event[1] > 0:
                made += 1
                out.extend(extra.pop(made, []))
        for rest in extra.values():
            out.extend(rest)
        return out

    def _outside_key(self, key: int, tag: Layer | None) -> int:
        """A tensor of another stack (or none) freed in this one: its one full-depth copy."""
        if tag is None:
            return key
        copies = self.copies(tag)
        if len(copies) != 1:
            raise _Mismatch
        found = self.live.pop((tag[0], copies[0], self.roles.get(key, ("", 0, 0))), None)
        if found is None:
            raise _Mismatch
        return found[0]

    def run(self) -> list[tuple[int, int]]:
        for group in self.groups:
            if group[0].layer is None:
                self.outside(group[0])
            else:
                self.stack(group)
        # what the trace leaves alive, every copy of it alive: nothing lost on the way
        alive: dict[int, int] = {}
        for key, delta in self.events:
            if delta > 0:
                alive[key] = delta
            elif delta < 0:
                alive.pop(key, None)
        expected = sum(
            len(self.copies(self.log.key_layers[key]))
            for key in alive
            if key in self.log.key_layers and key in self.roles
        )
        if expected != len(self.live):
            raise _Mismatch
        return self.out


def unroll(
    events: Sequence[tuple[int, int]], log: LayerLog, depths: Sequence[int]
) -> list[tuple[int, int]] | None:
    """The allocation history of the traced step with each stack ``depths[k]`` layers deep,
    or None where the trace does not fit the per-layer pattern (see the module docstring) or
    no stack is deeper than traced.

    ``events`` and ``log`` are a dry run's (``TraceResult.events`` and ``.layers``); a stack
    traced at fewer than 2 layers has no top distinct from its bottom and is not unrolled.
    """
    if len(depths) != len(log.stack_depths) or len(events) != len(log.event_layers):
        return None
    if tuple(depths) == tuple(log.stack_depths):  # no stack to unroll (or none found)
        return None
    if any(d < 2 or full < d for d, full in zip(log.stack_depths, depths, strict=True)):
        return None
    try:
        return _Unroller(events, log, depths).run()
    except _Mismatch:
        return None
