"""Trace a Hugging Face model built from its config: setup applied, fake inputs, extrapolation."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal, cast

import torch
from torch._subclasses import fake_tensor

from batchfit._units import BYTES_IN_MIB
from batchfit.errors import UsageError
from batchfit.hardware import GpuSpec
from batchfit.memory import analytic, trace
from batchfit.memory._activations import EAGER_ONLY_TYPES
from batchfit.memory._device import (
    CUBLAS_HANDLES,
    DeviceTotals,
    StepMemory,
    assemble,
    device_totals,
    gpu_extras,
)
from batchfit.memory._optim import make_optimizer
from batchfit.memory.types import Line, MemoryEstimate
from batchfit.models import ModelInfo
from batchfit.spec import TrainingSetup

# What a dry run cannot do, as opposed to a bug: FakeTensor's operators without a fake kernel
# and its data-dependent outputs (``.item()``, ``nonzero``), operators without a meta kernel
# (NotImplementedError from the dispatcher), and transformers' refusals of a config, an attention
# implementation or checkpointing (ValueError, modeling_utils.py). Anything else is raised.
TRACE_LIMITS: tuple[type[Exception], ...] = (
    fake_tensor.UnsupportedOperatorException,
    fake_tensor.UnsupportedFakeTensorException,
    fake_tensor.DynamicOutputShapeException,
    fake_tensor.DataDependentOutputException,
    NotImplementedError,
    ValueError,
)


def _is_trace_limit(exc: BaseException) -> bool:
    """Whether ``exc`` says the dry run cannot model this step (not a bug to raise)."""
    if isinstance(exc, TRACE_LIMITS):
        return True
    # A model whose __init__ reads a value (``.item()``) while it is built on the meta device:
    # aten raises a plain RuntimeError, "Tensor.item() cannot be called on meta tensors".
    return isinstance(exc, RuntimeError) and "on meta tensors" in str(exc)


# Depths traced for a homogeneous stack, then extrapolated per layer; stacks whose layers
# alternate (Gemma-2: sliding-window / global) are traced at even depths so types pair up.
DEPTHS = (1, 2)
ALTERNATING_DEPTHS = (2, 4)


def trace_depths(model: ModelInfo) -> tuple[int, int]:
    """The two depths to trace ``model`` at before extrapolating."""
    layer_types = model.config.get("layer_types")
    alternating = model.arch.model_type in ("gemma2", "gemma3_text") or (
        isinstance(layer_types, list) and len(set(layer_types)) > 1
    )
    return ALTERNATING_DEPTHS if alternating else DEPTHS


def unsupported(model: ModelInfo, setup: TrainingSetup) -> str | None:
    """Why the trace cannot model this setup yet (then the analytic engine answers)."""
    if setup.method == "qlora":
        return "QLoRA needs bitsandbytes' 4-bit layers"
    if model.arch.num_experts:
        return "MoE routing has data-dependent shapes"
    if setup.precision == "fp16":
        return "fp16 with an fp32 master copy is DeepSpeed's optimizer wrapper"
    if setup.sharding not in ("none", "ddp") or setup.offload != "none":
        return f"--sharding {setup.sharding} / --offload {setup.offload}"
    if setup.num_gpus > 1:
        return "several GPUs"
    return None


def _config(model: ModelInfo, depth: int | None) -> Any:
    from batchfit.models import _meta

    cfg = _meta.make_config(model.config, model.task)
    if depth is not None:
        if model.arch.family == "encoder-decoder":
            cfg.num_layers = depth
            cfg.num_decoder_layers = depth
        else:
            cfg.num_hidden_layers = depth
        layer_types = getattr(cfg, "layer_types", None)
        if isinstance(layer_types, list):
            cfg.layer_types = layer_types[:depth]
    return cfg


def _attn_impl(model: ModelInfo, attention: str) -> str:
    if attention in ("sdpa", "flash"):
        # On fake CPU tensors SDPA takes the CPU flash kernel, which keeps what CUDA's flash
        # kernel keeps: the output and an fp32 log-sum-exp per head (DESIGN.md).
        if model.arch.model_type in EAGER_ONLY_TYPES:
            return "eager"
        return "sdpa"
    return "eager"


def materialize_fake(net: torch.nn.Module) -> torch.nn.Module:
    """Swap a meta-device model's tensors for fake CPU ones (call under a FakeTensorMode).

    Building on meta and converting after keeps peft and ``module.to()`` on plain meta
    tensors (fake parameters cannot be converted in place); tied weights stay tied.
    """
    new_of: dict[int, torch.Tensor] = {}

    def fake_like(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in new_of:
            new_of[id(t)] = torch.empty(t.shape, dtype=t.dtype)
        return new_of[id(t)]

    for module in net.modules():
        for name, param in list(module._parameters.items()):
            if param is not None:
                if id(param) not in new_of:
                    new_of[id(param)] = torch.nn.Parameter(
                        torch.empty(param.shape, dtype=param.dtype),
                        requires_grad=param.requires_grad,
                    )
                module._parameters[name] = new_of[id(param)]  # type: ignore[assignment]
        for name, buf in list(module._buffers.items()):
            if buf is not None:
                module._buffers[name] = fake_like(buf)
        for name, value in list(vars(module).items()):
            if isinstance(value, torch.Tensor) and value.device.type == "meta":
                setattr(module, name, fake_like(value))
    return net


def _build(
    model: ModelInfo, setup: TrainingSetup, depth: int | None, cuda_policy: bool = False
) -> torch.nn.Module:
    import transformers

    from batchfit.models import _meta

    cfg = _config(model, depth)
    cfg._attn_implementation = _attn_impl(model, setup.attention)
    auto = getattr(transformers, _meta._AUTO_CLASS[model.task])
    # Build in the storage dtype (fake parameters cannot be converted by module.to()):
    # pure 16-bit stores 16-bit weights; LoRA stores its frozen base in 16-bit unless fp32.
    dtype = torch.float32
    if setup.precision in ("bf16", "amp-bf16") and (setup.precision == "bf16" or setup.is_lora):
        dtype = torch.bfloat16
    elif setup.precision in ("fp16", "amp-fp16") and (setup.precision == "fp16" or setup.is_lora):
        dtype = torch.float16
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        try:
            net = auto.from_config(cfg, dtype=dtype)
        except TypeError:  # transformers < 4.56 names it torch_dtype
            net = auto.from_config(cfg, torch_dtype=dtype)
    finally:
        torch.set_default_dtype(previous)
    if setup.grad_ckpt:
        ckpt_kwargs: dict[str, Any] = {"use_reentrant": False}
        if cuda_policy:
            # Torch-function modes are not active while backward recomputes a checkpointed
            # layer: re-enter CUDA's autocast policy there, or the recompute disagrees.
            from batchfit.memory.kernels import cuda_autocast_policy

            ckpt_kwargs["context_fn"] = lambda: (contextlib.nullcontext(), cuda_autocast_policy())
        enable = getattr(net, "activation_checkpointing_enable", None)  # transformers >= 5
        if enable is not None:
            enable(activation_checkpointing_kwargs=ckpt_kwargs)
        else:  # the older name, deprecated since
            net.gradient_checkpointing_enable(gradient_checkpointing_kwargs=ckpt_kwargs)
    if setup.is_lora:
        from peft import LoraConfig, get_peft_model

        targets = list(setup.lora_targets or model.default_lora_targets())
        net = get_peft_model(
            net,
            LoraConfig(
                r=setup.lora_rank,
                lora_alpha=setup.lora_alpha,  # type: ignore[arg-type]
                lora_dropout=setup.lora_dropout,
                target_modules=targets,
            ),
        )
        if setup.grad_ckpt:
            net.enable_input_require_grads()
    net.train()
    return cast(torch.nn.Module, net)


def batch_fn(model: ModelInfo, micro: int, seq: int) -> Callable[[], dict[str, Any]]:
    """A factory of random batches of ``micro`` sequences of ``seq`` tokens, with labels."""
    vocab = model.arch.vocab_size

    def make() -> dict[str, Any]:
        ids = torch.randint(0, vocab, (micro, seq))
        if model.task == "classification":
            return {"input_ids": ids, "labels": torch.randint(0, 2, (micro,))}
        return {"input_ids": ids, "labels": torch.randint(0, vocab, (micro, seq))}

    return make


@dataclass
class StepParts:
    """Everything one training step needs; built under fake mode for a trace, real otherwise."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    make_batch: Callable[[], dict[str, Any]]
    autocast_dtype: torch.dtype | None

    @staticmethod
    def loss_of(out: Any, _batch: dict[str, Any]) -> torch.Tensor:
        loss: torch.Tensor = out.loss
        return loss


