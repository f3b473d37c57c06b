"""The analytic engine: every component of a training step from formulas, without torch.

Peak memory is the largest of three moments of a steady-state step (optimizer state already
allocated): the start of backward (all activations, the loss's fp32 buffers, and gradients of
earlier micro-steps when accumulating), the end of backward (all gradients; with checkpointing,
one recomputed layer), and ``optimizer.step()`` (gradients plus the optimizer's temporaries).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

from batchfit._units import BYTES_IN_MIB, human_count
from batchfit.hardware import GpuSpec
from batchfit.memory import _activations as act
from batchfit.memory.types import Line, MemoryEstimate
from batchfit.models import ModelInfo
from batchfit.spec import TrainingSetup

# QLoRA NF4 with double quantisation: 4 bits + 8-bit absmax per 64-block + fp32 absmax per
# 256 of those (Dettmers et al. 2023, QLoRA, section 3: 0.127 bits of constants per param).
NF4_BYTES_PER_PARAM = 0.5 + 1 / 64 + 4 / (64 * 256)
# bitsandbytes 8-bit optimizers: 1 byte per state element plus an fp32 absmax per 256-block;
# tensors under min_8bit_size=4096 elements keep 32-bit states (bnb/optim/optimizer.py).
BNB_BLOCK = 256
BNB_MIN_8BIT_SIZE = 4096
# cuBLAS workspace per handle (aten/src/ATen/cuda/CublasHandlePool.cpp, default
# CUBLAS_WORKSPACE_CONFIG): 4096 KiB * 2 + 16 KiB * 8 before Hopper, 32 MiB on sm90+.
# One handle per thread: the forward thread and autograd's backward thread.
CUBLAS_WORKSPACE_BYTES = {
    "pre-hopper": 4096 * 1024 * 2 + 16 * 1024 * 8,
    "hopper+": 32 * BYTES_IN_MIB,
}
CUBLAS_HANDLES = 2
# CUDA context with lazy module loading (default since CUDA 11.7 / PyTorch 1.13): DESIGN.md
# gives 250-700 MiB; we take the upper middle per generation until measured (issue 3).
CUDA_CONTEXT_MIB = {
    "pascal": 300,
    "volta": 350,
    "turing": 350,
    "ampere": 450,
    "ada": 450,
    "hopper": 550,
    "blackwell": 600,
    "cdna2": 450,
    "cdna3": 550,
}
# NCCL: NCCL_BUFFSIZE 4 MiB per channel and peer, both directions, up to 32 channels, plus
# its kernels; an assumption until measured.
NCCL_BYTES = 512 * BYTES_IN_MIB
# Reserved over allocated for the analytic engine: segment rounding and fragmentation.
# An assumption; the trace engine replays allocations through an allocator simulation.
FRAGMENTATION = 0.05

Device = Literal["cpu", "cuda"]


@dataclass(frozen=True)
class ParamBytes:
    """Bytes per parameter of one precision setup (before sharding)."""

    weight: int
    grad: int
    state_elem: int  # optimizer state element size
    master: int  # separate fp32 master copy (fp16 mixed precision, ZeRO's K=12 includes it)


def param_bytes(precision: str) -> ParamBytes:
    """fp32 4/4/4; amp (fp32 weights, autocast) 4/4/4; bf16 2/2/2; fp16 2/2/4 + 4 master.

    Example:
        >>> param_bytes("bf16")
        ParamBytes(weight=2, grad=2, state_elem=2, master=0)
    """
    if precision in ("fp32", "amp-fp16", "amp-bf16"):
        return ParamBytes(4, 4, 4, 0)
    if precision == "bf16":
        return ParamBytes(2, 2, 2, 0)
    return ParamBytes(2, 2, 4, 4)  # fp16 weights + fp32 master + fp32 states (ZeRO paper)


def optimizer_state_bytes(shape: tuple[int, ...], optimizer: str, state_elem: int) -> float:
    """Optimizer state of one parameter tensor.

    Example:
        >>> optimizer_state_bytes((4096, 4096), "adamw", 4)
        134217728
        >>> optimizer_state_bytes((4096, 4096), "adafactor", 4)  # factored: rows + cols
        32768
    """
    n = math.prod(shape)
    if optimizer == "sgd":
        return 0
    if optimizer in ("sgd-momentum", "lion"):
        return n * state_elem  # one momentum buffer
    if optimizer in ("adam", "adamw"):
        return 2 * n * state_elem  # exp_avg, exp_avg_sq
    if optimizer in ("adamw-8bit", "paged-adamw-8bit"):
        if n < BNB_MIN_8BIT_SIZE:
            return 2 * n * 4
        return 2 * (n + 4 * math.ceil(n / BNB_BLOCK))
    if optimizer == "adafactor":
        # HF Adafactor (beta1=None): fp32 row and column second moments for >= 2-D tensors.
        if len(shape) >= 2:
            rows = math.prod(shape[:-1])
            cols = math.prod(shape[:-2]) * shape[-1]
            return 4 * (rows + cols)
        return 4 * n
    raise ValueError(f"unknown optimizer {optimizer!r}")


def _step_temporaries(
    shapes: list[tuple[tuple[int, ...], int]], setup: TrainingSetup, state_elem: int, device: Device
) -> tuple[float, str]:
    """Bytes the optimizer's step allocates on top of its state, and why."""
    opt, impl = setup.optimizer, setup.optimizer_impl
    total = sum(math.prod(s) * c for s, c in shapes)
    largest = max((math.prod(s) for s, _ in shapes), default=0)
    torch_native = opt in ("sgd", "sgd-momentum", "adam", "adamw")
    if impl == "auto":
        # torch.optim picks foreach for CUDA tensors, the per-parameter loop on the CPU;
        # HF's and bitsandbytes' optimizers are per-parameter loops.
        impl = "foreach" if device == "cuda" and torch_native else "for-loop"
    if opt in ("adam", "adamw"):
        if impl == "foreach":
            return total * state_elem, "foreach AdamW: _foreach_sqrt(exp_avg_sq) of every parameter"
        if impl == "for-loop":
            return largest * state_elem, "per-parameter AdamW: one sqrt(exp_avg_sq) at a time"
        return 0, "fused AdamW: no temporaries"
    if opt == "adafactor":
        return 3 * 4 * largest, "Adafactor: grad^2, approximate update and its RMS, one tensor"
    if opt == "lion":
        return largest * state_elem, "Lion: one update tensor at a time"
    return 0, "in place"


