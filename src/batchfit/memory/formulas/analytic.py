"""The analytic engine: every component of a training step from formulas, without torch.

The steps, each returning its bytes and the lines that explain them, live in modules named by
their job: parameters, gradients and optimizer state (``_params``); sharding and offload
(``_sharding``; DeepSpeed's ZeRO layout: ``deepspeed``); activations (``activations``); the
peak among a step's moments (``_peak``); what the device adds (``memory.device.totals``);
advice on the setup (``memory.device.advice``).
"""

from __future__ import annotations

from dataclasses import replace

from batchfit._units import BYTES_IN_MIB
from batchfit.errors import UsageError
from batchfit.hardware import GpuSpec
from batchfit.memory.device.advice import advice
from batchfit.memory.device.totals import (
    CUBLAS_HANDLES,
    FRAGMENTATION,
    Device,
    DeviceTotals,
    StepMemory,
    analytic_reserve,
    assemble,
    device_totals,
    gpu_extras,
    workspace_line,
)
from batchfit.memory.formulas import activations as act
from batchfit.memory.formulas._params import (
    NF4_BYTES_PER_PARAM,
    ParamBytes,
    Params,
    optimizer_state_bytes,
    param_bytes,
    parameters,
)
from batchfit.memory.formulas._peak import peak
from batchfit.memory.formulas._sharding import Sharded, shard_and_offload
from batchfit.memory.formulas.deepspeed import compute_precision, deepspeed_states
from batchfit.memory.formulas.qlora import qlora_notes
from batchfit.memory.types import Line, MemoryEstimate
from batchfit.models import ModelInfo
from batchfit.spec import TrainingSetup, is_deepspeed
from batchfit.workload import Workload

__all__ = [
    "CUBLAS_HANDLES",
    "NF4_BYTES_PER_PARAM",
    "ParamBytes",
    "estimate_analytic",
    "optimizer_state_bytes",
    "param_bytes",
    "resolve_setup",
]


def resolve_setup(
    model: ModelInfo, setup: TrainingSetup, device: Device, gpu: GpuSpec | None
) -> TrainingSetup:
    """``setup`` made concrete for ``model`` on ``device``: precision, attention, sharding, task.

    Attention is resolved for the model class (``ModelInfo.resolve_attention``): ``auto`` on
    DeBERTa is eager, as transformers runs it.
    """
    classifier = model.task in ("classification", "image-classification")
    if classifier and setup.loss != "full" and setup.framework and not setup.keep_loss:
        # the preset's lean loss is for its language models; a classifier's loss is small
        setup = replace(setup, loss="full", loss_chunk_tokens=None)
    if setup.loss != "full" and model.task in ("classification", "image-classification"):
        raise UsageError(
            f"--loss {setup.loss_label} computes a language model's loss over its vocabulary; "
            "a classification head has none: use --loss full"
        )
    bf16_ok = gpu.bf16 if gpu else True
    resolved = setup.resolved(device=device, bf16_supported=bf16_ok)
    attention = model.resolve_attention(setup.attention)
    return replace(resolved, attention=attention, task=model.task)


