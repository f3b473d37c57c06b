"""The largest micro-batch under a memory budget, from a few traced batch sizes.

Within one moment of a step (the start of backward, its end, the optimizer step, ...) memory
is affine in the micro-batch: weights and states are fixed, activations and their transients
grow with it. The peak is the largest moment, so each moment's line is fitted through traced
sizes 2 and 3, the largest size under every line is solved for, and traces at that size (it
must fit) and the next (it must not) confirm it. Where a confirmation disagrees, the search
narrows the bracket with the secant through the sizes traced on both sides. Where the
formulas can size the model, ``seeded_fit`` starts at their answer instead and needs no
traces at small sizes. (Sizes 2 and 3, not 1 and 2: a dry run at size 1 may view where a
larger batch copies, so its history does not line up with theirs; from 2 and 3, the sizes
searched between may be read from the histories, ``interpolated_sizes``.)
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


def _by_lines(low: MemoryEstimate, high: MemoryEstimate, budget: int, limit: int) -> int | None:
    """The largest size under every moment's line through two traced sizes (None: no
    lines)."""
    lines = moment_lines(low, high)
    if lines is None:
        return None
    outside, ratio = _outside(high)
    best = limit
    for at_one, slope in lines:
        if slope > 0:
            best = min(best, math.floor(((budget - outside) / ratio - at_one) / slope) + 1)
    return max(best, 1)


def _outside(two: MemoryEstimate) -> tuple[int, float]:
    """What the device adds to the allocated peak, as (fixed bytes, factor on the peak): the
    context and NCCL are fixed; the allocator's reserve beyond the peak grows with it (larger
    activations leave larger holes), so it is carried as a ratio of the peak at the larger
    traced size."""
    fixed = two.device_total_bytes - two.reserved_bytes
    ratio = two.reserved_bytes / two.peak_bytes if two.peak_bytes > 0 else 1.0
    return fixed, max(ratio, 1.0)


def moment_lines(low: MemoryEstimate, high: MemoryEstimate) -> list[tuple[float, float]] | None:
    """Each peak moment's (bytes at size 1, bytes per sample) from traces at two sizes (1
    and 2 where the size-1 figure is wanted as traced)."""
    a, b = low.micro_batch_size, high.micro_batch_size
    at_low, at_high = low.extras.get("moments"), high.extras.get("moments")
    if not isinstance(at_low, dict) or not isinstance(at_high, dict) or set(at_low) != set(at_high):
        return None
    if a == b:
        return None
    lines = []
    for key, here in at_low.items():
        slope = (at_high[key] - here) / (b - a)
        lines.append((here - slope * (a - 1), slope))
    return lines


def predict(
    one: MemoryEstimate, two: MemoryEstimate, budget_bytes: int, limit: int = 1 << 16
) -> tuple[int, int] | None:
    """The largest size within budget by the moments' lines, and its device total by them
    (None without lines); no trace confirms it, so it is for what-ifs, not for the plan."""
    if one.device_total_bytes > budget_bytes:
        return 0, one.device_total_bytes
    lines = moment_lines(one, two)
    best = _by_lines(one, two, budget_bytes, limit)
    if lines is None or best is None:
        return None
    outside, ratio = _outside(two)
    return best, outside + round(ratio * max(a + s * (best - 1) for a, s in lines))


def fitting_guess(
    estimate_at: Estimator, budget_bytes: int, *, limit: int = 1 << 16, max_traces: int = 4
) -> FitResult | None:
    """A size that fits by the trace, from the moments' lines: their answer, traced, and
    stepped down along the secant while it does not fit; the size after it is not traced, so
    the answer is a lower bound of ``fit_micro_batch``'s (None: no lines).

    The lines carry the allocator's reserve as its ratio at size 2, which fragmentation can
    outgrow at larger sizes (GPT-2 on a T4 with checkpointing: 1.05 at 2, 1.16 at 18), so
    their answer alone may not fit.
    """
    cache: dict[int, MemoryEstimate] = {}

    def at(b: int) -> MemoryEstimate:
        if b not in cache:
            cache[b] = estimate_at(b)
        return cache[b]

    def result(b: int) -> FitResult:
        return FitResult(b, cache[b], tuple((k, _total(e)) for k, e in cache.items()))

    lines = predict(at(1), at(2), budget_bytes, limit)
    if lines is None:
        return None
    if lines[0] == 0:
        return FitResult(0, cache[1], ((1, _total(cache[1])), (2, _total(cache[2]))))
    lo = 2 if _total(cache[2]) <= budget_bytes and limit >= 2 else 1
    size = lines[0]
    while size > lo and len(cache) < max_traces + 2:
        if _total(at(size)) <= budget_bytes:
            return result(size)
        # down along the secant between the largest size known to fit and this one
        slope = (_total(cache[size]) - _total(cache[lo])) / (size - lo)
        step = math.floor((budget_bytes - _total(cache[lo])) / slope) if slope > 0 else 0
        size = min(size - 1, lo + max(step, 0))
    return result(lo)


def largest_passing(ok: Callable[[int], bool], limit: int) -> int:
    """The largest size in 1..``limit`` that is ``ok`` (0: none), ``ok`` holding up to a size
    and failing above it: doubling, then bisecting.

    Example:
        >>> largest_passing(lambda b: 3 * b <= 40, 1 << 16), largest_passing(lambda b: b < 9, 4)
        (13, 4)
    """
    if not ok(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and ok(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def seeded_fit(
    estimate_at: Estimator,
    budget_bytes: int,
    seed_total: Callable[[int], int],
    *,
    limit: int = 1 << 16,
    confirm: bool = True,
    max_traces: int = 10,
) -> FitResult:
    """The largest micro-batch within budget by the trace, the search seeded by the formulas.

    ``seed_total(b)`` is the formulas' device total at ``b`` (no dry run): their largest size
    is traced first, and each next size is a step along a slope, the secant through traced
    sizes where two are known, else the formulas' bytes per sample. With ``confirm``, as
    ``fit_micro_batch``: the answer fits by the trace and the size after it does not (two
    dry runs where the formulas are right, against four from sizes 2 and 3). Without, the
    search stops at the first size that fits where the slope says the next does not: a
    lower bound, whose next size may be untraced (``FitResult.traced`` says).

    Example:
        >>> from batchfit.memory.types import MemoryEstimate
        >>> from batchfit.spec import TrainingSetup
        >>> def fake(b):  # 10 GiB fixed + 3 GiB per sample
        ...     total = (10 + 3 * b) << 30
        ...     return MemoryEstimate("m", "trace", "cuda", b, 1, TrainingSetup(), {}, total,
        ...                           total, total, 0, 0, "backward")
        >>> seeds = lambda b: (9 + 3 * b) << 30  # the formulas: 1 GiB low
        >>> found = seeded_fit(fake, 40 << 30, seeds)
        >>> found.micro_batch_size, [b for b, _ in found.traced]
        (10, [10, 11])
    """
    cache: dict[int, MemoryEstimate] = {}
    traced: list[tuple[int, int]] = []

    def total(b: int) -> int:
        if b not in cache:
            cache[b] = estimate_at(b)
            traced.append((b, _total(cache[b])))
        return _total(cache[b])

    lo, hi = 0, limit + 1  # largest size known to fit, smallest known not to (or past limit)
    guess = max(largest_passing(lambda b: seed_total(b) <= budget_bytes, limit), 1)
    last, stalls, robust, halved = 0, 0, False, False  # stalls: steps that did not shrink
    while len(cache) < max_traces:
        t = total(guess)
        lo, hi = (max(lo, guess), hi) if t <= budget_bytes else (lo, min(hi, guess))
        if hi - lo <= 1:
            break
        slope = _slope(cache, lo, hi, guess, seed_total)
        if t <= budget_bytes:
            step = math.floor((budget_bytes - t) / slope) if slope > 0 else 15 * guess
            if step < 1 and not confirm:
                break
            step = max(step, 1)
        else:
            step = -(max(math.ceil((t - budget_bytes) / slope), 1) if slope > 0 else 1)
        same_way = last != 0 and (last > 0) == (step > 0)
        stalls = stalls + 1 if same_way and abs(step) >= abs(last) else 0
        # A third step the same way that did not shrink: the search creeps (a total level
        # with the budget on a stair of the allocator's segments, a flat moment under it, a
        # secant steepened by a stair). From then on: double the step until the answer is
        # bracketed, then halve the bracket every other step.
        robust = robust or stalls >= 2
        bracketed = lo > 0 and hi <= limit
        halved = robust and bracketed and not halved
        if halved:  # every other step halves the bracket, the others are the secant's
            step = (lo + hi) // 2 - guess
        elif robust and same_way and not bracketed:
            step = 2 * last
        last = step
        guess = min(max(guess + step, lo + 1), hi - 1)
    if lo == 0 and hi > 1 and 1 not in cache:  # out of traces above 1: does 1 fit?
        lo = 1 if total(1) <= budget_bytes else 0
    return FitResult(lo, cache[lo] if lo else cache.get(1), tuple(traced))


def _slope(
    cache: dict[int, MemoryEstimate],
    lo: int,
    hi: int,
    at: int,
    seed_total: Callable[[int], int],
) -> float:
    """Bytes per sample near ``at``: the secant across the bracket when both ends are traced
    (memory is convex in the batch: its crossing never overshoots), else through the two
    traced sizes nearest ``at``, else (or where that secant is flat) the formulas'."""
    secant = 0.0
    if lo in cache and hi in cache:
        secant = (_total(cache[hi]) - _total(cache[lo])) / (hi - lo)
    elif len(cache) >= 2:
        a, b = sorted(sorted(cache, key=lambda b: abs(b - at))[:2])
        secant = (_total(cache[b]) - _total(cache[a])) / (b - a)
    # a flat secant (two sizes in one allocator segment) says nothing: the formulas' slope
    return secant if secant > 0 else float(seed_total(at + 1) - seed_total(at))


