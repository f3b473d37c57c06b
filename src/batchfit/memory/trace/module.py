"""Trace the user's own ``nn.Module``: a factory, a batch factory and a loss, on fake tensors."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch
from torch.utils._pytree import tree_map_only

from batchfit._batchnorm import batchnorm_warning, has_batchnorm
from batchfit.hardware import GpuSpec
from batchfit.memory.device.allocator import simulate
from batchfit.memory.device.kernels import emulation
from batchfit.memory.device.totals import StepMemory, assemble, device_totals
from batchfit.memory.trace import dry_run as trace
from batchfit.memory.trace.hf import materialize_fake
from batchfit.memory.trace.result import TraceResult
from batchfit.memory.trace.tracker import cpu_bf16_gemm_scratch
from batchfit.memory.types import Line, MemoryEstimate
from batchfit.optimizers import make_optimizer
from batchfit.spec import TrainingSetup
from batchfit.workload import Workload

ModelFn = Callable[[], torch.nn.Module]
BatchFn = Callable[[], Any]
LossFn = Callable[[Any, Any], torch.Tensor]


def default_loss(out: Any, _batch: Any) -> torch.Tensor:
    """``out.loss`` (HF-style outputs) or the output itself when it is a scalar."""
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(out, torch.Tensor) and out.dim() == 0:
        return out
    raise ValueError("the model returns no scalar loss: pass loss_fn=lambda out, batch: ...")


def _batch_shape(batch: Any) -> tuple[int, int]:
    first = next(
        (
            t
            for t in (
                batch.values()
                if isinstance(batch, dict)
                else batch
                if isinstance(batch, (tuple, list))
                else [batch]
            )
            if isinstance(t, torch.Tensor)
        ),
        None,
    )
    if first is None or first.dim() == 0:
        return 0, 0
    if first.dim() == 4:  # images (N, C, H, W): the side in pixels, not the channels
        return int(first.shape[0]), int(first.shape[-1])
    return int(first.shape[0]), int(first.shape[1]) if first.dim() > 1 else 1


def estimate_module(
    model_fn: ModelFn,
    setup: TrainingSetup,
    *,
    batch_fn: BatchFn,
    loss_fn: LossFn | None = None,
    device: Literal["cpu", "cuda"] = "cpu",
    gpu: GpuSpec | None = None,
    grad_accum_steps: int = 1,
) -> MemoryEstimate:
    """Dry-run one training step of the module ``model_fn()`` builds, on fake tensors."""
    if setup.is_lora or setup.grad_ckpt or setup.num_gpus > 1 or setup.sharding != "none":
        raise ValueError(
            "for your own module, apply LoRA / checkpointing inside model_fn; "
            "sharding is not traced"
        )
    resolved = setup.resolved(device=device, bf16_supported=gpu.bf16 if gpu else True)
    store = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(resolved.precision, torch.float32)
    if store != torch.float32:  # a pure 16-bit model takes 16-bit inputs (the user casts them)
        batch_fn = _cast_floating(batch_fn, store)
    run = _dry_run(
        model_fn,
        resolved,
        store,
        batch_fn=batch_fn,
        loss_fn=loss_fn or default_loss,
        emulate_cuda=device == "cuda",
        grad_accum_steps=grad_accum_steps,
    )
    peak = run.result.peak
    reserved = peak.total
    if device == "cuda":
        simulated = simulate(run.result.events, expandable_segments=setup.expandable_segments)
        reserved = max(simulated.reserved_bytes, peak.total)
    micro_batch_size, seq_len = run.shape
    est = assemble(
        _step_memory(run),
        device_totals(peak.total, reserved, device, gpu, resolved),
        model=_name(model_fn),
        engine="trace",
        setup=replace(resolved, task=None),
        workload=Workload(
            micro_batch_size=max(micro_batch_size, 1),
            seq_len=max(seq_len, 1),
            device=device,
            gpu=gpu,
            grad_accum_steps=grad_accum_steps,
        ),
    )
    if min(run.shape) > 0:
        return est
    # a batch without a sized tensor (none, or a scalar) has no sizes to report: 0 says so
    return replace(est, micro_batch_size=micro_batch_size, seq_len=seq_len)


def _cast_floating(batch_fn: BatchFn, dtype: torch.dtype) -> BatchFn:
    """``batch_fn`` with its floating tensors cast to ``dtype``."""

    def cast_batch_fn() -> Any:
        return tree_map_only(
            torch.Tensor,
            lambda t: t.to(dtype) if t.is_floating_point() else t,
            batch_fn(),
        )

    return cast_batch_fn


@dataclass(frozen=True)
class _ModuleRun:
    """A dry run of the user's module: its result, the fake module and its trainable
    parameters, and the batch's shape (samples, tokens or pixels)."""

    result: TraceResult
    net: torch.nn.Module
    trainable: list[torch.nn.Parameter]
    shape: tuple[int, int]