def _gpu_extras(gpu: GpuSpec | None, setup: TrainingSetup) -> tuple[int, int, int]:
    """cuBLAS workspaces (allocated), CUDA context, NCCL buffers (outside the allocator)."""
    arch = gpu.architecture if gpu else "ampere"
    hopper_plus = arch in ("hopper", "blackwell")
    workspace = CUBLAS_HANDLES * CUBLAS_WORKSPACE_BYTES["hopper+" if hopper_plus else "pre-hopper"]
    context = CUDA_CONTEXT_MIB.get(arch, 500) * BYTES_IN_MIB
    nccl = NCCL_BYTES if setup.num_gpus > 1 else 0
    return workspace, context, nccl


def estimate_analytic(
    model: ModelInfo,
    setup: TrainingSetup,
    *,
    micro_batch_size: int,
    seq_len: int,
    device: Device = "cuda",
    gpu: GpuSpec | None = None,
    grad_accum_steps: int = 1,
) -> MemoryEstimate:
    """Estimate one training step's memory on one GPU (or the CPU) from formulas.

    Example:
        >>> from batchfit.models import resolve_model
        >>> est = estimate_analytic(resolve_model("gpt2"), TrainingSetup(precision="fp32"),
        ...                         micro_batch_size=8, seq_len=512, device="cpu")
        >>> est.components["weights"] / est.total_params  # fp32
        4.0
    """
    bf16_ok = gpu.bf16 if gpu else True
    setup = replace(setup.resolved(device=device, bf16_supported=bf16_ok), task=model.task)
    if setup.attention == "sdpa" and model.arch.model_type in ("gemma2", "t5", "mt5"):
        # Gemma-2's logit soft-capping and T5's position bias are eager-only in HF.
        setup = replace(setup, attention="eager")
    arch, pb = model.arch, param_bytes(setup.precision)
    rg = act.Regime.of(setup.precision, device)
    lines: list[Line] = []
    warnings: list[str] = list(model.warnings)
    total = model.total_params
    n_gpus = setup.num_gpus
    shard = n_gpus if setup.sharding in ("zero1", "zero2", "zero3", "fsdp") else 1

    # --- parameters: what is stored, what is trained -------------------------------------
    if setup.is_lora:
        targets = setup.lora_targets or model.default_lora_targets()
        if setup.lora_targets is None and model.lora_targets_guessed:
            warnings.append(
                f"peft has no default LoRA targets for {arch.model_type}: assumed "
                f"{','.join(targets)} (set --lora-targets)"
            )
        lora_n = model.lora_params(setup.lora_rank, targets)
        trainable_shapes = _lora_shapes(model, setup.lora_rank, targets)
        trainable = lora_n
        # peft keeps adapters in fp32 (autocast_adapter_dtype=True) whatever the base dtype.
        adapter_pb = ParamBytes(4, 4, 4, 0)
        if setup.method == "qlora":
            q = model.quantizable_params()
            base = q * NF4_BYTES_PER_PARAM + (total - q) * 2
            lines.append(
                Line(
                    "weights",
                    "base, NF4 + double quant",
                    int(q * NF4_BYTES_PER_PARAM),
                    f"{q:,} params x {NF4_BYTES_PER_PARAM:.4f} B (4-bit + constants)",
                )
            )
            lines.append(
                Line(
                    "weights",
                    "base, not quantised (16-bit)",
                    (total - q) * 2,
                    f"{total - q:,} params x 2 B (embeddings, norms, output head)",
                )
            )
        else:
            # A frozen base needs no fp32 master: peft recipes load it in 16-bit unless fp32.
            base_b = 4 if setup.precision == "fp32" else 2
            base = total * base_b
            lines.append(
                Line(
                    "weights",
                    "frozen base",
                    base,
                    f"{total:,} params x {base_b} B (frozen, no master copy)",
                )
            )
        weights = base + lora_n * 4
        lines.append(
            Line(
                "weights",
                "LoRA adapters",
                lora_n * 4,
                f"{lora_n:,} params x 4 B (fp32), r={setup.lora_rank} on {','.join(targets)}",
            )
        )
        grad_pb, state_pb = adapter_pb, adapter_pb
    else:
        roles_targets = None
        trainable = total
        trainable_shapes = [(g.shape, g.count) for g in model.params]
        weights = total * pb.weight
        lines.append(
            Line(
                "weights",
                "weights",
                weights,
                f"{total:,} params x {pb.weight} B ({_weight_why(setup.precision)})",
            )
        )
        grad_pb, state_pb = pb, pb
    roles_targets = (setup.lora_targets or model.default_lora_targets()) if setup.is_lora else None

    grads: float = trainable * grad_pb.grad
    lines.append(
        Line("gradients", "gradients", int(grads), f"{trainable:,} trainable x {grad_pb.grad} B")
    )
    states = sum(
        optimizer_state_bytes(s, setup.optimizer, state_pb.state_elem) * c
        for s, c in trainable_shapes
    )
    lines.append(
        Line(
            "optimizer_state",
            setup.optimizer,
            int(states),
            _state_formula(setup.optimizer, trainable, state_pb.state_elem),
        )
    )
    if state_pb.master:
        states += trainable * state_pb.master
        lines.append(
            Line(
                "optimizer_state",
                "fp32 master weights",
                trainable * state_pb.master,
                f"{trainable:,} x 4 B (fp16 weights train against an fp32 copy)",
            )
        )

    # --- sharding and offload (per GPU) ---------------------------------------------------
    host = 0.0
    if shard > 1:
        states /= shard
        lines.append(
            Line(
                "optimizer_state",
                f"{setup.sharding}: divided by {shard} GPUs",
                int(states),
                f"optimizer state / {shard}",
            )
        )
        if setup.sharding in ("zero2", "zero3", "fsdp"):
            grads /= shard
            lines.append(
                Line(
                    "gradients",
                    f"{setup.sharding}: divided by {shard} GPUs",
                    int(grads),
                    f"gradients / {shard}",
                )
            )
        if setup.sharding in ("zero3", "fsdp"):
            weights /= shard
            lines.append(
                Line(
                    "weights",
                    f"{setup.sharding}: divided by {shard} GPUs",
                    int(weights),
                    f"weights / {shard}",
                )
            )
    elif setup.sharding not in ("none", "ddp") and n_gpus == 1 and setup.offload == "none":
        warnings.append(f"--sharding {setup.sharding} on one GPU divides nothing")
    if setup.offload in ("optimizer", "optimizer+params"):
        host += states
        lines.append(
            Line(
                "optimizer_state",
                "offloaded to CPU RAM",
                -int(states),
                f"{int(states):,} B move to host memory",
            )
        )
        states = 0
    if setup.offload == "optimizer+params":
        host += weights
        lines.append(
            Line(
                "weights",
                "offloaded to CPU RAM",
                -int(weights),
                f"{int(weights):,} B move to host memory",
            )
        )
        weights = 0

    other_fixed = 0.0
    layer_params = _largest_layer_params(model)
    if (setup.sharding in ("zero3", "fsdp") and shard > 1) or setup.offload == "optimizer+params":
        gathered = 2 * layer_params * rg.compute_bytes
        other_fixed += gathered
        lines.append(
            Line(
                "other",
                "gathered parameters (current + prefetched layer)",
                int(gathered),
                f"2 x {layer_params:,} params x {rg.compute_bytes} B",
            )
        )
    if setup.sharding == "ddp" and n_gpus > 1:
        other_fixed += grads
        lines.append(
            Line(
                "other",
                "DDP gradient buckets",
                int(grads),
                "a second copy of the gradients (gradient_as_bucket_view=False)",
            )
        )
    workspace = context = nccl = 0
    if device == "cuda":
        workspace, context, nccl = _gpu_extras(gpu, setup)
        other_fixed += workspace
        lines.append(
            Line(
                "other",
                "cuBLAS workspaces",
                workspace,
                f"{CUBLAS_HANDLES} handles x {workspace // CUBLAS_HANDLES:,} B",
            )
        )

    # --- activations -------------------------------------------------------------------------
    tokens = micro_batch_size * seq_len
    roles = act.trainable_roles(arch.model_type, roles_targets)
    impl: str = setup.attention
    if device == "cpu" and impl in ("sdpa", "flash") and arch.attention_dropout > 0:
        impl = "math"  # CPU SDPA falls back to its math path when dropout is on (measured)
    per_layer_terms = act.layer_terms(arch, rg, impl, seq_len, roles)
    if roles_targets is not None:
        per_layer_terms += act.lora_terms(arch, roles_targets, setup.lora_rank, setup.lora_dropout)
    per_layer = sum(v for _, v in per_layer_terms) * tokens
    stack_layers = arch.num_layers
    decoder_layer = 0.0
    if arch.family == "encoder-decoder":
        dec_terms = act.layer_terms(arch, rg, impl, seq_len, roles, cross_attention=True)
        decoder_layer = sum(v for _, v in dec_terms) * tokens
    layers_total = per_layer * stack_layers + decoder_layer * arch.num_decoder_layers
    head_trainable = not setup.is_lora
    norm_name, norm_size = act._norm(arch, rg)
    final = (norm_size + (rg.compute_bytes * arch.hidden_size if head_trainable else 0)) * tokens
    if model.task == "classification":
        held, bwd_extra = 0.0, 0.0
    else:
        held_pt, extra_pt = act.loss_terms(arch.vocab_size, rg)
        held, bwd_extra = held_pt * tokens, extra_pt * tokens
    amp_copies = 0.0
    if rg.amp and not setup.is_lora:
        # Autocast casts each matmul's fp32 weight to 16-bit; the copy is saved for backward.
        amp_copies = 2 * sum(g.total for g in model.params if g.is_matrix_weight)
        if arch.tied_embeddings and model.task != "classification":
            amp_copies += 2 * arch.vocab_size * arch.hidden_size
    # The first gradients backward produces (output head / last layer): about one layer's worth.
    head_grad = trainable * grad_pb.grad / max(stack_layers, 1) if not setup.is_lora else 0

    if setup.grad_ckpt:
        ckpt = (
            rg.stream_bytes * arch.hidden_size * tokens * (stack_layers + arch.num_decoder_layers)
        )
        one_layer = max(per_layer, decoder_layer)
        layer_copies = amp_copies / max(stack_layers + arch.num_decoder_layers, 1)
        acts_start = ckpt + final + held + bwd_extra + layer_copies
        acts_end = one_layer + layer_copies + rg.stream_bytes * arch.hidden_size * tokens
        lines += [
            Line(
                "activations",
                "checkpointed layer inputs",
                int(ckpt),
                f"{stack_layers + arch.num_decoder_layers} layers x {rg.stream_bytes} B x "
                f"{arch.hidden_size} x {tokens:,} tokens",
            ),
            Line(
                "activations",
                "one layer recomputed in backward",
                int(one_layer),
                _layer_formula(per_layer_terms, tokens),
            ),
        ]
    else:
        acts_start = layers_total + final + held + bwd_extra + amp_copies
        acts_end = 0.0
        lines.append(
            Line(
                "activations",
                f"{stack_layers} layers",
                int(per_layer * stack_layers),
                f"{stack_layers} x {_layer_formula(per_layer_terms, tokens)}",
            )
        )
        if decoder_layer:
            lines.append(
                Line(
                    "activations",
                    f"{arch.num_decoder_layers} decoder layers",
                    int(decoder_layer * arch.num_decoder_layers),
                    "self-attention + cross-attention + MLP per layer",
                )
            )
    final_per_token = final / tokens
    lines.append(
        Line(
            "activations",
            f"final {norm_name.split(':')[0]} + head input",
            int(final),
            f"{final_per_token:g} B/token x {tokens:,} tokens",
        )
    )
    if held:
        lines.append(
            Line(
                "activations",
                "logits + fp32 log-softmax",
                int(held),
                f"{tokens:,} tokens x {arch.vocab_size:,} vocab x ({rg.compute_bytes} + 4) B",
            )
        )
        lines.append(
            Line(
                "activations",
                "loss backward (fp32 grads of logits)",
                int(bwd_extra),
                f"{tokens:,} x {arch.vocab_size:,} x 8 B, at the start of backward",
            )
        )
    if amp_copies:
        shown = amp_copies
        why = "2 B per matmul weight, saved for backward"
        if setup.grad_ckpt:
            shown = amp_copies / max(stack_layers + arch.num_decoder_layers, 1)
            why = "one recomputed layer's weights at a time, 2 B each"
        lines.append(Line("activations", "autocast 16-bit weight copies", int(shown), why))

    # --- the peak ------------------------------------------------------------------------------
    temps, temps_why = _step_temporaries(trainable_shapes, setup, state_pb.state_elem, device)
    if setup.offload != "none":
        temps = 0.0  # the step runs on the CPU
    temps /= shard
    grads_before = grads if grad_accum_steps > 1 else min(head_grad, grads)
    phases = {
        "backward": (grads_before, acts_start, other_fixed),
        "backward-end": (grads, acts_end, other_fixed),
        "optimizer-step": (grads, 0.0, other_fixed + temps),
    }
    phase = max(phases, key=lambda p: sum(phases[p]))
    g_at, a_at, o_at = phases[phase]
    if temps and phase == "optimizer-step":
        lines.append(Line("other", "optimizer step temporaries", int(temps), temps_why))
    components = {
        "weights": int(weights),
        "gradients": int(g_at),
        "optimizer_state": int(states),
        "activations": int(a_at),
        "other": int(o_at),
    }
    peak = sum(components.values())
    if device == "cuda":
        reserved = _round_up(int(peak * (1 + FRAGMENTATION)), 2 * BYTES_IN_MIB)
        reserved = cap_reserved(peak, reserved, gpu, context + nccl)
        device_total = reserved + context + nccl
        lines.append(
            Line(
                "other",
                "allocator reserve (analytic allowance)",
                reserved - peak,
                f"{FRAGMENTATION:.0%} of peak: segment rounding and fragmentation",
            )
        )
        lines.append(
            Line(
                "other",
                "CUDA context (outside the allocator)",
                context,
                f"{context // BYTES_IN_MIB} MiB for {gpu.architecture if gpu else 'a'} GPU",
            )
        )
        if nccl:
            lines.append(Line("other", "NCCL buffers", nccl, "assumed 512 MiB"))
    else:
        reserved = device_total = peak
    if setup.attention == "flash" and device == "cuda":
        sm = gpu.sm if gpu else (8, 0)
        if sm is None or sm < (8, 0) or setup.precision == "fp32":
            warnings.append(
                "flash attention needs an sm80+ GPU and 16-bit inputs: PyTorch runs the "
                "memory-efficient kernel here, which keeps the same output + log-sum-exp"
            )
    if setup.precision in ("fp16", "amp-fp16") and gpu is not None and gpu.bf16:
        warnings.append(f"{gpu.name} supports bf16: amp-bf16 needs no GradScaler")
    if setup.precision in ("bf16", "amp-bf16") and gpu is not None and not gpu.bf16:
        warnings.append(f"{gpu.name} has no native bf16: use amp-fp16 with a GradScaler")

    dev_name = "cpu" if device == "cpu" else (f"cuda:{gpu.name}" if gpu else "cuda")
    return MemoryEstimate(
        model=model.name,
        engine="analytic",
        device=dev_name,
        micro_batch_size=micro_batch_size,
        seq_len=seq_len,
        setup=setup,
        components=components,
        peak_bytes=peak,
        reserved_bytes=reserved,
        device_total_bytes=device_total,
        total_params=total + (trainable if setup.is_lora else 0),
        trainable_params=trainable,
        peak_phase=phase,
        host_bytes=int(host),
        activation_peak_bytes=int(acts_start),
        lines=tuple(lines),
        warnings=tuple(warnings),
    )


