"""A simulation of PyTorch's CUDA caching allocator: what ``max_memory_reserved`` would be.

Rules from ``c10/cuda/CUDACachingAllocator.cpp`` (PyTorch 2.x, default settings):

- every request is rounded up to a multiple of 512 B (``kMinBlockSize``);
- requests of at most 1 MiB (``kSmallSize``) come from the small pool, whose segments are 2 MiB
  (``kSmallBuffer``); larger ones from the large pool: below 10 MiB (``kMinLargeAlloc``) a new
  segment is 20 MiB (``kLargeBuffer``), above it the request rounded up to 2 MiB
  (``kRoundLarge``);
- a request takes the smallest cached free block that is large enough (best fit) in its pool;
  the remainder is split off if it is at least 512 B (small pool) or more than 1 MiB (large);
- freed blocks stay reserved and merge with free neighbours in their segment; nothing is given
  back to the driver without ``empty_cache()``.

With ``expandable_segments`` (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``) the large pool
is one segment that maps 2 MiB pages at its end as it grows (``ExpandableSegment``, and
``try_allocate_expandable`` in the same file): no 20 MiB or rounded segments, but a request that
no free block fits still maps new pages (a free block at the end grows by what is missing), so
freed holes fragment it as they do the fixed segments. Measured on an H100 (torch 2.11):
reserved was 0.8-8% above allocated with it, sometimes more than without it.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass, field

MIN_BLOCK = 512
SMALL_SIZE = 1 << 20
SMALL_BUFFER = 2 << 20
MIN_LARGE_ALLOC = 10 << 20
LARGE_BUFFER = 20 << 20
ROUND_LARGE = 2 << 20


def round_size(size: int) -> int:
    """``round_size``: at least 512 B, a multiple of 512 B.

    Example:
        >>> round_size(1), round_size(513), round_size(4096)
        (512, 1024, 4096)
    """
    return max(MIN_BLOCK, -(-size // MIN_BLOCK) * MIN_BLOCK)


def segment_size(size: int) -> int:
    """``get_allocation_size``: the cudaMalloc size for a rounded request with no cached block.

    Example:
        >>> segment_size(4096) == 2 << 20, segment_size(5 << 20) == 20 << 20
        (True, True)
        >>> segment_size((11 << 20) + 1) == 12 << 20
        True
    """
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


@dataclass(eq=False)  # blocks are compared by identity
class _Block:
    segment: int
    offset: int
    size: int
    free: bool
    prev: _Block | None = field(default=None, repr=False)  # neighbours in its segment
    next: _Block | None = field(default=None, repr=False)


@dataclass(frozen=True)
class AllocatorStats:
    """Peaks of a simulated run, in bytes."""

    peak_allocated_bytes: int  # sum of the live blocks handed out (max_memory_allocated)
    reserved_bytes: int  # segments obtained from the driver (max_memory_reserved)
    segments: int


class CachingAllocator:
    """Replays malloc/free requests; tracks allocated and reserved bytes like PyTorch's.

    Each pool's free blocks are kept sorted by (size, segment, address) for the best fit, and
    found by address; blocks link to their neighbours in the segment, so a split or a merge
    walks no segment.
    """

    def __init__(self, expandable_segments: bool = False) -> None:
        self.expandable = expandable_segments
        self._pool_of_segment: list[bool] = []  # True: small pool
        self._free: dict[bool, list[tuple[int, int, int]]] = {True: [], False: []}
        self._free_at: dict[tuple[int, int], _Block] = {}  # free blocks by (segment, offset)
        self._where: dict[int, _Block] = {}
        self.allocated = 0
        self.reserved = 0
        self.peak_allocated = 0
        self.peak_reserved = 0
        self._expandable_seg: int | None = None
        self._expandable_tail: _Block | None = None  # its last block

    def _add_free(self, block: _Block, pool: list[tuple[int, int, int]]) -> None:
        bisect.insort(pool, (block.size, block.segment, block.offset))
        self._free_at[(block.segment, block.offset)] = block

    def _take_free(self, block: _Block, pool: list[tuple[int, int, int]]) -> None:
        del pool[bisect.bisect_left(pool, (block.size, block.segment, block.offset))]
        del self._free_at[(block.segment, block.offset)]

    def malloc(self, handle: int, size: int) -> None:
        rounded = round_size(size)
        small = rounded <= SMALL_SIZE
        pool = self._free[small]
        i = bisect.bisect_left(pool, (rounded, -1, -1))
        if i < len(pool):
            _, seg, off = pool.pop(i)
            block = self._free_at.pop((seg, off))
        elif self.expandable and not small:
            block = self._grow(rounded)
        else:
            seg = len(self._pool_of_segment)
            seg_size = segment_size(rounded)
            block = _Block(seg, 0, seg_size, True)
            self._pool_of_segment.append(small)
            self.reserved += seg_size
            self.peak_reserved = max(self.peak_reserved, self.reserved)
        remaining = block.size - rounded
        split = remaining >= MIN_BLOCK if small else remaining > SMALL_SIZE
        if split:
            rest = _Block(block.segment, block.offset + rounded, remaining, True, block, block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            if block is self._expandable_tail:
                self._expandable_tail = rest
            self._add_free(rest, pool)
            block.size = rounded
        block.free = False
        self._where[handle] = block
        # a block too small to split is handed out whole, and counted whole (as PyTorch's
        # allocated_bytes counts block->size); its free gives back the same
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)

    def _grow(self, rounded: int) -> _Block:
        """Map pages at the end of the large pool's one expandable segment: a free block at
        its end grows by what is missing; else a new block is mapped after the last one."""
        if self._expandable_seg is None:
            self._expandable_seg = len(self._pool_of_segment)
            self._pool_of_segment.append(False)
        seg = self._expandable_seg
        last = self._expandable_tail
        tail = last if last is not None and last.free else None
        have = tail.size if tail is not None else 0
        mapped = -(-(rounded - have) // ROUND_LARGE) * ROUND_LARGE
        self.reserved += mapped
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        if tail is not None:
            self._take_free(tail, self._free[False])
            tail.size += mapped
            return tail
        offset = last.offset + last.size if last is not None else 0
        block = _Block(seg, offset, mapped, True, last)
        if last is not None:
            last.next = block
        self._expandable_tail = block
        return block

    def free(self, handle: int) -> None:
        block = self._where.pop(handle, None)
        if block is None:
            return
        self.allocated -= block.size
        pool = self._free[self._pool_of_segment[block.segment]]
        block.free = True
        after = block.next
        if after is not None and after.free:  # merge with free neighbours
            self._take_free(after, pool)
            block.size += after.size
            block.next = after.next
            if after.next is not None:
                after.next.prev = block
            if after is self._expandable_tail:
                self._expandable_tail = block
        before = block.prev
        if before is not None and before.free:
            self._take_free(before, pool)
            block.offset = before.offset
            block.size += before.size
            block.prev = before.prev
            if before.prev is not None:
                before.prev.next = block
        self._add_free(block, pool)

    def stats(self) -> AllocatorStats:
        return AllocatorStats(self.peak_allocated, self.peak_reserved, len(self._pool_of_segment))


def simulate(
    events: Iterable[tuple[int, int]], *, expandable_segments: bool = False
) -> AllocatorStats:
    """Replay ``(handle, +bytes)`` / ``(handle, -bytes)`` events through the allocator.

    Example:
        >>> s = simulate([(1, 3 << 20), (2, 3 << 20), (1, -(3 << 20)), (3, 1000)])
        >>> s.reserved_bytes == (20 << 20) + (2 << 20), s.peak_allocated_bytes == 6 << 20
        (True, True)
    """
    alloc = CachingAllocator(expandable_segments)
    for handle, delta in events:
        if delta > 0:
            alloc.malloc(handle, delta)
        elif delta < 0:
            alloc.free(handle)
    return alloc.stats()
