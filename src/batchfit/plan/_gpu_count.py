"""``plan --num-gpus auto``: one plan per GPU count up to a limit, and the count to use.

Each count gets the full plan (its sharding options compared, timed); the choice is the most
GPUs that still do most of the work one GPU can: a run on more GPUs is faster until the
communication and the smaller per-GPU micro-batch eat the gain, and past that point the extra
GPUs cost money without buying time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from batchfit.errors import UsageError
from batchfit.plan._value import GpuCount, Plan

# The largest count `--num-gpus auto` tries unless told: one node of 8, the common box.
DEFAULT_MAX_GPUS = 8
# The most GPUs `auto` plans for at all: each count is a plan of its own (minutes when traced).
MAX_AUTO_GPUS = 1024
# More GPUs are worth it while each still does this share of the best per-GPU throughput among
# the counts tried (the GPU-hours of the run grow by at most 1/0.8 = 1.25x for the time saved):
# a house choice, stated in the output, not a published figure.
AUTO_EFFICIENCY = 0.8


def gpu_counts(max_gpus: int) -> list[int]:
    """The counts ``auto`` tries: powers of two up to ``max_gpus``, and ``max_gpus`` itself.

    Example:
        >>> gpu_counts(8), gpu_counts(6), gpu_counts(1)
        ([1, 2, 4, 8], [1, 2, 4, 6], [1])
    """
    if isinstance(max_gpus, bool) or not 1 <= max_gpus <= MAX_AUTO_GPUS:
        raise UsageError(f"--max-gpus must be 1 to {MAX_AUTO_GPUS}, got {max_gpus}")
    counts = []
    n = 1
    while n <= max_gpus:
        counts.append(n)
        n *= 2
    if counts[-1] != max_gpus:
        counts.append(max_gpus)
    return counts


def _summary(plan: Plan) -> GpuCount:
    fits = plan.fits and plan.max_micro_batch > 0
    speed = plan.speed_json()
    return GpuCount(
        num_gpus=plan.num_gpus,
        fits=fits,
        micro_batch_size=plan.micro_batch_size,
        grad_accum_steps=plan.grad_accum_steps,
        techniques=tuple(t.name for t in plan.techniques),
        sharding=plan.setup.sharding,
        step_seconds=speed["step_seconds"],
        tokens_per_s_per_gpu=speed["tokens_per_s_per_gpu"],
        train_seconds=plan.train_seconds,
        cost_usd=plan.cost_usd,
    )


def _throughput(row: GpuCount, global_batch: int) -> float | None:
    """Samples a GPU trains per second under ``row`` (tokens would do; images have none)."""
    if not row.step_seconds:
        return None
    return global_batch / row.num_gpus / row.step_seconds


def choose(
    plan_for: Callable[[int], Plan], max_gpus: int, progress: Callable[[str], None] | None = None
) -> Plan:
    """The plan at the GPU count ``auto`` picks, with every count's summary in ``gpu_counts``.

    ``plan_for(n)`` plans on ``n`` GPUs (a ``UsageError`` from it, a global batch that does not
    split over ``n``, leaves the count out with its reason). The pick: among the counts whose
    plan fits, the most GPUs whose per-GPU throughput is at least ``AUTO_EFFICIENCY`` of the
    best count's; without a time model (an image model), the fewest GPUs that fit.
    """
    plans: dict[int, Plan] = {}
    rows: list[GpuCount] = []
    counts = gpu_counts(max_gpus)
    for k, n in enumerate(counts, 1):
        if progress is not None:
            progress(f"{n} GPU{'s' if n > 1 else ''} ({k} of {len(counts)})")
        try:
            plans[n] = plan_for(n)
        except UsageError as e:
            rows.append(GpuCount(n, False, 0, 0, (), "", None, None, None, None, note=str(e)))
            continue
        rows.append(_summary(plans[n]))
    fitting = [r for r in rows if r.fits]
    if not plans:
        reasons = "; ".join(f"{r.num_gpus}: {r.note}" for r in rows)
        raise UsageError(f"--num-gpus auto found no GPU count to plan on ({reasons})")
    if not fitting:
        pick = max(plans)  # nothing fits anywhere: the most GPUs shows the smallest miss
        why = f"nothing fits on up to {max_gpus} GPUs; the plan on {pick} shows by how much"
    else:
        batch = next(iter(plans.values())).global_batch_size
        speeds = {r.num_gpus: _throughput(r, batch) for r in fitting}
        timed = {n: v for n, v in speeds.items() if v is not None}
        if len(timed) == len(speeds):
            best = max(timed.values())
            rows = [
                replace(r, efficiency=timed[r.num_gpus] / best) if r.num_gpus in timed else r
                for r in rows
            ]
            pick = max(n for n, v in timed.items() if v >= AUTO_EFFICIENCY * best)
            more = [n for n in timed if n > pick]
            why = (
                f"{pick} GPU{'s' if pick > 1 else ''}: the most of the counts tried (up to "
                f"{max_gpus}) whose GPUs each keep {AUTO_EFFICIENCY:.0%} of the best per-GPU "
                "throughput"
                + (
                    f"; on {more[0]} each GPU would do {timed[more[0]] / best:.0%}: more "
                    "GPU-hours for less time saved"
                    if more
                    else ""
                )
            )
        else:
            pick = min(r.num_gpus for r in fitting)
            why = f"{pick} GPU(s): the fewest that fit (no time model for this model)"
    rows = [replace(r, chosen=r.num_gpus == pick) for r in rows]
    return replace(plans[pick], gpu_counts=tuple(rows), gpu_count_rule=why)
