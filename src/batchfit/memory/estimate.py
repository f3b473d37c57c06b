"""``estimate()``: one entry point over the engines, with input checks shared by all of them."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, replace
from typing import Any, Literal, get_args

from batchfit._batchnorm import batchnorm_warning
from batchfit.errors import UsageError
from batchfit.hardware import GpuSpec, host_cpu
from batchfit.memory.formulas.analytic import estimate_analytic
from batchfit.memory.trace import sized
from batchfit.memory.trace.estimate import estimate_trace
from batchfit.memory.types import MemoryEstimate
from batchfit.models import ModelInfo
from batchfit.spec import TrainingSetup
from batchfit.speed import counted_step_time, step_time
from batchfit.workload import Workload

Engine = Literal["analytic", "trace"]
ENGINES: tuple[str, ...] = get_args(Engine)


def usable_engine(engine: str) -> tuple[str, str | None]:
    """``engine``, or the analytic one when the trace engine cannot run here, with why.

    Checked without importing torch (``importlib.util.find_spec``).
    """
    if engine == "trace" and importlib.util.find_spec("torch") is None:
        return "analytic", (
            "torch is not installed: the analytic engine answered (formulas); install torch "
            "for the trace engine, a dry run of the real step"
        )
    return engine, None


@contextmanager
def interpolated_sizes(allowed: bool = True) -> Iterator[None]:
    """Within it, the trace engine may answer a micro-batch size from the allocation
    histories of two other sizes of the same setup traced in this process, where they line up
    event for event (``batchfit.memory.trace.sized``), instead of a dry run at that size;
    ``allowed=False``: every size is traced (a plan's confirmations)."""
    token = sized.enabled.set(allowed)
    try:
        yield
    finally:
        sized.enabled.reset(token)


# 2**40 tokens in one micro-batch: petabytes of activations, far past any device, and below
# where a dry run's tensor sizes (tokens x vocabulary x 4 bytes) overflow a 64-bit count.
MAX_TOKENS_PER_MICRO_BATCH = 2**40


def check_workload(model: ModelInfo, micro_batch_size: int, seq_len: int) -> list[str]:
    """Validate batch and sequence against the model; return warnings.

    Raises:
        UsageError: non-positive sizes, or a sequence beyond learned position embeddings.
    """
    if not isinstance(micro_batch_size, int) or micro_batch_size < 1:
        raise UsageError(f"--micro-batch must be a positive integer, got {micro_batch_size!r}")
    if model.arch.family == "vision":
        found = _check_images(model, micro_batch_size, seq_len)
        batchnorm = batchnorm_warning(micro_batch_size)
        if batchnorm and any("BatchNorm" in g.module for g in model.params):
            found.append(batchnorm)
        return found
    if not isinstance(seq_len, int) or seq_len < 1:
        raise UsageError(f"--seq-len must be a positive integer, got {seq_len!r}")
    if micro_batch_size * seq_len > MAX_TOKENS_PER_MICRO_BATCH:
        raise UsageError(
            f"--micro-batch {micro_batch_size} x --seq-len {seq_len} is "
            f"{micro_batch_size * seq_len:,} tokens in one micro-batch, beyond any device "
            f"(at most {MAX_TOKENS_PER_MICRO_BATCH:,}): give real sizes"
        )
    limit = model.arch.max_positions
    if limit is not None and seq_len > limit:
        if model.arch.positional == "learned":
            raise UsageError(
                f"--seq-len {seq_len} is longer than {model.name}'s {limit} learned positions: "
                f"use --seq-len {limit} or less"
            )
        return [
            f"--seq-len {seq_len} exceeds {model.name}'s {limit} trained positions: "
            "rope scaling must extend them"
        ]
    return []


# 2**40 pixel values in one micro-batch, for the same reason.
MAX_PIXELS_PER_MICRO_BATCH = 2**40


# Convolutional backbones whose stem and stages shrink the image 32-fold (ResNet: stride-2 stem,
# max-pool and three stride-2 stages; ConvNeXt: a 4-pixel patchify stem and three 2x downsamples;
# Swin: 4-pixel patches and three patch mergings): below 32 pixels a kernel outgrows its input.
DOWNSAMPLING_TYPES = frozenset({"resnet", "convnext", "convnextv2", "swin", "torchvision"})
MIN_CONV_IMAGE_PIXELS = 32


def _check_images(model: ModelInfo, micro_batch_size: int, image_size: int) -> list[str]:
    """An image model's per-sample size is the image side in pixels (``--image-size``)."""
    if isinstance(image_size, bool) or not isinstance(image_size, int) or image_size < 1:
        raise UsageError(f"--image-size must be a positive number of pixels, got {image_size!r}")
    patch = model.arch.patch_size
    if image_size < patch:
        raise UsageError(
            f"--image-size {image_size} is smaller than {model.name}'s {patch}-pixel patches"
        )
    if model.arch.model_type in DOWNSAMPLING_TYPES and image_size < MIN_CONV_IMAGE_PIXELS:
        raise UsageError(
            f"--image-size {image_size} is smaller than {model.name}'s downsampling: its stages "
            f"halve the image down to 1/{MIN_CONV_IMAGE_PIXELS}; use at least "
            f"{MIN_CONV_IMAGE_PIXELS} pixels"
        )
    pixels = micro_batch_size * model.arch.num_channels * image_size**2
    if pixels > MAX_PIXELS_PER_MICRO_BATCH:
        raise UsageError(
            f"--micro-batch {micro_batch_size} x --image-size {image_size} is {pixels:,} pixel "
            "values in one micro-batch, beyond any device: give real sizes"
        )
    if model.arch.positional == "patch" and image_size != model.arch.image_size:
        return [
            f"--image-size {image_size}: {model.name} was trained at {model.arch.image_size} px; "
            "its position table is resized (interpolated) for the new patch grid"
        ]
    return []


def estimate(
    model: ModelInfo | Callable[[], Any],
    setup: TrainingSetup | None = None,
    *,
    micro_batch_size: int | None = None,
    seq_len: int | None = None,
    batch_fn: Callable[[], Any] | None = None,
    loss_fn: Callable[[Any, Any], Any] | None = None,
    device: Literal["cpu", "cuda"] = "cuda",
    gpu: GpuSpec | None = None,
    engine: Engine = "trace",
    grad_accum_steps: int = 1,
    workload: Workload | None = None,
) -> MemoryEstimate:
    """Memory of one training step, per GPU (or on the CPU).

    ``model`` is a resolved catalog/config model (:func:`batchfit.resolve_model`), with
    ``micro_batch_size`` and ``seq_len`` (and ``device``, ``gpu``, ``grad_accum_steps``), or all
    of them as one ``workload`` (:class:`batchfit.Workload`); or a zero-argument factory of your
    own ``nn.Module``, with ``batch_fn`` (returns the inputs: a dict of keyword arguments, a tuple,
    or a tensor) and ``loss_fn(out, batch)`` (default: ``out.loss`` or a scalar output). The
    factory runs on the meta device and the step on fake tensors: no memory, no GPU.
    ``engine="trace"`` (the default) dry-runs the real step; ``"analytic"`` uses formulas.

    Example:
        >>> from batchfit.models import resolve_model
        >>> est = estimate(resolve_model("gpt2"), TrainingSetup(), micro_batch_size=4,
        ...                seq_len=256, device="cpu", engine="analytic")
        >>> est.engine, est.peak_bytes > est.components["weights"]
        ('analytic', True)
        >>> same = estimate(resolve_model("gpt2"), TrainingSetup(), engine="analytic",
        ...                 workload=Workload(micro_batch_size=4, seq_len=256, device="cpu"))
        >>> same.peak_bytes == est.peak_bytes
        True
        >>> import torch
        >>> def make_net():
        ...     return torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(),
        ...                                torch.nn.Linear(4096, 1024))
        >>> est = estimate(make_net, TrainingSetup(optimizer="adamw"), device="cpu",
        ...                batch_fn=lambda: torch.randn(64, 1024),
        ...                loss_fn=lambda out, batch: out.square().mean())
        >>> est.trainable_params, est.components["optimizer_state"] >= 8 * est.trainable_params
        (8393728, True)

    Raises:
        UsageError: an unknown ``engine``, a missing ``batch_fn`` or workload, a ``workload``
            beside the keywords it holds, bad sizes.
        TypeError: ``model`` is a factory that does not return an ``nn.Module``.
    """
    if engine not in ENGINES:
        raise UsageError(f"--engine {engine!r} is not one of: {', '.join(ENGINES)}")
    setup = setup or TrainingSetup()
    if not isinstance(model, ModelInfo):
        if workload is not None:
            raise UsageError(
                "estimate(model_fn, ...) reads your module's sizes from batch_fn: give device=, "
                "gpu= and grad_accum_steps= in place of workload="
            )
        return _estimate_own_module(
            model,
            setup,
            batch_fn=batch_fn,
            loss_fn=loss_fn,
            device=device,
            gpu=gpu,
            engine=engine,
            grad_accum_steps=grad_accum_steps,
        )
    if workload is None:
        if micro_batch_size is None or seq_len is None:
            raise UsageError("give micro_batch_size and seq_len for a resolved model")
        # the model's checks first: an image model's size is --image-size, and says so
        warnings = _workload_warnings(model, setup, micro_batch_size, seq_len)
        workload = Workload(micro_batch_size, seq_len, device, gpu, grad_accum_steps)
    else:
        _check_alone(workload, micro_batch_size, seq_len, device, gpu, grad_accum_steps)
        warnings = _workload_warnings(model, setup, workload.micro_batch_size, workload.seq_len)
    return _estimate_model(model, setup, workload, engine, warnings)


def _estimate_model(
    model: ModelInfo, setup: TrainingSetup, workload: Workload, engine: str, warnings: list[str]
) -> MemoryEstimate:
    """``estimate`` of a resolved model: the engine's answer, its warnings, the step time."""
    usable, engine_note = usable_engine(engine)
    if engine_note:
        warnings.insert(0, engine_note)
    result = _run_engine(usable, model, setup, workload)
    result = _with_warnings(result, model, setup, warnings)
    return _with_step_time(result, model, workload)


def _check_alone(
    workload: object,
    micro_batch_size: int | None,
    seq_len: int | None,
    device: str,
    gpu: GpuSpec | None,
    grad_accum_steps: int,
) -> None:
    """``workload`` is a Workload and no keyword it holds was given beside it."""
    if not isinstance(workload, Workload):
        raise UsageError(f"workload= takes a batchfit.Workload, got {type(workload).__name__}")
    beside = (micro_batch_size, seq_len, gpu) != (None, None, None)
    if beside or device != "cuda" or grad_accum_steps != 1:
        raise UsageError(
            "workload= holds micro_batch_size, seq_len, device, gpu and grad_accum_steps: "
            "give it alone, or those keywords without it"
        )


def _run_engine(
    engine: str, model: ModelInfo, setup: TrainingSetup, workload: Workload
) -> MemoryEstimate:
    """The estimate of ``engine`` (one that can run here), which must model ``model``."""
    if engine == "analytic" and model.arch.family == "vision":
        raise UsageError(
            f"--engine analytic: the formulas model token models; {model.name} is an image "
            "model, estimated by the trace (--engine trace, the default)"
        )
    if engine == "trace":
        return estimate_trace(model, setup, workload)
    return estimate_analytic(model, setup, workload)


def _with_warnings(
    result: MemoryEstimate, model: ModelInfo, setup: TrainingSetup, warnings: list[str]
) -> MemoryEstimate:
    """``result`` with ``warnings`` (about the workload and the engine) first, and LoRA's
    guessed targets where the engine did not say so."""
    guessed = model.guessed_targets_warning(setup.lora_targets) if setup.is_lora else None
    if guessed and guessed not in result.warnings:  # the formulas say it; the trace does not
        warnings.append(guessed)
    if warnings:
        result = replace(result, warnings=(*warnings, *result.warnings))
    return result


def _estimate_own_module(
    model: Callable[[], Any],
    setup: TrainingSetup,
    *,
    batch_fn: Callable[[], Any] | None,
    loss_fn: Callable[[Any, Any], Any] | None,
    device: Literal["cpu", "cuda"],
    gpu: GpuSpec | None,
    engine: Engine,
    grad_accum_steps: int,
) -> MemoryEstimate:
    """``estimate`` of the user's own ``nn.Module`` factory: the trace engine only."""
    if not callable(model) or batch_fn is None:
        raise UsageError(
            "estimate(model_fn, setup, batch_fn=...): give a factory of your "
            "nn.Module and a batch_fn, or a model from resolve_model()"
        )
    if engine != "trace":
        raise UsageError(
            f"engine={engine!r} needs a catalog or config model (its formulas read the "
            "architecture); an own nn.Module is estimated by engine='trace'"
        )
    # lazy: the module engine imports torch (~1 s), which the formulas never need
    from batchfit.memory.trace.module import estimate_module

    result = estimate_module(
        model,
        setup,
        batch_fn=batch_fn,
        loss_fn=loss_fn,
        device=device,
        gpu=gpu,
        grad_accum_steps=grad_accum_steps,
    )
    counted = result.counted
    if device != "cuda" or gpu is None or counted is None:
        return result
    predicted = counted_step_time(
        counted, result.setup, gpu, result.micro_batch_size, result.trainable_params
    )
    if predicted is None:
        return result
    speed = {"speed": asdict(predicted), "grad_accum_steps": grad_accum_steps}
    return replace(result, extras={**result.extras, **speed})


def _workload_warnings(
    model: ModelInfo, setup: TrainingSetup, micro_batch_size: int, seq_len: int
) -> list[str]:
    """``check_workload``'s warnings, and a checkpoint interval past the model's depth."""
    warnings = check_workload(model, micro_batch_size, seq_len)
    every, depth = setup.grad_ckpt_every, model.arch.num_layers
    if every and every > depth:
        warnings.append(
            f"--grad-ckpt-every {every} checkpoints no layer of {model.name}'s {depth}: "
            f"give at most {depth}, or drop --grad-ckpt"
        )
    return warnings


def _with_step_time(result: MemoryEstimate, model: ModelInfo, workload: Workload) -> MemoryEstimate:
    """``result`` with the predicted step time (``batchfit.speed``) in its extras, on a GPU,
    or on the CPU where this machine's CPU has a catalog profile."""
    hardware = workload.gpu if workload.device == "cuda" else host_cpu()
    if hardware is None:
        return result

    predicted = step_time(
        model, result.setup, hardware, workload=workload, flops_per_sample=result.counted
    )
    if predicted is None:
        return result
    # the optimizer step's time counts every micro-step of it (--grad-accum)
    speed = {"speed": asdict(predicted), "grad_accum_steps": workload.grad_accum_steps}
    return replace(result, extras={**result.extras, **speed})