def fit_micro_batch(
    estimate_at: Estimator, budget_bytes: int, *, limit: int = 1 << 16, max_traces: int = 10
) -> FitResult:
    """Largest micro-batch whose estimate's ``device_total_bytes`` stays within the budget.

    ``estimate_at(b)`` returns the estimate at micro-batch ``b``. Typically 4 calls: b = 2, 3,
    the lines' answer and the size after it; the answer is always a size that was traced.

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

    # sizes 2 and 3 first, not 1: their histories line up with the larger sizes' (a size of
    # 1 may view where a larger batch copies), so those may be read from them
    # (``interpolated_sizes``); size 1 is traced only where 2 does not fit
    first = min(2, limit)
    if _total(at(first)) > budget_bytes:
        found = 1 if first > 1 and _total(at(1)) <= budget_bytes else 0
        return FitResult(found, cache[1], tuple(traced))
    lo, hi = first, limit + 1  # largest size known to fit, smallest known not to (or past limit)
    guess = 3
    while hi - lo > 1 and len(cache) < max_traces:
        guess = min(max(guess, lo + 1), hi - 1)
        if _total(at(guess)) <= budget_bytes:
            lo = guess
        else:
            hi = guess
        predicted = _by_lines(cache[2], cache[3], budget_bytes, limit) if 3 in cache else None
        if predicted is not None and lo < predicted < hi and predicted not in cache:
            guess = predicted  # the moments' lines: exact where memory is affine
        elif hi <= limit:
            # Memory is convex in the batch (the largest of affine moments): the secant
            # through the bracket lies above it, so its crossing never overshoots.
            slope = (_total(cache[hi]) - _total(cache[lo])) / (hi - lo)
            step = math.floor((budget_bytes - _total(cache[lo])) / slope) if slope > 0 else 1
            guess = lo + max(1, step)
        else:
            below = [b for b in cache if b < lo]
            prev = max(below) if below else None
            slope = (_total(cache[lo]) - _total(cache[prev])) / (lo - prev) if prev else 0.0
            # flat so far (a constant moment on top): jump ahead, the bracket then narrows
            step = math.floor((budget_bytes - _total(cache[lo])) / slope) if slope > 0 else 15 * lo
            guess = lo + max(1, step)
    return FitResult(lo, at(lo), tuple(traced))
