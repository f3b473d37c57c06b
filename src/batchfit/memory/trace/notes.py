"""What a dry run emulates or leaves out, in words: the notes an estimate carries."""

from __future__ import annotations

from batchfit.memory.formulas.qlora import qlora_notes
from batchfit.memory.trace.fsdp import is_fsdp
from batchfit.models import ATTENTION_FREE_TYPES, ModelInfo
from batchfit.spec import TrainingSetup

__all__ = ["setup_notes"]


def setup_notes(model: ModelInfo, setup: TrainingSetup, device: str) -> list[str]:
    """What the dry run of ``model`` under ``setup`` emulates, or leaves out, on ``device``."""
    notes = []
    if device == "cuda" and model.arch.model_type in ATTENTION_FREE_TYPES:
        notes.append(
            "convolutions: cuDNN's workspaces (taken from the caching allocator, larger with "
            "torch.backends.cudnn.benchmark) are not counted"
        )
    if is_fsdp(setup):
        notes.append(_fsdp_note(setup))
    if model.arch.num_experts:
        notes.append(
            f"MoE: {model.arch.num_experts} experts, {model.arch.experts_per_token} per token; "
            "each routed token-expert pair is one row of transformers' grouped expert matmul, "
            "so memory follows the routed total, not how the router spreads the tokens"
        )
    if setup.method == "qlora":
        notes += _qlora_notes(model, setup)
    return notes


def _fsdp_note(setup: TrainingSetup) -> str:
    """How FSDP is traced: one rank, its wrapping and mixed-precision policy, what counts."""
    if setup.fsdp_version == 1:
        low = setup.precision.removeprefix("amp-")
        mixed = (
            f"MixedPrecision({low} parameters, reductions and buffers), trainable flat "
            "parameters upcast to fp32 as accelerate does"
            if setup.precision.startswith("amp-")
            else "no mixed precision"
        )
        return (
            f"FSDP1: rank 0 of {setup.num_gpus} under a fake process group; "
            "FullyShardedDataParallel per decoder layer, then the root, use_orig_params=True, "
            f"FULL_SHARD, BACKWARD_PRE, {mixed}; the flat parameters' shards, their gradients "
            "and optimizer state are this rank's; gathered flat parameters and reduce-scatter "
            "buffers count as other"
        )
    policy = (
        f"MixedPrecisionPolicy(param_dtype={setup.precision.removeprefix('amp-')}, "
        "reduce_dtype=fp32) under autocast"
        if setup.precision.startswith("amp-")
        else "no mixed-precision policy (parameters gathered as stored)"
    )
    return (
        f"FSDP2: rank 0 of {setup.num_gpus} under a fake process group; fully_shard per "
        f"layer, then the root, reshard_after_forward=True, {policy}; parameters, gradients "
        "and optimizer state are this rank's shards; gathered parameters (the running "
        "layer, the prefetched one, the root's) and reduce-scatter buffers count as other"
    )


def _qlora_notes(model: ModelInfo, setup: TrainingSetup) -> list[str]:
    """How QLoRA's 4-bit linears are emulated, what stays unquantised, and in which dtype."""
    return [
        "QLoRA: bitsandbytes' 4-bit linears emulated (NF4 codes packed 2 per byte, "
        "double-quantised statistics, the 16-bit weight dequantised in forward and backward)",
        *qlora_notes(model, setup),
    ]
