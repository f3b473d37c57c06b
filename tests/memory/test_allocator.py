"""The caching-allocator model: rounding, pools, reuse, fragmentation and expandable segments."""

from batchfit.memory.device.allocator import CachingAllocator, round_size, segment_size, simulate

MIB = 1 << 20


def test_rounding_rules():
    assert round_size(1) == 512 and round_size(512) == 512 and round_size(513) == 1024
    assert segment_size(512) == 2 * MIB  # small pool: 2 MiB segments
    assert segment_size(MIB) == 2 * MIB
    assert segment_size(MIB + 512) == 20 * MIB  # 1-10 MiB: 20 MiB segments
    assert segment_size(10 * MIB) == 10 * MIB  # >= 10 MiB: rounded up to 2 MiB
    assert segment_size(11 * MIB) == 12 * MIB


def test_small_requests_share_one_segment():
    stats = simulate([(i, 1000) for i in range(100)])  # 100 x 1024 B in one 2 MiB segment
    assert stats.reserved_bytes == 2 * MIB and stats.segments == 1
    assert stats.peak_allocated_bytes == 100 * 1024


def test_freed_blocks_stay_reserved_and_are_reused():
    events = [(1, 50 * MIB), (1, -50 * MIB), (2, 30 * MIB), (3, 20 * MIB)]
    stats = simulate(events)
    # 30 MiB is split off the cached 50 MiB block; the 20 MiB remainder serves the next one.
    assert stats.reserved_bytes == 50 * MIB
    assert stats.segments == 1


def test_best_fit_and_no_split_of_small_remainders_in_large_pool():
    alloc = CachingAllocator()
    alloc.malloc(1, 12 * MIB)  # segment of exactly 12 MiB
    alloc.free(1)
    alloc.malloc(2, 11 * MIB + 512)  # remainder < 1 MiB: not split, whole block used
    assert alloc.reserved == 12 * MIB
    alloc.malloc(3, 11 * MIB + 512)  # nothing cached fits: a new segment
    assert alloc.reserved == 24 * MIB


def test_fragmentation_makes_reserved_exceed_peak():
    # Two 6 MiB tensors live in one 20 MiB segment; freeing the first leaves a hole that a
    # 10 MiB request cannot use, so a new segment is mapped although little is allocated.
    events = [(1, 6 * MIB), (2, 6 * MIB), (1, -6 * MIB), (3, 10 * MIB)]
    stats = simulate(events)
    assert stats.peak_allocated_bytes == 16 * MIB
    assert stats.reserved_bytes == 30 * MIB


def test_merging_neighbours_recovers_large_blocks():
    events = [(1, 6 * MIB), (2, 6 * MIB), (1, -6 * MIB), (2, -6 * MIB), (3, 18 * MIB)]
    assert simulate(events).reserved_bytes == 20 * MIB


def test_expandable_segments_grow_a_free_end_by_what_is_missing():
    events = [(1, 6 * MIB), (2, 6 * MIB), (2, -6 * MIB), (3, 10 * MIB)]
    stats = simulate(events, expandable_segments=True)
    assert stats.reserved_bytes == 16 * MIB  # 12 mapped, then 4 more: no 20 MiB segments


def test_expandable_segments_still_fragment():
    # a 6 MiB hole at the front cannot hold 10 MiB: new pages are mapped at the end, as
    # PyTorch's try_allocate_expandable does (measured on an H100: reserved above allocated)
    events = [(1, 6 * MIB), (2, 6 * MIB), (1, -6 * MIB), (3, 10 * MIB)]
    stats = simulate(events, expandable_segments=True)
    assert stats.reserved_bytes == 22 * MIB
    assert simulate(events).reserved_bytes == 30 * MIB  # a 20 MiB and a 10 MiB segment
