"""The fixed inputs of one plan (``_Target``): what fits, how long a step takes, each option
at its largest micro-batch; and ``_Fit``, what the ladder search settled on."""

from __future__ import annotations

from dataclasses import dataclass, replace

from batchfit.hardware import GpuSpec
from batchfit.memory.fit import fitting_guess, predict
from batchfit.memory.formulas.analytic import resolve_setup
from batchfit.memory.types import MemoryEstimate
from batchfit.models import ModelInfo
from batchfit.plan._divisors import largest_divisor_at_most
from batchfit.plan._ladder import Combo
from batchfit.plan._max_micro_batch import fits, max_micro_batch, max_micro_batch_traced
from batchfit.plan._own import OwnModel
from batchfit.plan._throughput import Measured
from batchfit.plan._value import Alternative
from batchfit.spec import TrainingSetup
from batchfit.speed import comm_bytes_per_step, step_time
from batchfit.workload import Workload


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

    def timed_micro(self, max_micro: int, wanted: int | None) -> int:
        """The micro-batch an option is timed at: the one asked for, else the largest that
        divides the per-GPU batch and fits."""
        return wanted or largest_divisor_at_most(self.per_gpu, max_micro)

    def max_micro(self, setup: TrainingSetup) -> int:
        args = (self.model, setup, self.gpu, self.seq_len, self.per_gpu, self.headroom)
        if self.engine == "trace":
            return max_micro_batch_traced(*args)
        return max_micro_batch(*args)

    def step_seconds(self, setup: TrainingSetup, micro_batch_size: int) -> float:
        """Predicted seconds of one optimizer step at ``micro_batch_size`` (``batchfit.speed``);
        0 where the time model does not apply (then every option ties and the fallbacks
        decide)."""
        if not isinstance(self.model, ModelInfo):
            return 0.0
        resolved = resolve_setup(self.model, setup, "cuda", self.gpu)
        workload = Workload(micro_batch_size=micro_batch_size, seq_len=self.seq_len, gpu=self.gpu)
        t = step_time(self.model, resolved, self.gpu, workload=workload)
        if t is not None and self.measured is not None:
            t = self.measured.corrected(t, resolved, micro_batch_size)
        return 0.0 if t is None else t.step_seconds(max(self.per_gpu // micro_batch_size, 1))

    def fits(self, setup: TrainingSetup, micro_batch_size: int) -> tuple[bool, MemoryEstimate]:
        # a size that does not divide the per-GPU batch still accumulates (memory is the
        # same for any count from 2 up): 35 of 64 is estimated at 2, never at 1
        size, per_gpu = micro_batch_size, self.per_gpu
        accum = 1 if size >= per_gpu else max(2, per_gpu // size)
        return fits(
            self.model, setup, self.gpu, size, self.seq_len, accum, self.headroom, self.engine
        )

    def alternative(self, combo: Combo, setup: TrainingSetup) -> Alternative:
        """``setup`` (``combo`` applied) at its largest micro-batch, for the alternatives.

        By the trace engine, from each peak moment's line through sizes 1 and 2, traced at that
        size (and stepped down while it does not fit, ``fitting_guess``): the figure is
        ``estimate``'s at the size shown, and ``from_lines`` says the size after it was not
        traced (the default ``alternatives="lines"``). With ``alternatives="traced"``, the size
        after it is traced too: where the lines' size does not fit, or the next one does too,
        the size is searched upward and confirmed as the plan's own is. By the formulas when
        the trace cannot run the setup.
        """
        if self.engine == "trace":
            budget = self.gpu.memory_bytes - max(self.headroom, 1)
            if self.alternatives == "lines":
                at = lambda m: self.fits(setup, m)[1]  # noqa: E731
                guess = fitting_guess(at, budget, limit=self.per_gpu)
                if guess is not None:
                    size, est = guess.micro_batch_size, guess.estimate
                    assert est is not None
                    bound = 0 < size < self.per_gpu  # the size after it was not traced
                    total = est.device_total_bytes
                    return Alternative(combo, setup, size, total, est.engine, from_lines=bound)
            one, two = self.fits(setup, 1)[1], self.fits(setup, 2)[1]
            lines = predict(one, two, budget, self.per_gpu)
            if lines is not None:
                if lines[0] == 0:  # size 1 was traced: it does not fit
                    return Alternative(combo, setup, 0, lines[1], two.engine)
                size = lines[0]
                ok, est = self.fits(setup, size)
                alt = Alternative(combo, setup, size, est.device_total_bytes, est.engine)
                if ok and (size >= self.per_gpu or not self.fits(setup, size + 1)[0]):
                    return alt
                return self.confirmed(replace(alt, from_lines=True))
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
        est = self.fits(setup, 1)[1]
        return comm_bytes_per_step(est.setup, est.total_params, est.trainable_params)


def timed(target: _Target, alt: Alternative) -> Alternative:
    """``alt`` with the time model's figures at the largest micro-batch it allows."""
    if not alt.max_micro_batch:
        return alt
    micro = largest_divisor_at_most(target.per_gpu, alt.max_micro_batch)
    seconds = target.step_seconds(alt.setup, micro) or None
    tokens = None
    if seconds is not None and isinstance(target.model, ModelInfo):
        tokens = target.per_gpu * target.seq_len / seconds
    measured = target.measured
    source = measured.correction(alt.setup, micro).source if measured and seconds else None
    return replace(
        alt,
        micro_batch_size=micro,
        step_seconds=seconds,
        tokens_per_s_per_gpu=tokens,
        throughput_source=source,
    )
