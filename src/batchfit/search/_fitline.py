"""The search's next size: aimed at the limit that the measured peaks predict.

Pure arithmetic over ``(micro_batch_size, peak_bytes)`` points and the bracket the trials
so far give (``lo`` fits, ``hi`` fails); :mod:`batchfit.search` runs the sizes.
"""

from __future__ import annotations

import math

# Aim this far below the limit on a one-point guess without an estimate: it rests on one
# measurement and an assumed slope.
MARGIN = 0.05
# And this far below it on a trusted fit: the measured peak is resident memory (CPU) or
# allocated memory (CUDA), while the limit counts address space or reserved blocks.
FIT_MARGIN = 0.01
# Without an estimate's bytes per sample, a trial goes at most this many times beyond the
# largest size that fitted.
GROWTH = 4


def fit_limit(
    points: list[tuple[int, int]], available: int, per_sample: int | None
) -> tuple[int, bool] | None:
    """Largest size whose fitted peak stays within ``available`` bytes, and whether to trust it.

    With the estimator's bytes per sample (``per_sample``): the measured peak of the largest
    size that fitted plus ``per_sample`` for each sample more (near the limit the measured
    offset matters, and a slope fitted through close sizes is mostly noise). Without: least
    squares through two or more sizes; through one, the peak taken as proportional to the size
    (an overestimate of the slope) less ``MARGIN``, a guess not trusted to say that the next
    size would fail. Aimed ``FIT_MARGIN`` below the limit: an overshoot costs one
    out-of-memory trial, after which the bracket is bisected.

    Example:
        >>> fit_limit([(10, 1000)], 2000, per_sample=90)  # 1000 + 90 per sample in 1980
        (20, True)
    """
    if not points:
        return None
    room = available * (1 - FIT_MARGIN)
    if per_sample:
        n, peak = max(points)
        return n + math.floor((room - peak) / per_sample), True
    if len(points) == 1:
        n, peak = points[0]
        return (math.floor(available * (1 - MARGIN) * n / peak), False) if peak > 0 else None
    xs = [float(n) for n, _ in points]
    ys = [float(p) for _, p in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    if var == 0:
        return None
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var
    if slope <= 0:
        return None
    return math.floor((room - (my - slope * mx)) / slope), True


def next_size(
    points: list[tuple[int, int]],
    lo: int,
    hi: int | None,
    low: int,
    available: int | None,
    per_sample: int | None,
    last_ok: bool,
) -> int | None:
    """Aim at the fitted limit, inside the bracket (``lo`` fits, ``hi`` fails); None: stop.

    ``lo`` is 0 while nothing fitted, ``hi`` None while nothing failed; ``low`` is the smallest
    size allowed and ``last_ok`` whether the size just run fitted.

    Example:
        >>> next_size([(10, 1000)], lo=10, hi=None, low=1, available=2000, per_sample=90,
        ...           last_ok=True)
        20
    """
    if hi is not None and hi <= lo + 1:
        return None
    fit = fit_limit(points, available, per_sample) if available else None
    if lo == 0:  # nothing fitted yet: halve below the smallest failure
        guess = max(low, (hi or 2 * low) // 2)
        return guess if guess < (hi or guess + 1) else None
    if fit is None:
        guess = lo * 2 if hi is None else (lo + hi) // 2  # no usable fit: double / bisect
    else:
        guess, trusted = fit
        if guess <= lo:
            if trusted:
                return None  # the fit says the next size would not fit
            guess = lo + 1  # an untrusted guess: one size more gives a second point
    if per_sample is None:
        # without an estimate, peaks measured at close sizes can fit an almost flat line:
        # never extrapolate it further than GROWTH times the largest size that ran
        guess = min(guess, GROWTH * lo)
    if hi is not None:
        guess = min(guess, hi - 1)
        if not last_ok:
            # Just failed: the fit overshot, so step at most halfway into the bracket.
            guess = min(guess, max(lo + 1, (lo + hi) // 2))
    return guess if guess > lo else None
