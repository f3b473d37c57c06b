"""The fixed inputs of one plan (``_Target``): what fits, how long a step takes, each option
at its largest micro-batch; and ``_Fit``, what the ladder search settled on."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from batchfit.hardware import GpuSpec
from batchfit.lengths import LengthsSummary, sample_tokens
from batchfit.memory.fit import FitResult
from batchfit.memory.formulas.analytic import resolve_setup
from batchfit.memory.types import MemoryEstimate
from batchfit.models import ModelInfo
from batchfit.plan._divisors import largest_divisor_at_most
from batchfit.plan._ladder import Combo
from batchfit.plan._max_micro_batch import (
    beyond_reach,
    error_line,
    fits,
    max_micro_batch,
    trace_errors,
    traced_fit,
)
from batchfit.plan._own import OwnModel
from batchfit.plan._throughput import Measured
from batchfit.plan._value import Alternative
from batchfit.spec import TrainingSetup
from batchfit.speed import comm_bytes_per_step, counted_step_time, step_time
from batchfit.workload import Workload

# TrainingSetup fields that change the activations: a setup the formulas' traced error
# carries over to shares them all, and the most of the memory layout's
ACTIVATION_FIELDS = ("grad_ckpt", "grad_ckpt_every", "loss", "method", "precision", "attention")
LAYOUT_FIELDS = ("optimizer", "optimizer_impl", "sharding", "offload", "num_gpus")


@dataclass(frozen=True)
class _Fit:
    """What the ladder search settled on: the setup, its techniques, its largest micro-batch."""

    setup: TrainingSetup
    techniques: Combo
    max_micro_batch: int
    alternatives: tuple[Alternative, ...]
    notes: tuple[str, ...] = ()  # why a faster-predicted option was not chosen


@dataclass(frozen=True)
class _Target:
    """The fixed inputs of one plan: model, GPU, sequence length, per-GPU batch, headroom."""

    model: ModelInfo | OwnModel
    gpu: GpuSpec
    seq_len: int
    per_gpu: int
    headroom: int

    engine: str
    measured: Measured | None = None  # --throughput-from: the probe's correction
    # "lines": an alternative's size from the peak moments' lines, traced only when chosen;
    # "traced": each alternative searched and confirmed as the plan's own choice is
    alternatives: str = "lines"
    # --lengths: a micro-batch's tokens with dynamic padding follow them (time only)
    lengths: LengthsSummary | None = None
    # --learned-time: measured over predicted on this GPU (``calibration.time_factor``)
    time_factor: float = 1.0
    # an estimate of each setup at some size: what its communication needs (the resolved
    # setup, its parameter counts) does not depend on the size
    sized: dict[TrainingSetup, MemoryEstimate] = field(default_factory=dict, compare=False)
    # the trace's device total minus the formulas' at each size searched, per setup: the
    # next similar setup's search starts from the formulas corrected by it (``correction``)
    errors: dict[TrainingSetup, tuple[tuple[int, int], ...]] = field(
        default_factory=dict, compare=False
    )

    def timed_micro(self, max_micro: int, wanted: int | None) -> int:
        """The micro-batch an option is timed at: the one asked for, else the largest that
        divides the per-GPU batch and fits."""
        return wanted or largest_divisor_at_most(self.per_gpu, max_micro)

    def beyond(self, setup: TrainingSetup) -> MemoryEstimate | None:
        """The formulas' estimate at micro-batch 1 where ``setup`` is far past the card
        (``beyond_reach``): by the trace engine it is not traced. None otherwise."""
        if self.engine != "trace":
            return None
        args = (self.model, setup, self.gpu, self.seq_len, self.per_gpu, self.headroom)
        est = beyond_reach(*args)
        if est is not None:
            self.sized.setdefault(setup, est)  # its communication, without a dry run
        return est

    def max_micro(self, setup: TrainingSetup) -> int:
        args = (self.model, setup, self.gpu, self.seq_len, self.per_gpu, self.headroom)
        if self.beyond(setup) is not None:
            return 0
        if self.engine == "trace":
            found = self._searched(setup, confirm=True)
            return found.micro_batch_size
        return max_micro_batch(*args)

    def _searched(self, setup: TrainingSetup, *, confirm: bool) -> FitResult:
        """``traced_fit`` of ``setup``, seeded by the formulas corrected by the error the trace
        measured on the most similar setup searched before; its own error kept in turn."""
        args = (self.model, setup, self.gpu, self.seq_len, self.per_gpu, self.headroom)
        found = traced_fit(*args, confirm=confirm, correction=self.correction(setup))
        if found.estimate is not None:
            self.sized.setdefault(setup, found.estimate)
            if found.estimate.engine == "trace" and setup not in self.errors:
                points = trace_errors(*args[:5], found)
                if points:
                    self.errors[setup] = points
        return found

    def correction(self, setup: TrainingSetup) -> Callable[[int], float] | None:
        """The formulas' error by the trace on a searched setup with the same activations
        (checkpointing, loss, method, precision, attention), the one that shares most of the
        memory layout (optimizer, sharding, offload); None where there is none. Across other
        activations the formulas' error differs (a loss that holds no logits drops most of
        it): the formulas alone seed those, except every K-th layer's checkpointing, seeded
        by a blend of the errors with every layer checkpointed and with none."""

        line = self._alike(setup)
        every = setup.grad_ckpt_every
        if line is not None or not every:
            return line
        # every K-th layer checkpointed: 1/K of the layers err as under full checkpointing,
        # the rest as without it
        full = self._alike(replace(setup, grad_ckpt_every=None))
        none = self._alike(replace(setup, grad_ckpt=False, grad_ckpt_every=None))
        if full is None or none is None:
            return None
        return lambda b: (full(b) + (every - 1) * none(b)) / every

    def _alike(self, setup: TrainingSetup) -> Callable[[int], float] | None:
        def same(other: TrainingSetup, fields: tuple[str, ...]) -> int:
            return sum(getattr(other, f) == getattr(setup, f) for f in fields)

        alike = [o for o in self.errors if same(o, ACTIVATION_FIELDS) == len(ACTIVATION_FIELDS)]
        if not alike:
            return None
        nearest = max(alike, key=lambda o: same(o, LAYOUT_FIELDS))  # the first among equals
        return error_line(self.errors[nearest])

    def step_seconds(self, setup: TrainingSetup, micro_batch_size: int) -> float:
        """Predicted seconds of one optimizer step at ``micro_batch_size`` (``batchfit.speed``);
        0 where the time model does not apply (then every option ties and the fallbacks
        decide)."""
        # what its dry runs counted (the same per sample at any size): an image model's step,
        # and your own module's, are timed from them
        est = self.sized.get(setup)
        flops = est.counted if est is not None else None
        accum = max(self.per_gpu // micro_batch_size, 1)
        if not isinstance(self.model, ModelInfo):
            if est is None or flops is None:
                return 0.0
            trainable = est.trainable_params
            own = counted_step_time(flops, est.setup, self.gpu, micro_batch_size, trainable)
            return 0.0 if own is None else own.step_seconds(accum) * self.time_factor
        resolved = resolve_setup(self.model, setup, "cuda", self.gpu)
        workload = Workload(micro_batch_size, self.seq_len, gpu=self.gpu, lengths=self.lengths)
        t = step_time(self.model, resolved, self.gpu, workload=workload, flops_per_sample=flops)
        if t is not None and self.measured is not None:
            t = self.measured.corrected(t, resolved, micro_batch_size)
        return 0.0 if t is None else t.step_seconds(accum) * self.time_factor

    def fits(self, setup: TrainingSetup, micro_batch_size: int) -> tuple[bool, MemoryEstimate]:
        # a size that does not divide the per-GPU batch still accumulates (memory is the
        # same for any count from 2 up): 35 of 64 is estimated at 2, never at 1
        size, per_gpu = micro_batch_size, self.per_gpu
        accum = 1 if size >= per_gpu else max(2, per_gpu // size)
        ok, est = fits(
            self.model,
            setup,
            self.gpu,
            size,
            self.seq_len,
            accum,
            self.headroom,
            self.engine,
            self.lengths,
        )
        self.sized.setdefault(setup, est)
        return ok, est

    def alternative(self, combo: Combo, setup: TrainingSetup) -> Alternative:
        """``setup`` (``combo`` applied) at its largest micro-batch, for the alternatives.

        By the trace engine, searched from the formulas' answer (``traced_fit``): the figure
        is ``estimate``'s at the size shown. With the default ``alternatives="lines"`` the
        search stops at a size that fits where the traced slope says the next does not, and
        ``from_lines`` says the size after it was not traced; with ``"traced"`` it is
        confirmed as the plan's own is (the size after it does not fit). By the formulas
        when the trace cannot run the setup, or when they put it far past the card
        (``beyond_reach``: not traced, it cannot fit).
        """
        beyond = self.beyond(setup)
        if beyond is not None:  # shown with the formulas' figure, marked (never chosen)
            total = beyond.device_total_bytes
            return Alternative(combo, setup, 0, total, beyond.engine, beyond_reach=True)
        if self.engine == "trace":
            found = self._searched(setup, confirm=self.alternatives == "traced")
            if found.estimate is not None and found.estimate.engine != "trace":
                found = self._searched(setup, confirm=True)  # the formulas answered: free
            size, est = found.micro_batch_size, found.estimate
            if est is not None:
                sizes = {b for b, _ in found.traced}
                bound = 0 < size < self.per_gpu and size + 1 not in sizes
                total = est.device_total_bytes
                return Alternative(combo, setup, size, total, est.engine, from_lines=bound)
        best = self.max_micro(setup)
        _, est = self.fits(setup, max(best, 1))
        return Alternative(combo, setup, best, est.device_total_bytes, est.engine)

    def confirmed(self, alt: Alternative) -> Alternative:
        """``alt`` with its largest micro-batch searched and confirmed as the plan's own is
        (the trace at the answer fits, the size after it does not); as is where that holds
        already (``alt.from_lines`` False) and by the formulas."""
        if self.engine != "trace" or not alt.from_lines:
            return alt
        best = self.max_micro(alt.setup)
        _, est = self.fits(alt.setup, max(best, 1))
        return replace(
            alt,
            max_micro_batch=best,
            device_total_bytes=est.device_total_bytes,
            engine=est.engine,
            from_lines=False,
        )

    def comm(self, setup: TrainingSetup) -> int:
        """Bytes one GPU sends per optimizer step under ``setup`` (``speed/_comm.py``)."""
        est = self.sized.get(setup) or self.fits(setup, 1)[1]
        return comm_bytes_per_step(est.setup, est.total_params, est.trainable_params)


def timed(target: _Target, alt: Alternative) -> Alternative:
    """``alt`` with the time model's figures at the largest micro-batch it allows."""
    if not alt.max_micro_batch:
        return alt
    micro = largest_divisor_at_most(target.per_gpu, alt.max_micro_batch)
    seconds = target.step_seconds(alt.setup, micro) or None
    tokens = None
    if seconds is not None:  # an image model's and your own module's count samples
        image = not isinstance(target.model, ModelInfo) or target.model.arch.family == "vision"
        sample = 1.0 if image else sample_tokens(target.lengths, target.seq_len, micro)
        tokens = target.per_gpu * sample / seconds
    measured = target.measured
    source = measured.correction(alt.setup, micro).source if measured and seconds else None
    return replace(
        alt,
        micro_batch_size=micro,
        step_seconds=seconds,
        tokens_per_s_per_gpu=tokens,
        throughput_source=source,
    )
