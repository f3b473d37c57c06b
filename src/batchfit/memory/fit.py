"""The largest micro-batch under a memory budget, from a few traced batch sizes.

Within one phase of a step, memory is affine in the micro-batch (weights and states fixed,
activations and their transients proportional to it), but the peak is the largest of several
phases (the optimizer step does not grow with the batch; backward does). So each phase is fitted
separately over traced sizes 1 and 2, the largest size whose every phase fits is solved for, and
a trace at that size confirms it (stepping down while the confirmation overshoots).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from batchfit.memory.types import MemoryEstimate

Estimator = Callable[[int], MemoryEstimate]


@dataclass(frozen=True)
class FitResult:
    """The answer and the estimates it rests on (every size that was traced)."""

    micro_batch_size: int  # 0: not even 1 fits
    estimate: MemoryEstimate | None
    traced: tuple[tuple[int, int], ...]  # (micro-batch, device-total bytes) per trace


def _total(est: MemoryEstimate) -> int:
    return est.device_total_bytes


def fit_micro_batch(
    estimate_at: Estimator, budget_bytes: int, *, limit: int = 1 << 16, max_traces: int = 8
) -> FitResult:
    """Largest micro-batch whose estimate's ``device_total_bytes`` stays within the budget.

    ``estimate_at(b)`` returns the estimate at micro-batch ``b``. Typically 3-4 calls: b = 1, 2,
    the secant's answer and its neighbour; the answer is always a size that was traced.

    Example:
        >>> from batchfit.memory.types import MemoryEstimate
        >>> from batchfit.spec import TrainingSetup
        >>> def fake(b):  # 10 GiB fixed + 3 GiB per sample
        ...     total = (10 + 3 * b) << 30
        ...     return MemoryEstimate("m", "trace", "cuda", b, 1, TrainingSetup(), {}, total,
        ...                           total, total, 0, 0, "backward")
        >>> fit_micro_batch(fake, 40 << 30).micro_batch_size
        10
    """
    traced: list[tuple[int, int]] = []
    cache: dict[int, MemoryEstimate] = {}

    def at(b: int) -> MemoryEstimate:
        if b not in cache:
            cache[b] = estimate_at(b)
            traced.append((b, _total(cache[b])))
        return cache[b]

    if _total(at(1)) > budget_bytes:
        return FitResult(0, cache[1], tuple(traced))
    lo, hi = 1, None  # largest size traced within budget, smallest traced over it
    guess, predicted, slope = 2, None, 0.0
    for _ in range(max_traces - 1):
        guess = max(lo + 1, min(guess, limit, (hi or limit + 1) - 1))
        if guess <= lo or (hi is not None and guess >= hi):
            break
        total = _total(at(guess))
        if total <= budget_bytes:
            lo = guess
            # The secant predicted this size's memory and the next size is over budget:
            # the law is confirmed where it matters, no further trace is needed.
            confirmed = predicted is not None and abs(total - predicted) <= 0.005 * budget_bytes
            if confirmed and total + slope > budget_bytes:
                break
        else:
            hi = guess
        if hi == lo + 1 or lo == limit:
            break
        # Memory is convex in the batch (the largest of affine phases): the secant through the
        # bracket lies above it, so its crossing never overshoots; before a bracket exists the
        # secant through the two largest fitting sizes extrapolates.
        if hi is not None:
            slope = (_total(cache[hi]) - _total(cache[lo])) / (hi - lo)
        else:
            prev = max(b for b in cache if b < lo)
            slope = (_total(cache[lo]) - _total(cache[prev])) / (lo - prev)
        step = math.floor((budget_bytes - _total(cache[lo])) / slope) if slope > 0 else limit
        guess = lo + max(1, step)
        predicted = _total(cache[lo]) + slope * (guess - lo)
    b = lo
    return FitResult(b, at(b), tuple(traced))