def _dry_run(
    model_fn: ModelFn,
    resolved: TrainingSetup,
    store: torch.dtype,
    *,
    batch_fn: BatchFn,
    loss_fn: LossFn,
    emulate_cuda: bool,
    grad_accum_steps: int,
) -> _ModuleRun:
    """The module built in ``store``'s dtype on fake tensors, and its step traced."""
    autocast = {"amp-bf16": torch.bfloat16, "amp-fp16": torch.float16}.get(resolved.precision)
    with trace.quiet():
        net = _build_on_meta(model_fn, store)
        with trace.fake_mode(), emulation(emulate_cuda):
            net = materialize_fake(net)
            net.train()
            params = [p for p in net.parameters() if p.requires_grad]
            opt = make_optimizer(resolved.optimizer, params, resolved.optimizer_impl, emulate_cuda)
            shape = _batch_shape(batch_fn())
            result = trace.run_steps(
                net,
                opt,
                batch_fn,
                loss_fn,
                autocast_dtype=autocast,
                # memory is the same for any count from 2 up: later micro-steps hold the
                # gradients of earlier ones (the HF trace caps it the same way)
                grad_accum_steps=min(grad_accum_steps, 2),
                loop=resolved.loop,
                gemm_scratch=not emulate_cuda and cpu_bf16_gemm_scratch(),
                # CUDA: the allocator replays a whole first step, rebuilt from the primed one
                replay_first_step=emulate_cuda,
                samples=shape[0],
            )
    return _ModuleRun(result, net, params, shape)


def _step_memory(run: _ModuleRun) -> StepMemory:
    """The step's memory at the dry run's peak, each component one line."""
    peak = run.result.peak
    return StepMemory(
        components=dict(peak.components),
        peak_phase=peak.phase,
        activation_peak_bytes=max(p.components["activations"] for p in run.result.phases),
        total_params=sum(p.numel() for p in run.net.parameters()),
        trainable_params=sum(p.numel() for p in run.trainable),
        lines=tuple(
            Line(c, f"at the peak ({peak.phase})", v, "dry run of your module")
            for c, v in peak.components.items()
        ),
        warnings=_batchnorm_warnings(run.net, run.shape[0]),
        extras={
            "top_modules": list(run.result.top_modules),
            "trace_seconds": run.result.seconds,
            # each moment's total: the planner fits its lines through two traced sizes
            "moments": {p.key: p.total for p in run.result.phases},
            # what the step counted, per sample: FLOPs forward and backward, then the bytes
            # the other operators move (the step time's inputs)
            "flops_per_sample": list(run.result.flops),
        },
    )


def _batchnorm_warnings(net: torch.nn.Module, micro_batch_size: int) -> tuple[str, ...]:
    warning = batchnorm_warning(micro_batch_size) if has_batchnorm(net) else None
    return (warning,) if warning and micro_batch_size > 0 else ()


def _name(model_fn: ModelFn) -> str:
    return getattr(model_fn, "__qualname__", type(model_fn).__name__)


def _build_on_meta(model_fn: ModelFn, dtype: torch.dtype) -> torch.nn.Module:
    """``model_fn()`` on the meta device, its floating tensors created in ``dtype``."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            net: object = model_fn()
    finally:
        torch.set_default_dtype(previous)
    if not isinstance(net, torch.nn.Module):
        raise TypeError(
            f"model_fn {_name(model_fn)} returned {type(net).__name__!r}, not an nn.Module: "
            "pass a function that builds and returns your model, e.g. lambda: MyNet()"
        )
    return net
