"""The caching allocator's simulation, kept at this path; it lives in
``batchfit.memory.device.allocator``."""

from batchfit.memory.device.allocator import (
    AllocatorStats,
    CachingAllocator,
    round_size,
    segment_size,
    simulate,
)

__all__ = ["AllocatorStats", "CachingAllocator", "round_size", "segment_size", "simulate"]
