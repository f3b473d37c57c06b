"""Plan: global batch -> micro-batch x accumulation x GPUs, exactly; the LR; what makes it fit.

The planner's rooms, in this folder: ``_ladder.py`` (the technique ladder),
``_max_micro_batch.py`` (the largest micro-batch that fits), ``_divisors.py`` (micro-batches that
divide the batch), ``_lr_scaling.py`` (the LR rule), ``_value.py`` (the ``Plan`` value) and
``_fit_table.py`` (``batchfit gpus``).
This module puts them together.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from batchfit._batchnorm import batchnorm_warning
from batchfit._units import human_bytes, ordinal
from batchfit.errors import UsageError
from batchfit.hardware import GpuSpec
from batchfit.memory.estimate import usable_engine
from batchfit.memory.fit import predict
from batchfit.memory.types import MemoryEstimate
from batchfit.models import ModelInfo
from batchfit.plan._batch_laws import BatchAdvice as BatchAdvice
from batchfit.plan._batch_laws import model_batch_laws as model_batch_laws
from batchfit.plan._divisors import MAX_N, divisors_near
from batchfit.plan._divisors import largest_divisor_at_most as largest_divisor_at_most
from batchfit.plan._fit_table import FIT_RULE as FIT_RULE
from batchfit.plan._fit_table import FitRow, fit_table
from batchfit.plan._gpu_count import DEFAULT_MAX_GPUS, choose
from batchfit.plan._ladder import (
    GRAD_CKPT,
    OFFLOAD_MARGIN,
    OFFLOADS,
    PARTIAL_CKPT_EVERY,
    PARTIAL_CKPT_FRAMEWORKS,
    Combo,
    Technique,
    apply,
    ladder,
    partial_ckpt,
)
from batchfit.plan._ladder import TIME_TOLERANCE as TIME_TOLERANCE
from batchfit.plan._lr_scaling import (
    DEFAULT_BETAS,
    DEFAULT_EPS,
    follow_batch,
    lr_options,
    scale_learning_rate,
)
from batchfit.plan._lr_scaling import parse_betas as parse_betas
from batchfit.plan._max_micro_batch import (
    DEFAULT_HEADROOM_BYTES,
    fits,
    max_micro_batch,
    max_micro_batch_traced,
)
from batchfit.plan._own import OwnModel, own_model
from batchfit.plan._prices import gpu_hour_price as _hour_price
from batchfit.plan._throughput import Measured, ProbeFile, bind
from batchfit.plan._throughput import probe_identity as probe_identity
from batchfit.plan._throughput import read_probe as read_probe
from batchfit.plan._value import Alternative, Plan
from batchfit.spec import TrainingSetup
from batchfit.speed import comm_bytes_per_step

__all__ = [
    "DEFAULT_HEADROOM_BYTES",
    "Alternative",
    "FitRow",
    "Plan",
    "Technique",
    "fit_table",
    "make_plan",
    "make_plan_auto",
    "samples_from_target",
    "scale_learning_rate",
]

MAX_QUIET_ACCUM = 64


def samples_from_target(
    global_batch: int | None, global_batch_tokens: int | None, seq_len: int, num_gpus: int
) -> int:
    """The global batch in samples; exact or a UsageError naming the nearest reachable ones."""
    if (global_batch is None) == (global_batch_tokens is None):
        raise UsageError("give exactly one of --global-batch (samples) or --global-batch-tokens")
    if global_batch is not None:
        if global_batch < 1:
            raise UsageError(f"--global-batch must be positive, got {global_batch}")
        if global_batch % num_gpus:
            raise UsageError(
                f"--global-batch {global_batch} cannot be split evenly over {num_gpus} GPUs; "
                f"nearest reachable: {_nearest(global_batch, num_gpus)}, or --num-gpus "
                f"{divisors_near(global_batch, num_gpus)}"
            )
        return global_batch
    assert global_batch_tokens is not None  # exactly one was given (checked above)
    if global_batch_tokens < 1:
        raise UsageError(f"--global-batch-tokens must be positive, got {global_batch_tokens}")
    unit = seq_len * num_gpus
    if global_batch_tokens % unit:
        samples = global_batch_tokens // seq_len if global_batch_tokens % seq_len == 0 else 0
        world = f", or --num-gpus {divisors_near(samples, num_gpus)}" if samples else ""
        raise UsageError(
            f"--global-batch-tokens {global_batch_tokens} is not a multiple of seq-len x GPUs "
            f"= {unit}; nearest reachable: {_nearest(global_batch_tokens, unit)} tokens{world}"
        )
    return global_batch_tokens // seq_len


def _nearest(value: int, unit: int) -> str:
    lo = value // unit * unit
    options = [v for v in (lo, lo + unit) if v > 0]
    return " or ".join(f"{v:,}" for v in options)


def _check_inputs(
    micro_batch_size: int | None, per_gpu: int, base_lr: float | None, base_batch: float | None
) -> None:
    """Refuse what no plan can follow, before any estimate runs."""
    if per_gpu > MAX_N:  # the divisor search factors it: keep its cost bounded
        raise UsageError(
            f"{per_gpu:,} samples per GPU per step is past what batchfit plans (2**64); "
            "give a smaller --global-batch or --global-batch-tokens"
        )
    if micro_batch_size is not None and micro_batch_size < 1:
        raise UsageError(f"--micro-batch must be positive, got {micro_batch_size}")
    if micro_batch_size is not None and per_gpu % micro_batch_size:
        raise UsageError(
            f"--micro-batch {micro_batch_size} does not divide the {per_gpu} samples each "
            f"GPU takes per step; try {divisors_near(per_gpu, micro_batch_size)}"
        )
    if (base_lr is None) != (base_batch is None):
        raise UsageError(
            "give --base-lr with --base-batch (samples) or --base-batch-tokens (tokens): "
            "the batch the LR was tuned at"
        )


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

    def timed_micro(self, max_micro: int, wanted: int | None) -> int:
        """The micro-batch an option is timed at: the one asked for, else the largest that
        divides the per-GPU batch and fits."""
        return wanted or largest_divisor_at_most(self.per_gpu, max_micro)

    def max_micro(self, setup: TrainingSetup) -> int:
        args = (self.model, setup, self.gpu, self.seq_len, self.per_gpu, self.headroom)
        if self.engine == "trace":
            return max_micro_batch_traced(*args)
        return max_micro_batch(*args)

    def step_seconds(self, setup: TrainingSetup, micro: int) -> float:
        """Predicted seconds of one optimizer step at ``micro`` (``batchfit.speed``); 0 where
        the time model does not apply (then every option ties and the fallbacks decide)."""
        if not isinstance(self.model, ModelInfo):
            return 0.0
        from batchfit.memory.formulas.analytic import resolve_setup
        from batchfit.speed import step_time

        resolved = resolve_setup(self.model, setup, "cuda", self.gpu)
        t = step_time(self.model, resolved, self.gpu, micro_batch_size=micro, seq_len=self.seq_len)
        if t is not None and self.measured is not None:
            t = self.measured.corrected(t, resolved, micro)
        return 0.0 if t is None else t.step_seconds(max(self.per_gpu // micro, 1))

    def fits(self, setup: TrainingSetup, micro: int) -> tuple[bool, MemoryEstimate]:
        # a size that does not divide the per-GPU batch still accumulates (memory is the
        # same for any count from 2 up): 35 of 64 is estimated at 2, never at 1
        accum = 1 if micro >= self.per_gpu else max(2, self.per_gpu // micro)
        return fits(
            self.model, setup, self.gpu, micro, self.seq_len, accum, self.headroom, self.engine
        )

    def alternative(self, combo: Combo, setup: TrainingSetup) -> Alternative:
        """``setup`` (``combo`` applied) at its largest micro-batch, for the alternatives.

        By the trace engine, from each peak moment's line through sizes 1 and 2, then one
        trace at that size: its figure is the one shown, and where it does not fit the size is
        searched and confirmed as the plan's own is; by the formulas when the trace cannot run
        the setup.
        """
        if self.engine == "trace":
            one, two = self.fits(setup, 1)[1], self.fits(setup, 2)[1]
            budget = self.gpu.memory_bytes - max(self.headroom, 1)
            lines = predict(one, two, budget, self.per_gpu)
            if lines is not None:
                if lines[0] == 0:
                    return Alternative(combo, setup, 0, lines[1], two.engine)
                ok, est = self.fits(setup, lines[0])
                alt = Alternative(combo, setup, lines[0], est.device_total_bytes, est.engine)
                return alt if ok else self.confirmed(alt)
        best = self.max_micro(setup)
        _, est = self.fits(setup, max(best, 1))
        return Alternative(combo, setup, best, est.device_total_bytes, est.engine)

    def confirmed(self, alt: Alternative) -> Alternative:
        """``alt`` with its largest micro-batch searched and confirmed as the plan's own is
        (the trace at the answer fits, the size after it does not); as is by the formulas."""
        if self.engine != "trace":
            return alt
        best = self.max_micro(alt.setup)
        _, est = self.fits(alt.setup, max(best, 1))
        return replace(
            alt, max_micro_batch=best, device_total_bytes=est.device_total_bytes, engine=est.engine
        )

    def comm(self, setup: TrainingSetup) -> int:
        """Bytes one GPU sends per optimizer step under ``setup`` (``speed/_comm.py``)."""
        est = self.fits(setup, 1)[1]
        return comm_bytes_per_step(est.setup, est.total_params, est.trainable_params)


def _climb(target: _Target, setup: TrainingSetup, wanted: int | None) -> _Fit:
    """The ladder's choice (``_climb_ladder``), checkpointing the fewest layers that pay
    (``_fewer_layers``)."""
    return _fewer_layers(target, _climb_ladder(target, setup, wanted), wanted)


def _fewer_layers(target: _Target, fit: _Fit, wanted: int | None) -> _Fit:
    """``fit`` with full checkpointing replaced by every K-th layer's (K in
    ``PARTIAL_CKPT_EVERY``, only where the run can select layers: ``PARTIAL_CKPT_FRAMEWORKS``)
    or by none, where that fits ``wanted`` and the time model predicts it faster (at equal
    times, the fewest checkpointed layers). An option that needs more than
    ``MAX_QUIET_ACCUM`` micro-steps (and more than full checkpointing's) wins only when over
    ``TIME_TOLERANCE`` faster: hundreds of micro-steps at a micro-batch of 1 or 2 are where
    the time model is least tested."""
    if (
        GRAD_CKPT not in fit.techniques
        or fit.max_micro_batch < (wanted or 1)
        or not isinstance(target.model, ModelInfo)
    ):
        return fit
    layers = target.model.arch.num_layers

    def usable(micro: int) -> int:
        return target.timed_micro(micro, wanted)

    full_micro = usable(fit.max_micro_batch)
    full_accum = target.per_gpu // full_micro
    full_seconds = target.step_seconds(fit.setup, full_micro)
    # (checkpointed layers, seconds, micro-batch, alternative, many micro-steps, its name);
    # full checkpointing is the fallback
    options: list[tuple[int, float, int, Alternative | None, bool, str]] = [
        (layers, full_seconds, full_micro, None, False, "every layer")
    ]
    everies = [
        every
        for every in PARTIAL_CKPT_EVERY
        if layers // every >= 1 and fit.setup.framework in PARTIAL_CKPT_FRAMEWORKS
    ]
    for every in (*everies, None):  # None: no checkpointing (offload may have made room)
        if every is None:
            combo = tuple(t for t in fit.techniques if t is not GRAD_CKPT)
            setup = replace(fit.setup, grad_ckpt=False, grad_ckpt_every=None)
        else:
            tech = partial_ckpt(every, layers)
            combo = tuple(tech if t is GRAD_CKPT else t for t in fit.techniques)
            setup = tech(fit.setup)
        try:
            alt = target.alternative(combo, setup)
        except UsageError:
            continue
        if alt.max_micro_batch >= (wanted or 1):
            alt = target.confirmed(alt)  # the lines' answer is a what-if
        if alt.max_micro_batch < (wanted or 1):
            break  # fewer checkpointed layers hold more: a larger K fits less still
        alt = replace(alt, comm_bytes_per_step=target.comm(alt.setup))
        micro = usable(alt.max_micro_batch)
        many = target.per_gpu // micro > max(MAX_QUIET_ACCUM, full_accum)
        seconds = target.step_seconds(alt.setup, micro)
        name = f"every {ordinal(every)} layer" if every else "none"
        options.append((layers // every if every else 0, seconds, micro, alt, many, name))
    if len(options) == 1:
        return fit
    # the fastest, as _widest ranks: within the time model's resolution (TIME_TOLERANCE) of
    # it, the larger micro-batch, then the fewer checkpointed layers (1 x H100, 8B: every 2nd
    # layer at 8 x 64, 154 s, against every layer at 64 x 8, 149 s: every layer); an option
    # past MAX_QUIET_ACCUM micro-steps only when over TIME_TOLERANCE faster than the rest
    quiet = [o for o in options if not o[4]]
    fastest = min(o[1] for o in quiet)
    near = [o for o in quiet if o[1] <= fastest * (1 + TIME_TOLERANCE)]
    chosen = min(near, key=lambda o: (-o[2], o[0]))
    longest = min((o for o in options if o[4]), key=lambda o: (o[1], o[0]), default=None)
    if longest is not None and longest[1] < fastest * (1 - TIME_TOLERANCE):
        chosen = longest
    tried = ", ".join(f"{o[5]} {o[1]:.3g} s at {o[2]} x {target.per_gpu // o[2]}" for o in options)
    faster = [o for o in options if o[1] < chosen[1]]
    notes = fit.notes
    if chosen[3] is not None or faster:
        why = (
            f"; within {TIME_TOLERANCE:.0%} of the fastest the larger micro-batch is taken"
            if faster
            else ""
        )
        notes = (*notes, f"checkpointing tried as a dial: {tried}; taken: {chosen[5]}{why}")
    if chosen[3] is None:
        return replace(fit, notes=notes)
    alt = chosen[3]
    return _Fit(alt.setup, alt.techniques, alt.max_micro_batch, (*fit.alternatives, alt), notes)


def _climb_ladder(target: _Target, setup: TrainingSetup, wanted: int | None) -> _Fit:
    """Every rung of the ladder as an alternative; then the choice: on several GPUs the widest
    exact sharding option (``_widest``), else the first rung that fits ``wanted`` (or 1)."""
    base_max = target.max_micro(setup)
    model = target.model if isinstance(target.model, ModelInfo) else None  # None: your module
    checkpointing = model is not None and model.supports_grad_ckpt
    alternatives = []
    for combo in ladder(setup, target.gpu, model, checkpointing=checkpointing):
        try:
            alt = target.alternative(combo, apply(setup, combo))
        except UsageError:
            continue  # a rung this model cannot take (no module matches the LoRA targets)
        alternatives.append(replace(alt, comm_bytes_per_step=target.comm(alt.setup)))
    # one GPU: the plain setup is timed against the ladder's exact rungs too (fused AdamW,
    # or offload that lets checkpointing go) where the time model applies
    timed = setup.num_gpus > 1 or isinstance(target.model, ModelInfo)
    if timed and setup.sharding in ("none", "ddp"):
        base = Alternative((), setup, base_max, 0, target.engine, target.comm(setup))
        widest = _widest(target, base, alternatives, wanted)
        if widest is not None:
            return widest
    if base_max > 0 and (wanted is None or wanted <= base_max):
        return _Fit(setup, (), base_max, tuple(alternatives))
    # nothing fits without offload (or the time model does not apply): the fastest exact
    # rung that fits, then those that change training in the ladder's order
    fitting = [k for k, alt in enumerate(alternatives) if alt.max_micro_batch >= (wanted or 1)]
    exact = [k for k in fitting if all(t.kind == "exact" for t in alternatives[k].techniques)]

    def usable(k: int) -> int:
        return target.timed_micro(alternatives[k].max_micro_batch, wanted)

    seconds = {k: target.step_seconds(alternatives[k].setup, usable(k)) for k in exact}
    fastest = min(seconds.values(), default=0.0)
    # within the time model's resolution of the fastest, the simpler first (_simpler)
    near = [k for k in exact if seconds[k] <= fastest * (1 + TIME_TOLERANCE)]
    near.sort(key=lambda k: (*_simpler(alternatives[k], usable(k), setup.num_gpus), k))
    rest = sorted(set(exact) - set(near), key=lambda k: (seconds[k], k))
    for k in [*near, *rest, *sorted(set(fitting) - set(exact))]:
        alt = alternatives[k] = target.confirmed(alternatives[k])  # the lines' is a what-if
        if alt.max_micro_batch >= (wanted or 1):
            quickest = min(near, key=lambda j: seconds[j], default=k)
            notes: tuple[str, ...] = ()
            if k in seconds and seconds[k] > seconds[quickest] * (1 + TIE_NOTE_ABOVE):
                notes = (_tie_note(alternatives[quickest], seconds[quickest], alt, seconds[k]),)
            return _Fit(alt.setup, alt.techniques, alt.max_micro_batch, tuple(alternatives), notes)
    return _Fit(setup, (), base_max, tuple(alternatives))


# a faster option passed over within TIME_TOLERANCE is named when it is this much faster
TIE_NOTE_ABOVE = 0.02


def _tie_note(faster: Alternative, seconds: float, taken: Alternative, chosen: float) -> str:
    """Why an option predicted faster, within ``TIME_TOLERANCE``, was not taken."""

    def names(alt: Alternative) -> str:
        return " + ".join(t.name for t in alt.techniques) or "the setup as given"

    return (
        f"{names(faster)} is predicted at {seconds:.3g} s/step against {chosen:.3g} s/step "
        f"for {names(taken)}: within {TIME_TOLERANCE:.0%} (the time model's resolution) the "
        "simpler is taken: the parameters on the GPU, no recompute and the larger micro-batch "
        "(on several GPUs the larger micro-batch first), fewer techniques"
    )


def _simpler(alt: Alternative, micro: int, num_gpus: int) -> tuple[int, int, int, int]:
    """The order among options within ``TIME_TOLERANCE`` of the fastest, simplest first.

    Parameters left on the GPU first: offloaded, every micro-step waits on PCIe, the time
    model's least tested assumption (hidden behind compute). Then, on several GPUs, the larger
    micro-batch (fewer micro-steps, fewer collectives) before no recompute; on one GPU, where
    a micro-batch buys only what the time model already counts, no recompute first (BERT on a
    T4: plain 64 x 4, not checkpointing at 256 for the same time). Then the fewest techniques
    (plain DDP beats ZeRO-1 + a chunked loss by simplicity when both take the same time)."""
    size, recompute = -micro, int(alt.setup.grad_ckpt)
    first, second = (recompute, size) if num_gpus == 1 else (size, recompute)
    return (int(alt.setup.offload == "optimizer+params"), first, second, len(alt.techniques))


def _offloads(alt: Alternative) -> bool:
    return any(t.name in OFFLOADS for t in alt.techniques)


def _widest(
    target: _Target, base: Alternative, alternatives: list[Alternative], wanted: int | None
) -> _Fit | None:
    """The exact option (as asked, or with the ladder's fused AdamW, lean loss and
    checkpointing, and on several GPUs ZeRO-1/2/3 or FSDP2) that finishes an optimizer step
    soonest by the time model (``batchfit.speed``: compute at the largest micro-batch the
    per-GPU batch allows,
    recompute under checkpointing, the communication compute does not hide); where the time
    model does not apply, the largest micro-batch, then no recompute, then the fewest
    techniques, then the least communication (``speed/_comm.py``). Offload (a CPU step)
    competes, but wins only when predicted ``OFFLOAD_MARGIN`` faster than the best option
    without it (a faster one not chosen gets a note); rungs that change training only when
    none of these fits (None then)."""
    options = [base, *alternatives]
    eligible = {i for i, a in enumerate(options) if all(t.kind == "exact" for t in a.techniques)}

    def usable(i: int) -> int:
        return target.timed_micro(options[i].max_micro_batch, wanted)

    def tiebreak(i: int) -> tuple[int, ...]:
        # _simpler's order, then the least sent (the time model already counts what each
        # sends; at equal time the one that sends less)
        alt = options[i]
        return (*_simpler(alt, usable(i), options[0].setup.num_gpus), alt.comm_bytes_per_step, i)

    checked: set[int] = {0}  # the base's size is searched and confirmed already
    while eligible:
        fitting = [i for i in eligible if options[i].max_micro_batch >= (wanted or 1)]
        plain = [i for i in fitting if not _offloads(options[i])]
        if not plain:
            return None
        seconds = {i: target.step_seconds(options[i].setup, usable(i)) for i in fitting}
        fastest = min(seconds[i] for i in plain)
        offloaded = [i for i in fitting if _offloads(options[i])]
        quickest = min(offloaded, key=lambda i: seconds[i]) if offloaded else None
        notes: tuple[str, ...] = ()
        pool = plain
        if quickest is not None and seconds[quickest] > 0:
            if seconds[quickest] * (1 + OFFLOAD_MARGIN) < fastest:
                pool, fastest = fitting, seconds[quickest]
            elif seconds[quickest] < fastest:
                names = " + ".join(t.name for t in options[quickest].techniques)
                notes = (
                    f"{names} is predicted at {seconds[quickest]:.0f} s/step against "
                    f"{fastest:.0f} s/step for the plan's choice, but not chosen: CPU offload "
                    f"wins only when predicted over {OFFLOAD_MARGIN:.0%} faster (its CPU Adam "
                    "time depends on the host CPU, which batchfit does not know)",
                )
        # within the time model's resolution of the fastest, the simpler option
        near = [i for i in pool if seconds[i] <= fastest * (1 + TIME_TOLERANCE)]
        best = min(near, key=tiebreak)
        q = min(near, key=lambda i: seconds[i])
        if seconds[best] > seconds[q] * (1 + TIE_NOTE_ABOVE):
            notes = (*notes, _tie_note(options[q], seconds[q], options[best], seconds[best]))
        if best in checked:
            alt = options[best]
            shown = tuple(options[1:])
            return _Fit(alt.setup, alt.techniques, alt.max_micro_batch, shown, notes)
        options[best] = target.confirmed(options[best])  # the lines' answer is a what-if
        checked.add(best)
    return None


def _fit_warnings(gpu: GpuSpec, wanted: int | None, fit: _Fit) -> list[str]:
    best = fit.max_micro_batch
    if best == 0:
        return [
            f"nothing fits on {gpu.name}, with or without the techniques on the ladder: "
            "more GPUs (--num-gpus with --sharding zero3), a shorter --seq-len or a smaller "
            "model are needed; the figures show by how much it misses"
        ]
    if wanted is not None and wanted > best:
        names = ", ".join(t.name for t in fit.techniques)
        return [
            f"--micro-batch {wanted} does not fit even with the ladder's techniques; "
            f"{best} is the largest that fits" + (f" (with {names})" if names else "")
        ]
    return []


def _ckpt_warnings(setup: TrainingSetup, model: ModelInfo | OwnModel) -> list[str]:
    """How to checkpoint the layers a partial-checkpointing plan chose."""
    every = setup.grad_ckpt_every
    if every is None or not isinstance(model, ModelInfo):
        return []
    layers = model.arch.num_layers
    return [
        f"the plan checkpoints every {ordinal(every)} layer "
        f"({setup.checkpointed_layers(layers)} of {layers}: layers {every - 1}, "
        f"{2 * every - 1}, ...): wrap those layers with "
        f"torch.utils.checkpoint (torchtune: ac_mode selective, ac_option {every})"
    ]


def _has_batchnorm(model: ModelInfo | OwnModel) -> bool:
    if isinstance(model, OwnModel):
        return model.has_batchnorm()
    return any("batchnorm" in g.module.lower() for g in model.params)


def _advice_warnings(
    model: ModelInfo | OwnModel, gpu: GpuSpec, setup: TrainingSetup, micro: int, accum: int
) -> list[str]:
    warnings = []
    if accum > MAX_QUIET_ACCUM:
        warnings.append(
            f"{accum} accumulation steps: each optimizer step runs {accum} "
            "forward/backward passes; more GPUs would shorten it"
        )
    precision = setup.resolved(device="cuda", bf16_supported=gpu.bf16).precision
    if precision in ("fp16", "amp-fp16"):
        warnings.append(
            "fp16 needs a GradScaler (loss scaling); bf16 does not"
            + ("" if gpu.bf16 else f" but {gpu.name} has no bf16")
        )
    batchnorm = batchnorm_warning(micro)
    if batchnorm and _has_batchnorm(model):
        warnings.append(batchnorm)
    return warnings


def _loss_warnings(techniques: Combo, setup: TrainingSetup) -> list[str]:
    """How to switch on the lean loss the plan chose (not one the user or framework set)."""
    names = {t.name for t in techniques}
    if "chunked-loss" in names:
        return [
            f"the plan assumes a chunked loss ({setup.loss_label}): HF Trainer has no switch for "
            "it (torchtune's LinearCrossEntropyLoss or axolotl's chunked_cross_entropy: true do "
            "it; in a Trainer, override compute_loss); --loss full keeps the full loss"
        ]
    if "fused-loss" in names:
        return [
            "the plan assumes Liger's fused linear cross-entropy: pip install liger-kernel (the "
            "HF export sets use_liger_kernel); --loss full keeps the full loss"
        ]
    return []


def _lora_targets(model: ModelInfo | OwnModel, setup: TrainingSetup) -> tuple[str, ...]:
    if not setup.is_lora:
        return ()
    if isinstance(model, OwnModel):
        return setup.lora_targets or ()
    return setup.lora_targets or model.default_lora_targets()


def make_plan(
    model: ModelInfo | Callable[[], Any],
    gpu: GpuSpec,
    setup: TrainingSetup,
    *,
    seq_len: int | None = None,
    global_batch: int | None = None,
    global_batch_tokens: int | None = None,
    micro_batch_size: int | None = None,
    base_lr: float | None = None,
    base_batch: int | None = None,
    base_batch_tokens: int | None = None,
    base_betas: tuple[float, float] = DEFAULT_BETAS,
    base_eps: float = DEFAULT_EPS,
    critical_batch: int | None = None,
    critical_batch_tokens: int | None = None,
    headroom_bytes: int = DEFAULT_HEADROOM_BYTES,
    engine: str = "trace",
    train_tokens: int | None = None,
    train_samples: int | None = None,
    gpu_hour_price: float | None = None,
    throughput_from: ProbeFile | str | os.PathLike[str] | None = None,
    batch_fn: Callable[[int], Any] | None = None,
    loss_fn: Callable[[Any, Any], Any] | None = None,
) -> Plan:
    """Plan micro-batch, accumulation and techniques that hit the global batch exactly.

    Every figure comes from ``engine`` (``estimate`` with the same setup gives the same
    numbers); ``"trace"`` falls back to the formulas, and says so, when torch is missing.

    ``model`` is a resolved catalog/config model (with ``seq_len``), or a zero-argument
    factory of your own ``nn.Module`` with ``batch_fn(micro_batch_size)`` (the inputs of that
    many samples) and optionally ``loss_fn(out, batch)``: the plan then comes from dry runs of
    your step (``seq_len`` is needed only for a target in tokens). Techniques your module
    would have to apply itself (checkpointing, LoRA) are not on its ladder.

    ``throughput_from`` (``probe --json``'s file, for this model, setup, sequence length and
    GPU) corrects the step-time model by the measured steps (``plan/_throughput.py``); the
    cost is at ``gpu_hour_price``, else the catalog's price for the GPU (``plan/_prices.py``).

    Example:
        >>> from batchfit.models import resolve_model
        >>> from batchfit.hardware import get_gpu
        >>> p = make_plan(resolve_model("gpt2"), get_gpu("rtx-3060"), TrainingSetup(),
        ...               seq_len=256, global_batch_tokens=32768, micro_batch_size=16)
        >>> p.micro_batch_size, p.grad_accum_steps, p.tokens_per_step
        (16, 8, 32768)
    """
    target_model: ModelInfo | OwnModel
    if isinstance(model, ModelInfo):
        target_model = model
        if seq_len is None:
            raise UsageError("make_plan needs seq_len for a catalog or config model")
    else:
        target_model = own_model(model, batch_fn, loss_fn)
        if engine != "trace":
            raise UsageError(
                f"engine={engine!r} needs a catalog or config model; your own nn.Module is "
                "planned from dry runs (engine='trace')"
            )
        if global_batch_tokens is not None and seq_len is None:
            raise UsageError("global_batch_tokens needs seq_len (tokens per sample)")
    seq = seq_len or 0
    global_samples = samples_from_target(global_batch, global_batch_tokens, seq, setup.num_gpus)
    per_gpu = global_samples // setup.num_gpus
    train_steps = _train_steps(train_tokens, train_samples, global_samples, seq or 1)
    price = _hour_price(gpu_hour_price, gpu.name)
    if base_batch is not None and base_batch_tokens is not None:
        raise UsageError("give --base-batch (samples) or --base-batch-tokens (tokens), not both")
    base: tuple[float, str] | None = None
    if base_batch is not None:
        base = (base_batch, "samples")
    elif base_batch_tokens is not None:
        base = (base_batch_tokens, "tokens")
    _check_inputs(micro_batch_size, per_gpu, base_lr, base[0] if base else None)
    critical = lr_options(base_lr, base_betas, base_eps, critical_batch, critical_batch_tokens)
    measured, probe_note = bind(throughput_from, target_model, gpu, setup, seq)
    engine, engine_note = usable_engine(engine)
    target = _Target(target_model, gpu, seq, per_gpu, headroom_bytes, engine, measured)
    fit = _climb(target, setup, micro_batch_size)
    fit_warnings = _fit_warnings(gpu, micro_batch_size, fit)
    if setup.sharding != "none" and fit.setup.sharding != setup.sharding:
        fit_warnings.append(
            f"--sharding {setup.sharding} was replaced by {fit.setup.sharding}: the plan "
            f"found {setup.sharding} does not fit or is slower (the alternatives show both)"
        )
    micro = micro_batch_size or largest_divisor_at_most(per_gpu, max(fit.max_micro_batch, 1))
    accum = per_gpu // micro
    _, est = target.fits(fit.setup, micro)
    target_batch = (
        (global_batch_tokens, "tokens")
        if global_batch_tokens is not None
        else (global_samples, "samples")
    )
    lr_scaling, lr_warnings = follow_batch(
        base_lr,
        base,
        target_batch,
        seq,
        fit.setup.optimizer,
        base_betas=base_betas,
        base_eps=base_eps,
        critical=critical,
    )
    warnings = [
        *lr_warnings,
        *([engine_note] if engine_note else []),
        *([probe_note] if probe_note else []),
        *est.warnings,
        *fit_warnings,
        *_advice_warnings(target_model, gpu, fit.setup, micro, accum),
        *_loss_warnings(fit.techniques, fit.setup),
        *_ckpt_warnings(fit.setup, target_model),
        *_host_warnings(est, fit.setup.num_gpus),
        *_short_run_warnings(train_tokens, train_samples, global_samples, seq or 1),
        *fit.notes,
    ]
    return Plan(
        model=target_model.name,
        task=target_model.task,
        gpu=gpu.name,
        seq_len=seq,
        micro_batch_size=micro,
        grad_accum_steps=accum,
        num_gpus=setup.num_gpus,
        global_batch_size=global_samples,
        setup=est.setup,
        estimate=est,
        gpu_bytes=gpu.memory_bytes,
        headroom_bytes=gpu.memory_bytes - est.device_total_bytes,
        headroom_wanted_bytes=headroom_bytes,
        max_micro_batch=fit.max_micro_batch,
        learning_rate=lr_scaling.learning_rate if lr_scaling else None,
        lr_rule=lr_scaling.rule if lr_scaling else None,
        lr_scaling=lr_scaling,
        techniques=fit.techniques,
        alternatives=tuple(_timed(target, a) for a in fit.alternatives),
        warnings=tuple(dict.fromkeys(warnings)),
        lora_targets=_lora_targets(target_model, fit.setup),
        train_steps=train_steps,
        gpu_hour_price=price.usd if price else None,
        price_source=price.source if price else None,
        throughput=measured.correction(est.setup, micro) if measured else None,
    )


def make_plan_auto(
    model: ModelInfo,
    gpu: GpuSpec,
    setup: TrainingSetup,
    *,
    max_gpus: int = DEFAULT_MAX_GPUS,
    progress: Callable[[str], None] | None = None,
    **kwargs: Any,
) -> Plan:
    """``make_plan`` on 1, 2, 4, ... up to ``max_gpus`` GPUs, and the count to use.

    Each count is planned in full (``make_plan(..., setup with num_gpus=n, **kwargs)``); the
    plan returned is the most GPUs whose per-GPU throughput stays within
    ``AUTO_EFFICIENCY`` of the best count's, with every count in ``Plan.gpu_counts`` and the
    reason in ``Plan.gpu_count_rule`` (``plan/_gpu_count.py``).

    Example:
        >>> from batchfit.models import resolve_model
        >>> from batchfit.hardware import get_gpu
        >>> p = make_plan_auto(resolve_model("gpt2"), get_gpu("a100-80gb"), TrainingSetup(),
        ...                    max_gpus=4, seq_len=1024, global_batch=64, engine="analytic")
        >>> [c.num_gpus for c in p.gpu_counts], p.num_gpus in (1, 2, 4)
        ([1, 2, 4], True)
    """
    if setup.num_gpus != 1:
        raise UsageError("--num-gpus auto chooses the count: give it without a number")
    return choose(
        lambda n: make_plan(model, gpu, replace(setup, num_gpus=n), **kwargs),
        max_gpus,
        progress,
    )


def _timed(target: _Target, alt: Alternative) -> Alternative:
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


# host RAM for offloaded state worth a line of its own (the breakdown table shows any)
HOST_RAM_WARNING_BYTES = 32 * 2**30


def _host_warnings(est: MemoryEstimate, num_gpus: int) -> list[str]:
    """The host RAM an offloading plan needs, when it is more than many machines have."""
    if est.host_bytes < HOST_RAM_WARNING_BYTES:
        return []
    each = human_bytes(est.host_bytes)
    total = f" ({human_bytes(est.host_bytes * num_gpus)} for {num_gpus} GPUs on one machine)"
    return [
        f"the offloaded state needs {each} of host RAM per GPU process"
        + (total if num_gpus > 1 else "")
        + ", besides the data loader's: check `free -g` on the training machine"
    ]


def _short_run_warnings(
    tokens: int | None, samples: int | None, global_samples: int, seq_len: int
) -> list[str]:
    """A run shorter than one global batch (its one step is a whole batch)."""
    batch_tokens = global_samples * seq_len
    if tokens is not None and tokens < batch_tokens:
        return [
            f"--train-tokens {tokens:,} is less than one global batch ({batch_tokens:,} "
            "tokens): the run is 1 optimizer step of a whole batch"
        ]
    if samples is not None and samples < global_samples:
        return [
            f"--epochs x --dataset-size gives {samples:,} samples, less than one global batch "
            f"({global_samples:,}): the run is 1 optimizer step of a whole batch"
        ]
    return []


def _train_steps(
    tokens: int | None, samples: int | None, global_samples: int, seq_len: int
) -> int | None:
    """Optimizer steps of the run: ``tokens`` (or ``samples``) over the global batch."""
    for name, value in (("--train-tokens", tokens), ("--epochs x --dataset-size", samples)):
        if value is not None and (isinstance(value, bool) or value < 1):
            raise UsageError(f"{name} must be a positive number, got {value}")
    if tokens is not None and samples is not None:
        raise UsageError("give --train-tokens or --epochs with --dataset-size, not both")
    if tokens is not None:
        return -(-tokens // (global_samples * seq_len))
    if samples is not None:
        return -(-samples // global_samples)
    return None