def estimate_analytic(model: ModelInfo, setup: TrainingSetup, workload: Workload) -> MemoryEstimate:
    """Estimate one training step's memory on one GPU (or the CPU) from formulas.

    Example:
        >>> from batchfit.models import resolve_model
        >>> est = estimate_analytic(resolve_model("gpt2"), TrainingSetup(precision="fp32"),
        ...                         Workload(micro_batch_size=8, seq_len=512, device="cpu"))
        >>> est.components["weights"] / est.total_params  # fp32
        4.0
    """
    device, gpu = workload.device, workload.gpu
    setup, rg, params, sharded = _model_states(model, setup, device, gpu)
    lines = [*sharded.lines] if sharded.own_lines else [*params.lines, *sharded.lines]
    fixed = sharded.fixed
    if device == "cuda":
        workspace = gpu_extras(gpu, setup).workspace
        fixed += workspace
        lines.append(workspace_line(workspace))
    acts = act.step_activations(
        model,
        setup,
        rg,
        on_cpu=device == "cpu",
        micro_batch_size=workload.micro_batch_size,
        seq_len=workload.seq_len,
        lora_targets=params.lora_targets,
    )
    at_peak = peak(
        setup,
        params,
        sharded,
        acts,
        fixed=fixed,
        num_layers=model.arch.num_layers,
        device=device,
        grad_accum_steps=workload.grad_accum_steps,
    )
    peak_bytes = sum(at_peak.components.values())
    totals = device_totals(peak_bytes, analytic_reserve(peak_bytes), device, gpu, setup)
    lines += [*acts.lines, *at_peak.lines, *_device_lines(totals, device, gpu)]
    step = StepMemory(
        components=at_peak.components,
        peak_phase=at_peak.phase,
        activation_peak_bytes=int(max(acts.at_backward_start, acts.at_backward_top)),
        total_params=model.total_params + (params.trainable if setup.is_lora else 0),
        trainable_params=params.trainable,
        host_bytes=int(sharded.host),
        lines=tuple(lines),
        warnings=(
            *model.warnings,
            *params.warnings,
            *sharded.warnings,
            *advice(setup, device, gpu),
        ),
    )
    est = assemble(
        step,
        totals,
        model=model.name,
        engine="analytic",
        setup=setup,
        workload=workload,
    )
    notes = qlora_notes(model, setup)
    return replace(est, extras={**est.extras, "notes": notes}) if notes else est


def _model_states(
    model: ModelInfo, setup: TrainingSetup, device: Device, gpu: GpuSpec | None
) -> tuple[TrainingSetup, act.Regime, Params, Sharded]:
    """The setup as it runs, its precision regime, the parameters' bytes and what one GPU keeps
    of the model states (sharded, offloaded; DeepSpeed's own layout under ZeRO)."""
    setup = resolve_setup(model, setup, device, gpu)
    if setup.attention == "sdpa" and model.arch.model_type in act.EAGER_ONLY_TYPES:
        setup = replace(setup, attention="eager")
    deepspeed = is_deepspeed(setup)
    # DeepSpeed casts the module to 16-bit and runs it without autocast (engine.py)
    rg = act.Regime.of(compute_precision(setup.precision) if deepspeed else setup.precision, device)
    if setup.kbit_upcast:
        # fp32 embedding, norms and head: an fp32 stream, so the 4-bit layers' outputs are fp32
        # (bitsandbytes 95f9af30 nn/modules.py:637 casts them back to the input's dtype); under
        # autocast attention still computes in 16-bit, the MLP's elementwise ops do not
        rg = replace(rg, mlp_bytes=4) if rg.amp else act.Regime(4, 4, False)
    params = parameters(model, setup)
    if deepspeed:
        sharded = deepspeed_states(model, setup, params)
    else:
        sharded = shard_and_offload(model, setup, params, rg.compute_bytes)
    return setup, rg, params, sharded


def _device_lines(totals: DeviceTotals, device: Device, gpu: GpuSpec | None) -> list[Line]:
    """The allocator's reserve, the CUDA context and NCCL, as the analytic engine counts them."""
    if device != "cuda":
        return []
    context_mib = totals.context // BYTES_IN_MIB
    lines = [
        Line(
            "other",
            "allocator reserve (analytic allowance)",
            totals.reserved - totals.peak,
            f"{FRAGMENTATION:.0%} of peak: segment rounding and fragmentation",
        ),
        Line(
            "other",
            "CUDA context (outside the allocator)",
            totals.context,
            f"{context_mib} MiB for {gpu.architecture if gpu else 'a'} GPU",
        ),
    ]
    if totals.nccl:
        lines.append(Line("other", "NCCL buffers", totals.nccl, "assumed 512 MiB"))
    return lines
