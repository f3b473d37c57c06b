"""The largest micro-batch that fits a GPU with headroom to spare, by an engine's estimate."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from batchfit._units import BYTES_IN_GIB
from batchfit.errors import UsageError
from batchfit.hardware import GpuSpec
from batchfit.lengths import LengthsSummary
from batchfit.memory.device.totals import fits_on_card
from batchfit.memory.estimate import estimate, interpolated_sizes
from batchfit.memory.fit import FitResult, fit_micro_batch, largest_passing, seeded_fit
from batchfit.memory.trace import sized
from batchfit.memory.types import MemoryEstimate
from batchfit.models import ModelInfo
from batchfit.plan._own import OwnModel
from batchfit.spec import TrainingSetup
from batchfit.workload import Workload

DEFAULT_HEADROOM_BYTES = BYTES_IN_GIB // 2
# an option whose formulas' total at micro-batch 1 exceeds the card by more than this is not
# traced: the formulas are within a few percent of the trace (their largest known excess,
# LoRA's dropout masks, is under 9%), so it cannot fit by the trace either
PRUNE_MARGIN = 0.25


def fits(
    model: ModelInfo | OwnModel,
    setup: TrainingSetup,
    gpu: GpuSpec,
    micro_batch_size: int,
    seq_len: int,
    accum: int,
    headroom: int,
    engine: str = "analytic",
    lengths: LengthsSummary | None = None,
) -> tuple[bool, MemoryEstimate]:
    """Whether ``micro_batch_size`` leaves ``headroom`` bytes free on ``gpu``; the estimate
    that says so (timed at the ``lengths`` a micro-batch computes, where given)."""
    if isinstance(model, OwnModel):  # its sizes come from its batch_fn: no seq_len
        own = model.estimate(setup, gpu, micro_batch_size, accum)
        return fits_on_card(own.device_total_bytes, gpu.memory_bytes, headroom), own
    workload = Workload(micro_batch_size, seq_len, "cuda", gpu, accum, lengths)
    est = estimate(model, setup, workload=workload, engine=engine)  # type: ignore[arg-type]
    return fits_on_card(est.device_total_bytes, gpu.memory_bytes, headroom), est


def search_budget(gpu: GpuSpec, headroom: int) -> int:
    """The most a fit's device total may be on ``gpu``: the card less ``headroom``, and at
    least a byte free whatever the headroom asked (``fits_on_card``)."""
    return gpu.memory_bytes - max(headroom, 1)


def beyond_reach(
    model: ModelInfo | OwnModel,
    setup: TrainingSetup,
    gpu: GpuSpec,
    seq_len: int,
    per_gpu_batch: int | None,
    headroom: int,
) -> MemoryEstimate | None:
    """The formulas' estimate at micro-batch 1 where it is over ``PRUNE_MARGIN`` past what
    ``gpu`` leaves after ``headroom``: the setup cannot fit, and the trace need not run it.
    None where it may fit, or where the formulas cannot size it (your own module, an image
    model, a setup only the trace runs)."""
    if not isinstance(model, ModelInfo):
        return None
    accum = _accum(1, per_gpu_batch)
    try:
        est = fits(model, setup, gpu, 1, seq_len, accum, headroom, "analytic")[1]
    except UsageError:
        return None
    far = est.device_total_bytes > search_budget(gpu, headroom) * (1 + PRUNE_MARGIN)
    return est if far else None


def _accum(micro: int, per_gpu_batch: int | None) -> int:
    """The accumulation a plan at ``micro`` runs with: 1 only when one micro-batch is the
    whole per-GPU batch; below it at least 2 (a size that does not divide the batch is never
    planned without accumulation), and memory is the same for any count from 2 up (later
    micro-steps hold the gradients of earlier ones)."""
    return 1 if not per_gpu_batch or micro >= per_gpu_batch else 2


def max_micro_batch(
    model: ModelInfo | OwnModel,
    setup: TrainingSetup,
    gpu: GpuSpec,
    seq_len: int,
    per_gpu_batch: int | None,
    headroom: int,
) -> int:
    """Largest micro-batch that fits (0 if even 1 does not), searching up to ``per_gpu_batch``.

    Memory grows with the micro-batch, so doubling then bisecting finds the boundary.
    """
    cap = per_gpu_batch or 1 << 16

    def ok(m: int) -> bool:
        return fits(model, setup, gpu, m, seq_len, _accum(m, per_gpu_batch), headroom)[0]

    return largest_passing(ok, cap)


def max_micro_batch_traced(
    model: ModelInfo | OwnModel,
    setup: TrainingSetup,
    gpu: GpuSpec,
    seq_len: int,
    per_gpu_batch: int | None,
    headroom: int,
) -> int:
    """Largest micro-batch by the trace engine, confirmed by traces at the answer (fits) and
    the size after it (does not); the search starts at the formulas' answer
    (:func:`traced_fit`)."""
    return traced_fit(model, setup, gpu, seq_len, per_gpu_batch, headroom).micro_batch_size


def traced_fit(
    model: ModelInfo | OwnModel,
    setup: TrainingSetup,
    gpu: GpuSpec,
    seq_len: int,
    per_gpu_batch: int | None,
    headroom: int,
    *,
    confirm: bool = True,
    correction: Callable[[int], float] | None = None,
) -> FitResult:
    """The trace engine's search for the largest micro-batch (``seeded_fit``): the formulas'
    answer traced first, then steps along the traced slope. Without ``confirm`` it stops at a
    size that fits where the slope says the next does not. ``correction(b)``: bytes added to
    the formulas' total at ``b`` before they seed the search (what the trace measured against
    them on a similar setup); it moves where the search starts, never what it confirms. A
    model the formulas cannot size (your own module, a setup they refuse) is searched from
    each peak moment's line through traced sizes 2 and 3 (``fit_micro_batch``)."""

    read: set[int] = set()  # sizes last answered from histories (``interpolated_sizes``)

    def at(m: int, engine: str = "trace") -> MemoryEstimate:
        accum = _accum(m, per_gpu_batch)
        est = fits(model, setup, gpu, m, seq_len, accum, headroom, engine)[1]
        (read.add if est.extras.get("from_histories") else read.discard)(m)
        return est

    def dry_runs(found: FitResult) -> FitResult:
        """``found`` with ``traced`` listing the sizes dry-run, not read from histories."""
        return replace(found, traced=tuple(p for p in found.traced if p[0] not in read))

    limit = per_gpu_batch or 1 << 16
    budget = search_budget(gpu, headroom)

    def search(confirm: bool) -> FitResult:  # a setup only the trace runs: from its lines
        return fit_micro_batch(at, budget, limit=limit)

    if isinstance(model, ModelInfo):

        def formulas(m: int) -> int:
            return at(m, "analytic").device_total_bytes

        def seed(m: int) -> int:
            return formulas(m) + (round(correction(m)) if correction else 0)

        try:
            formulas(1)
        except UsageError:
            pass
        else:

            def search(confirm: bool) -> FitResult:
                return seeded_fit(at, budget, seed, limit=limit, confirm=confirm)

    with interpolated_sizes():
        found = search(confirm)
    if not confirm:
        return dry_runs(found)
    confirmed = _confirmed(found, at, budget, limit)
    if confirmed is None:
        with interpolated_sizes(False):
            confirmed = search(True)
    return dry_runs(confirmed)