def step_parts(
    model: ModelInfo,
    setup: TrainingSetup,
    *,
    micro: int,
    seq: int,
    emulate_cuda: bool,
    depth: int | None = None,
    built: torch.nn.Module | None = None,
) -> StepParts:
    """Model (setup applied), optimizer, batch factory and autocast dtype for one step."""
    net = built if built is not None else _build(model, setup, depth)
    params = [p for p in net.parameters() if p.requires_grad]
    opt = make_optimizer(setup.optimizer, params, setup.optimizer_impl, emulate_cuda)
    autocast = {"amp-bf16": torch.bfloat16, "amp-fp16": torch.float16}.get(setup.precision)
    return StepParts(net, opt, batch_fn(model, micro, seq), autocast)


def trace_once(
    model: ModelInfo,
    setup: TrainingSetup,
    *,
    micro: int,
    seq: int,
    device: Literal["cpu", "cuda"],
    gpu: GpuSpec | None,
    depth: int | None,
    grad_accum_steps: int,
) -> trace.TraceResult:
    """One dry run at ``depth`` layers (None = the real depth)."""
    from batchfit.memory.kernels import emulation

    emulate_cuda = device == "cuda"
    keep: list[torch.Tensor] = []

    def cuda_workspaces(tracker: Any) -> None:
        if emulate_cuda:
            workspace = gpu_extras(gpu, setup).workspace
            for _ in range(CUBLAS_HANDLES):
                keep.append(torch.empty(workspace // CUBLAS_HANDLES, dtype=torch.uint8))
                tracker.label(keep[-1], "other")

    kernels = emulation(emulate_cuda)
    with trace.quiet():
        with torch.device("meta"):
            net = _build(model, setup, depth, cuda_policy=emulate_cuda)
        with trace.fake_mode(), kernels:
            parts = step_parts(
                model,
                setup,
                micro=micro,
                seq=seq,
                emulate_cuda=emulate_cuda,
                built=materialize_fake(net),
            )
            result = trace.run_steps(
                parts.model,
                parts.optimizer,
                parts.make_batch,
                parts.loss_of,
                autocast_dtype=parts.autocast_dtype,
                grad_accum_steps=grad_accum_steps,
                extra_other=cuda_workspaces,
                loop=setup.loop,
            )
    if emulate_cuda:
        from batchfit.memory.allocator import simulate

        result = replace(result, reserved_bytes=simulate(result.events).reserved_bytes)
    return result


def estimate_trace(
    model: ModelInfo,
    setup: TrainingSetup,
    *,
    micro_batch_size: int,
    seq_len: int,
    device: Literal["cpu", "cuda"],
    gpu: GpuSpec | None,
    grad_accum_steps: int = 1,
    full_depth: bool = False,
) -> MemoryEstimate:
    """A MemoryEstimate from dry runs; falls back to the analytic engine where it must."""
    resolved = analytic.resolve_setup(model, setup, device, gpu)
    formulas = analytic.estimate_analytic(
        model,
        setup,
        micro_batch_size=micro_batch_size,
        seq_len=seq_len,
        device=device,
        gpu=gpu,
        grad_accum_steps=grad_accum_steps,
    )
    why_not = unsupported(model, resolved)
    if resolved.is_lora:  # bad targets are the user's error, before any trace
        model.lora_params(resolved.lora_rank, resolved.lora_targets)
    if why_not is None:
        try:
            traced = _estimate_traced(
                model,
                resolved,
                micro_batch_size=micro_batch_size,
                seq_len=seq_len,
                device=device,
                gpu=gpu,
                grad_accum_steps=grad_accum_steps,
                full_depth=full_depth,
            )
        except UsageError:
            raise
        except Exception as e:
            if not _is_trace_limit(e):
                raise
            first_line = (str(e).splitlines() or [""])[0][:160]
            why_not = f"the dry run failed ({type(e).__name__}: {first_line})"
        else:
            # The formulas' checks of the setup (bf16 support, kernels) apply to the trace too.
            return replace(traced, warnings=tuple(dict.fromkeys(formulas.warnings)))
    return replace(
        formulas,
        warnings=(
            f"the trace engine cannot run this setup yet: {why_not}; the analytic engine answered",
            *formulas.warnings,
        ),
    )


def _estimate_traced(
    model: ModelInfo,
    resolved: TrainingSetup,
    *,
    micro_batch_size: int,
    seq_len: int,
    device: Literal["cpu", "cuda"],
    gpu: GpuSpec | None,
    grad_accum_steps: int,
    full_depth: bool,
) -> MemoryEstimate:
    depth = model.arch.num_layers
    kw: dict[str, Any] = {
        "micro": micro_batch_size,
        "seq": seq_len,
        "device": device,
        "gpu": gpu,
        "grad_accum_steps": min(grad_accum_steps, 2),
    }
    low, high = trace_depths(model)
    notes = []
    if full_depth or depth <= high:
        result = trace_once(model, resolved, depth=None, **kw)
    else:
        shallow = trace_once(model, resolved, depth=low, **kw)
        deep = trace_once(model, resolved, depth=high, **kw)
        result = trace.extrapolate(shallow, deep, low, high, depth)
        notes.append(f"traced {low} and {high} layers, extrapolated to {depth}")
    components = dict(result.peak.components)
    peak_bytes = sum(components.values())
    reserved = max(result.reserved_bytes, peak_bytes)
    totals = device_totals(peak_bytes, reserved, device, gpu, resolved)
    trainable = _trainable(model, resolved)
    step = StepMemory(
        components=components,
        peak_phase=result.peak.phase,
        activation_peak_bytes=max(p.components["activations"] for p in result.phases),
        total_params=model.total_params + (trainable if resolved.is_lora else 0),
        trainable_params=trainable,
        lines=_trace_lines(components, result.peak.phase, totals, device),
        warnings=tuple(model.warnings),
        extras={
            "top_modules": list(result.top_modules),
            "trace_seconds": result.seconds,
            "peak_moment": result.peak.describe(),
            "notes": notes,
        },
    )
    return assemble(
        step,
        totals,
        model=model.name,
        engine="trace",
        setup=resolved,
        workload=(micro_batch_size, seq_len),
        device=device,
        gpu=gpu,
    )


def _trace_lines(
    components: dict[str, int], phase: str, totals: DeviceTotals, device: str
) -> tuple[Line, ...]:
    """The accounting of a traced step: components at the peak, then the device's totals."""
    lines = [
        Line(c, f"at the peak ({phase})", v, "counted in a dry run of the real step")
        for c, v in components.items()
    ]
    if device == "cuda":
        lines.append(
            Line(
                "other",
                "allocator: reserved beyond allocated",
                totals.reserved - totals.peak,
                "caching allocator simulation (segments, rounding, splits)",
            )
        )
        lines.append(
            Line(
                "other",
                "CUDA context (outside the allocator)",
                totals.context,
                f"{totals.context // BYTES_IN_MIB} MiB",
            )
        )
    return tuple(lines)


def _trainable(model: ModelInfo, setup: TrainingSetup) -> int:
    if setup.is_lora:
        return model.lora_params(setup.lora_rank, setup.lora_targets)
    return model.total_params