def cap_reserved(peak: int, reserved: int, gpu: GpuSpec | None, outside_allocator: int) -> int:
    """What the caching allocator reserves on a real card of ``gpu``'s size.

    When a cudaMalloc fails, PyTorch's allocator frees its cached, unused segments and retries
    before raising out-of-memory (``release_cached_blocks`` in CUDACachingAllocator.cpp). So a
    step whose allocated peak fits never fails for cached memory alone: the reserve fills up to
    the card and stops there.

    Example:
        >>> cap_reserved(10, 15, None, 0), cap_reserved(30 << 30, 45 << 30, None, 0) > 0
        (15, True)
    """
    if gpu is None:
        return reserved
    capacity = gpu.memory_bytes - outside_allocator
    if peak <= capacity < reserved:
        return capacity
    return reserved


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _weight_why(precision: str) -> str:
    return {
        "fp32": "fp32",
        "amp-bf16": "fp32 master weights; autocast computes in bf16",
        "amp-fp16": "fp32 master weights; autocast computes in fp16",
        "bf16": "pure bf16",
        "fp16": "fp16 weights; the fp32 master copy is optimizer state",
    }[precision]


def _state_formula(optimizer: str, trainable: int, elem: int) -> str:
    per = {
        "sgd": "no state",
        "sgd-momentum": f"1 momentum x {elem} B",
        "lion": f"1 momentum x {elem} B",
        "adam": f"2 moments x {elem} B",
        "adamw": f"2 moments x {elem} B",
        "adamw-8bit": "2 moments x 1 B + fp32 absmax per 256 (tensors < 4096 elems: 2 x 4 B)",
        "paged-adamw-8bit": "2 x 1 B + absmax per 256, paged (can spill to CPU under pressure)",
        "adafactor": "factored fp32 row + column second moments",
    }[optimizer]
    return f"{human_count(trainable)} trainable: {per}"


def _layer_formula(terms: list[tuple[str, float]], tokens: int) -> str:
    per_token = sum(v for _, v in terms)
    return f"{per_token:,.0f} B/token x {tokens:,} tokens"


def _lora_shapes(
    model: ModelInfo, rank: int, targets: tuple[str, ...]
) -> list[tuple[tuple[int, ...], int]]:
    """Shapes of the LoRA A (r x in) and B (out x r) matrices."""
    shapes: list[tuple[tuple[int, ...], int]] = []
    for group in model.params:
        if not group.pattern.endswith("weight") or len(group.shape) != 2:
            continue
        path = group.pattern.rsplit(".", 1)[0]
        if any(path == t or path.endswith("." + t) for t in targets):
            d0, d1 = group.shape
            shapes += [((rank, d1), group.count), ((d0, rank), group.count)]
    return shapes


def _largest_layer_params(model: ModelInfo) -> int:
    """Parameters of one repeated layer (those whose pattern has a ``*``), or the largest."""
    layer = sum(g.numel for g in model.params if "*" in g.pattern)
    return layer or max((g.total for g in model.params), default=0)
