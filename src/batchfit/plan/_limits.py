"""What batchfit plans at most: past these a target or a run length is a typo, refused in one
line instead of planned as if it were meant."""

from __future__ import annotations

from batchfit.errors import UsageError

# Past a million micro-batches per step a run is a typo (a step of hours at a micro-batch's
# millisecond), and its plan would still be printed as if it were one.
MAX_ACCUM_STEPS = 10**6
_SECONDS_IN_YEAR = 365.25 * 24 * 3600
# A run past a thousand years is a typo in its length, not a plan.
MAX_RUN_SECONDS = 1000 * _SECONDS_IN_YEAR


def check_accumulation(global_samples: int, steps: int, micro: int | None = None) -> None:
    """Refuse a step of more than ``MAX_ACCUM_STEPS`` micro-batches per GPU: ``steps`` exact
    at the fitted ``micro``, or a lower bound before the fit (``micro`` None).

    Example:
        >>> check_accumulation(64, 8, 8)
        >>> check_accumulation(10**12, 10**7)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        batchfit.errors.UsageError: ... need at least 10,000,000 accumulation steps on each GPU ...
    """
    if steps > MAX_ACCUM_STEPS:
        count = f"at least {steps:,}" if micro is None else f"{steps:,}"
        of = "" if micro is None else f" of micro-batch {micro}"
        raise UsageError(
            f"{global_samples:,} samples per step need {count} accumulation steps{of} on each "
            f"GPU (past the {MAX_ACCUM_STEPS:,} batchfit plans): give a smaller --global-batch "
            "or --global-batch-tokens"
        )


def check_run_length(steps: int | None, step_seconds: float | None, num_gpus: int) -> None:
    """Refuse a run of ``steps`` optimizer steps longer than ``MAX_RUN_SECONDS`` (None: no
    run length given, or no time predicted)."""
    if steps is None or step_seconds is None or steps * step_seconds <= MAX_RUN_SECONDS:
        return
    raise UsageError(
        f"the run would take {steps * step_seconds / _SECONDS_IN_YEAR:,.0f} years on {num_gpus} "
        f"GPU(s) ({steps:,} steps of ~{step_seconds:.3g} s): give a shorter --train-tokens or "
        "--epochs x --dataset-size"
    )