def _confirmed(
    found: FitResult, at: Callable[[int], MemoryEstimate], budget: int, limit: int
) -> FitResult | None:
    """``found``, its answer and the size after it traced (the search may have sized them
    from histories, ``interpolated_sizes``): the plan's size rests on dry runs at both. None
    where they disagree with the search (the caller searches again, every size traced)."""
    size = found.micro_batch_size
    with interpolated_sizes(False):
        here = at(size) if size else None
        after = at(size + 1) if size < limit else None
    fits_here = here is None or here.device_total_bytes <= budget
    if not fits_here or (after is not None and after.device_total_bytes <= budget):
        sized.forget()  # histories that misled the search answer nothing more
        return None
    # nothing fits: the estimate is size 1's, traced
    return replace(found, estimate=here or after or found.estimate)


def trace_errors(
    model: ModelInfo | OwnModel,
    setup: TrainingSetup,
    gpu: GpuSpec,
    seq_len: int,
    per_gpu_batch: int | None,
    found: FitResult,
) -> tuple[tuple[int, int], ...]:
    """(size, trace's device total minus the formulas') at each size ``found`` traced; empty
    where the formulas cannot size the setup."""
    if not isinstance(model, ModelInfo):
        return ()
    out = []
    for b, total in found.traced:
        accum = _accum(b, per_gpu_batch)
        try:
            formulas = fits(model, setup, gpu, b, seq_len, accum, 0, "analytic")[1]
        except UsageError:
            return ()
        out.append((b, total - formulas.device_total_bytes))
    return tuple(out)


def error_line(points: tuple[tuple[int, int], ...]) -> Callable[[int], float]:
    """The formulas' error at any size, from the two traced sizes nearest it (constant from
    one).

    Example:
        >>> line = error_line(((8, 100), (16, 180), (9, 110)))
        >>> line(12), line(20), error_line(((4, 50),))(30)
        (140.0, 220.0, 50.0)
    """

    def at(b: int) -> float:
        near = sorted(points, key=lambda p: (abs(p[0] - b), p[0]))[:2]
        if len(near) < 2 or near[0][0] == near[1][0]:
            return float(near[0][1])
        (x0, y0), (x1, y1) = near
        return y0 + (y1 - y0) * (b - x0) / (x1 - x0)

    return at
