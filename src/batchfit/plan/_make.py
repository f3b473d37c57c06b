"""``make_plan``: a ``PlanRequest`` planned in steps: the headroom and GPU count it asks for,
the ladder's choice (``_choice.py``), the micro-batch and accumulation, the LR, the warnings,
and the ``Plan`` value."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace
from typing import Any, overload

from batchfit import calibration
from batchfit._units import gib
from batchfit.hardware import GpuSpec
from batchfit.memory.estimate import interpolated_sizes, usable_engine
from batchfit.memory.types import MemoryEstimate
from batchfit.models import ModelInfo
from batchfit.plan._choice import _climb
from batchfit.plan._divisors import largest_divisor_at_most
from batchfit.plan._gpu_count import DEFAULT_MAX_GPUS, choose
from batchfit.plan._limits import check_accumulation, check_run_length
from batchfit.plan._lr_scaling import follow_batch
from batchfit.plan._own import OwnModel
from batchfit.plan._target import _Fit, _Target, timed
from batchfit.plan._throughput import ProbeFile, bind
from batchfit.plan._value import Plan
from batchfit.plan._warnings import (
    advice_warnings,
    ckpt_warnings,
    fit_warnings,
    host_warnings,
    loss_warnings,
    short_run_warnings,
)
from batchfit.plan.request import PlanRequest
from batchfit.spec import TrainingSetup


@overload
def make_plan(
    request: PlanRequest,
    /,
    *,
    progress: Callable[[str], None] | None = None,
    warn: Callable[[str], None] | None = None,
) -> Plan: ...


@overload
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
    base_betas: tuple[float, float] = ...,
    base_eps: float = ...,
    critical_batch: int | None = None,
    critical_batch_tokens: int | None = None,
    headroom_bytes: int | str = ...,
    engine: str = "trace",
    train_tokens: int | None = None,
    train_samples: int | None = None,
    gpu_hour_price: float | None = None,
    throughput_from: ProbeFile | str | os.PathLike[str] | None = None,
    batch_fn: Callable[[int], Any] | None = None,
    loss_fn: Callable[[Any, Any], Any] | None = None,
) -> Plan: ...


def make_plan(
    model: PlanRequest | ModelInfo | Callable[[], Any],
    gpu: GpuSpec | None = None,
    setup: TrainingSetup | None = None,
    *,
    progress: Callable[[str], None] | None = None,
    warn: Callable[[str], None] | None = None,
    **options: Any,
) -> Plan:
    """Plan micro-batch, accumulation and techniques that hit the global batch exactly.

    Give a ``PlanRequest`` (validated when built), or its fields as keywords after the model,
    GPU and setup: ``make_plan(model, gpu, setup, seq_len=..., global_batch=...)`` builds the
    request. Every figure comes from ``request.engine`` (``estimate`` with the same setup gives
    the same numbers); ``"trace"`` falls back to the formulas, and says so, when torch is
    missing.

    ``model`` is a resolved catalog/config model (with ``seq_len``), or a zero-argument
    factory of your own ``nn.Module`` with ``batch_fn(micro_batch_size)`` (the inputs of that
    many samples) and optionally ``loss_fn(out, batch)``: the plan then comes from dry runs of
    your step (``seq_len`` is needed only for a target in tokens). Techniques your module
    would have to apply itself (checkpointing, LoRA) are not on its ladder. For an image
    model the keyword ``seq_len`` is the image side in pixels (the request's ``image_size``).

    ``throughput_from`` (``probe --json``'s file, for this model, setup, sequence length and
    GPU) corrects the step-time model by the measured steps (``plan/_throughput.py``); the
    cost is at ``gpu_hour_price``, else the catalog's price for the GPU (``plan/_prices.py``).

    With ``num_gpus="auto"`` each count is planned in full (``make_plan_auto``), ``progress``
    told of each; with ``headroom_bytes="auto"`` (any case) the calibration records are read
    (``warn(message)`` for a file it had to set aside, else a ``UserWarning``) and the plan's
    first warning says what they gave.

    Example (by the formulas, which answer at once; the default engine traces the step):
        >>> from batchfit.models import resolve_model
        >>> from batchfit.hardware import get_gpu
        >>> p = make_plan(resolve_model("gpt2"), get_gpu("rtx-3060"), TrainingSetup(),
        ...               seq_len=256, global_batch_tokens=32768, micro_batch_size=16,
        ...               engine="analytic")
        >>> p.micro_batch_size, p.grad_accum_steps, p.tokens_per_step
        (16, 8, 32768)
        >>> r = PlanRequest(resolve_model("gpt2"), get_gpu("rtx-3060"), seq_len=256,
        ...                 global_batch_tokens=32768, engine="analytic")
        >>> make_plan(r).tokens_per_step
        32768
    """
    if isinstance(model, PlanRequest):
        if gpu is not None or setup is not None or options:
            raise TypeError("make_plan(request) takes the request alone: its fields say the rest")
        request = model
    else:
        request = _from_keywords(model, gpu, setup, options)
    # the calibration records, read once for the headroom and the learned time
    wants_time = request.learned_time and request.throughput_from is None
    records = calibration.load(warn=warn) if request.headroom_auto or wants_time else []
    request, headroom_note = _with_headroom(request, records)
    learned = _learned_time(request, records) if wants_time else None
    if request.num_gpus == "auto":
        plan = choose(
            lambda n: _plan(replace(request, num_gpus=n, max_gpus=None), learned),
            DEFAULT_MAX_GPUS if request.max_gpus is None else request.max_gpus,
            progress,
        )
    else:
        plan = _plan(request, learned)
    if headroom_note is None:
        return plan
    return replace(plan, warnings=(headroom_note, *plan.warnings))


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
    reason in ``Plan.gpu_count_rule`` (``plan/_gpu_count.py``). The same as a ``PlanRequest``
    with ``num_gpus="auto"``.

    Example:
        >>> from batchfit.models import resolve_model
        >>> from batchfit.hardware import get_gpu
        >>> p = make_plan_auto(resolve_model("gpt2"), get_gpu("a100-80gb"), TrainingSetup(),
        ...                    max_gpus=4, seq_len=1024, global_batch=64, engine="analytic")
        >>> [c.num_gpus for c in p.gpu_counts], p.num_gpus in (1, 2, 4)
        ([1, 2, 4], True)
    """
    options = {**kwargs, "num_gpus": "auto", "max_gpus": max_gpus}
    return make_plan(_from_keywords(model, gpu, setup, options), progress=progress)


def _from_keywords(
    model: ModelInfo | Callable[[], Any],
    gpu: GpuSpec | None,
    setup: TrainingSetup | None,
    options: dict[str, Any],
) -> PlanRequest:
    """The request of the keyword form; its ``seq_len`` is an image model's side in pixels."""
    if isinstance(model, ModelInfo) and model.task == "image-classification":
        side = options.pop("seq_len", None)
        if side is not None:
            options["image_size"] = side
    return PlanRequest(model, gpu, setup, **options)  # type: ignore[arg-type]


def _with_headroom(
    request: PlanRequest, records: list[calibration.Record]
) -> tuple[PlanRequest, str | None]:
    """``headroom_bytes="auto"`` resolved from the calibration records, and the note that says
    how; the request as it is otherwise."""
    if not request.headroom_auto:
        return request, None
    gpu = request.gpu
    auto = calibration.auto_headroom(records, gpu.name)
    headroom_bytes = int(auto.fraction * gpu.memory_bytes)
    note = (
        f"--headroom auto: {auto.fraction:.1%} of {gib(gpu.memory_bytes)} = "
        f"{gib(headroom_bytes)} ({auto.why})"
    )
    return replace(request, headroom_bytes=headroom_bytes), note


def _learned_time(
    request: PlanRequest, records: list[calibration.Record]
) -> calibration.TimeFactor | None:
    """``learned_time``: what the runs recorded on the request's GPU measured against the time
    model (``calibration.time_factor``); None without a timed record on that GPU. Not asked
    with ``throughput_from``: a probe's file corrects the time instead."""
    model = request.model
    name = model.name if isinstance(model, ModelInfo) else getattr(model, "__name__", "")
    return calibration.time_factor(records, request.gpu.name, name)


def _plan(request: PlanRequest, learned: calibration.TimeFactor | None = None) -> Plan:
    """One plan on the request's GPU count: the ladder's choice, the micro-batch that divides
    the per-GPU batch, its estimate, the LR, the warnings."""
    headroom = request.headroom_wanted_bytes
    assert headroom is not None  # "auto" is resolved by make_plan
    setup, model, gpu = request.run_setup, request.target_model, request.gpu
    seq = request.sample_size
    measured, probe_note = bind(request.throughput_from, model, gpu, setup, seq)
    engine, engine_note = usable_engine(request.engine)
    per_gpu = request.per_gpu_samples
    target = _Target(
        model,
        gpu,
        seq,
        per_gpu,
        headroom,
        engine,
        measured,
        request.alternatives,
        lengths=request.lengths,
        time_factor=learned.factor if learned else 1.0,
    )
    # sizes between traced ones from their histories (exact where they line up), the plan's
    # own figure included; the chosen setup's largest micro-batch and the size after it are
    # traced (``traced_fit``)
    with interpolated_sizes():
        fit = _climb(target, setup, request.micro_batch_size)
        micro = request.micro_batch_size or largest_divisor_at_most(
            per_gpu, max(fit.max_micro_batch, 1)
        )
        check_accumulation(request.global_samples, per_gpu // micro, micro)
        _, est = target.fits(fit.setup, micro)
    notes = [note for note in (engine_note, probe_note) if note]
    if learned is not None:
        est = replace(est, extras={**est.extras, "time_factor": learned.to_json()})
    plan = _assemble(request, target, fit, micro, est, notes)
    plan = replace(plan, learned_time=learned, lengths=request.lengths)
    check_run_length(plan.train_steps, plan.step_seconds, plan.num_gpus)
    return plan


def _assemble(
    request: PlanRequest,
    target: _Target,
    fit: _Fit,
    micro: int,
    est: MemoryEstimate,
    notes: list[str],
) -> Plan:
    """The ``Plan`` value: the choice at ``micro``, its LR and its warnings."""
    gpu, model = request.gpu, target.model
    accum = target.per_gpu // micro
    lr_scaling, lr_warnings = follow_batch(
        request.base_lr,
        request.base,
        request.target_batch,
        target.seq_len,
        fit.setup.optimizer,
        base_betas=request.base_betas,
        base_eps=request.base_eps,
        critical=request.critical,
    )
    warnings = [*lr_warnings, *notes, *_warnings(request, target, fit, micro, est)]
    price, measured = request.price, target.measured
    return Plan(
        model=model.name,
        task=model.task,
        gpu=gpu.name,
        seq_len=target.seq_len,
        micro_batch_size=micro,
        grad_accum_steps=accum,
        num_gpus=request.run_setup.num_gpus,
        global_batch_size=request.global_samples,
        setup=est.setup,
        estimate=est,
        gpu_bytes=gpu.memory_bytes,
        headroom_bytes=gpu.memory_bytes - est.device_total_bytes,
        headroom_wanted_bytes=target.headroom,
        max_micro_batch=fit.max_micro_batch,
        learning_rate=lr_scaling.learning_rate if lr_scaling else None,
        lr_rule=lr_scaling.rule if lr_scaling else None,
        lr_scaling=lr_scaling,
        techniques=fit.techniques,
        alternatives=tuple(timed(target, a) for a in fit.alternatives),
        warnings=tuple(dict.fromkeys(warnings)),
        lora_targets=_lora_targets(model, fit.setup),
        train_steps=request.train_steps,
        gpu_hour_price=price.usd if price else None,
        price_source=price.source if price else None,
        throughput=measured.correction(est.setup, micro) if measured else None,
    )


def _warnings(
    request: PlanRequest, target: _Target, fit: _Fit, micro: int, est: MemoryEstimate
) -> list[str]:
    """The plan's warnings after the LR's and the engine's, in the order they are shown."""
    asked, model, gpu = request.run_setup, target.model, request.gpu
    fitting = fit_warnings(gpu, request.micro_batch_size, fit)
    if asked.sharding != "none" and fit.setup.sharding != asked.sharding:
        fitting.append(
            f"--sharding {asked.sharding} was replaced by {fit.setup.sharding}: the plan "
            f"found {asked.sharding} does not fit or is slower (the alternatives show both)"
        )
    seq = target.seq_len or 1
    return [
        *est.warnings,
        *fitting,
        *advice_warnings(model, gpu, fit.setup, micro, target.per_gpu // micro),
        *loss_warnings(fit.techniques, fit.setup),
        *ckpt_warnings(fit.setup, model),
        *host_warnings(est, fit.setup.num_gpus),
        *short_run_warnings(request.train_tokens, request.run_samples, request.global_samples, seq),
        *fit.notes,
    ]


def _lora_targets(model: ModelInfo | OwnModel, setup: TrainingSetup) -> tuple[str, ...]:
    if not setup.is_lora:
        return ()
    if isinstance(model, OwnModel):
        return setup.lora_targets or ()
    return model.lora_target_names(setup.lora_targets)
