"""Step time of a training step on one GPU: FLOPs of the step, an achievable utilisation, the
optimizer step as memory traffic, and a per-layer launch overhead (issue #13, first part).

The model, per optimizer micro-step::

    seconds = layers x launch + FLOPs / (peak x utilisation(width)) + optimizer bytes / bandwidth

Calibrated on three step-time sweeps on an H100 (``benchmarks/data/gpu_validate_h100.json``:
llama-3.2-1b, qwen2.5-0.5b, gpt2 at several micro-batches) and checked on the 25 other cases
measured there (``docs/benchmarks.md``). One GPU only: communication is not modelled yet, and
the estimate says so (``step_seconds`` is None with several GPUs).
"""

from __future__ import annotations

from dataclasses import dataclass

from batchfit.hardware import GpuSpec
from batchfit.models import ModelInfo
from batchfit.spec import TrainingSetup

# Utilisation of the tensor cores' dense peak that a step's matmuls reach, by generation: the
# ceiling for wide models. Hopper 0.50: llama-3.2-1b (width 2048) reached 0.35 at the margin on
# an H100 (0.50 x 2048 / (2048 + 900)); DESIGN.md's published H100 runs sit at 0.34-0.46 and
# A100 runs at 0.54-0.68 (wider models), hence Ampere 0.62. Others: between, a guess.
U_MAX = {
    "volta": 0.55,
    "turing": 0.5,
    "ampere": 0.62,
    "ada": 0.55,
    "hopper": 0.5,
    "blackwell": 0.45,
    "cdna2": 0.45,
    "cdna3": 0.45,
}
# Width at which a model reaches half the ceiling (narrow matmuls underuse the GPU):
# qwen2.5-0.5b (width 896) reached 0.30 at the margin on the H100, llama-3.2-1b (2048) 0.35.
HALF_WIDTH = 900
# fp32 matmuls run on the CUDA cores (PyTorch's default, allow_tf32=False): gpt2 reached 0.54
# of the H100's 67 TFLOP/s non-tensor peak.
U_FP32 = 0.54
# The GPU waits on Python and kernel launches: seconds per layer per micro-step, from the
# sweeps' intercepts after the optimizer step (llama-3.2-1b 2.7 ms, qwen2.5-0.5b 3.6 ms under
# autocast; gpt2 fp32 1.5 ms; casts add kernels).
LAUNCH_S_PER_LAYER = {"amp": 3.0e-3, "plain": 1.5e-3}
# The optimizer step streams its tensors once (memory-bound): AdamW reads weights, gradients
# and two moments and writes three of them back; PyTorch's foreach variant also writes and
# reads a square-root temporary. Bytes per trainable parameter at 4-byte elements.
OPTIMIZER_ACCESSES = {
    "adamw": 7,
    "adam": 7,
    "sgd": 3,
    "sgd-momentum": 5,
    "lion": 5,
    "adafactor": 4,
    "adamw-8bit": 4,
    "paged-adamw-8bit": 4,
}
BANDWIDTH_EFFICIENCY = 0.8  # of the catalog's peak bandwidth, for long streaming kernels


@dataclass(frozen=True)
class StepTime:
    """Predicted seconds of a step: ``micro_seconds`` per micro-step (forward and backward),
    ``optimizer_seconds`` once per optimizer step; the rest follows for any accumulation."""

    micro_seconds: float
    optimizer_seconds: float
    tokens_per_micro_step: int
    model_flops_per_token: float  # 6 x matmul params (4 under LoRA) + attention, no recompute
    peak_flops: float  # the dense peak of the step's dtype on this GPU

    def step_seconds(self, grad_accum_steps: int = 1) -> float:
        """One optimizer step: ``grad_accum_steps`` micro-steps and the optimizer's update."""
        return self.micro_seconds * grad_accum_steps + self.optimizer_seconds

    def to_json(self, grad_accum_steps: int = 1) -> dict[str, float]:
        """``step_seconds``, ``tokens_per_s_per_gpu`` and ``mfu`` (model FLOPs over the peak)."""
        step = self.step_seconds(grad_accum_steps)
        tokens = self.tokens_per_micro_step * grad_accum_steps
        return {
            "step_seconds": step,
            "tokens_per_s_per_gpu": tokens / step,
            "mfu": self.model_flops_per_token * tokens / (step * self.peak_flops),
        }


def _peak_flops(gpu: GpuSpec, precision: str) -> float | None:
    if precision == "fp32":
        return (gpu.fp32_tflops or 0) * 1e12 or None
    # GeForce fp16 figures are fp16-accumulate; training accumulates in fp32 as bf16 does
    peak = gpu.bf16_tflops_dense or gpu.fp16_tflops_dense
    return peak * 1e12 if peak else None


def _matmul_params(model: ModelInfo) -> float:
    """Parameters a token multiplies by in forward: the matmul weights (experts: the routed
    share), and a tied head's embedding, which the head multiplies by too."""
    kinds = model.params_by_kind()
    arch = model.arch
    dense = float(sum(v for k, v in kinds.items() if k in ("attention", "mlp", "other", "head")))
    experts = kinds.get("experts", 0)
    if experts and arch.num_experts:
        dense += experts * arch.experts_per_token / arch.num_experts
    if model.task in ("causal-lm", "masked-lm") and "head" not in kinds:
        dense += arch.vocab_size * arch.hidden_size
    return dense


def step_time(
    model: ModelInfo,
    setup: TrainingSetup,
    gpu: GpuSpec,
    *,
    micro_batch_size: int,
    seq_len: int,
) -> StepTime | None:
    """The predicted time of one optimizer step on ``gpu`` (``setup`` resolved), or None where
    the model does not apply: image models, several GPUs, offload, a GPU without a peak figure.

    Example:
        >>> from batchfit.hardware import get_gpu
        >>> from batchfit.models import resolve_model
        >>> t = step_time(resolve_model("llama-3.2-1b"), TrainingSetup(precision="amp-bf16"),
        ...               get_gpu("h100-80gb"), micro_batch_size=8, seq_len=2048)
        >>> 0.3 < t.step_seconds() < 0.5  # measured on an H100: 0.409 s
        True
    """
    arch = model.arch
    if arch.family == "vision" or setup.num_gpus > 1 or setup.offload != "none":
        return None
    peak = _peak_flops(gpu, setup.precision)
    if peak is None or not gpu.bandwidth_gb_s:
        return None
    tokens = micro_batch_size * seq_len
    mm_params = _matmul_params(model)
    layers = arch.num_layers + (arch.num_decoder_layers if arch.family == "encoder-decoder" else 0)
    attn_width = arch.num_heads * arch.head_dim
    # QK^T and PV: 2 matmuls of 2 x seq x width FLOPs a token and layer; causal flash kernels
    # skip the masked half (eager attention computes it all)
    causal = arch.family == "decoder"
    attn = (
        4.0 * seq_len * attn_width * layers * (0.5 if causal and setup.attention != "eager" else 1)
    )
    forward = 2.0 * mm_params + attn
    full = setup.method == "full"
    # backward: input gradients (1 x forward) always; weight gradients (1 x) when trained;
    # attention's backward is about twice its forward
    backward = 2.0 * mm_params * (2 if full else 1) + 2 * attn
    recompute = forward if setup.grad_ckpt else 0.0
    flops_per_token = forward + backward + recompute
    model_flops_per_token = (6.0 if full else 4.0) * mm_params + 3 * attn
    width = arch.hidden_size
    if setup.precision == "fp32":
        util = U_FP32
    else:
        util = U_MAX.get(gpu.architecture, 0.5) * width / (width + HALF_WIDTH)
    amp = setup.precision in ("amp-bf16", "amp-fp16")
    launch = LAUNCH_S_PER_LAYER["amp" if amp else "plain"] * layers
    compute = flops_per_token * tokens / (peak * util)
    element = 2 if setup.precision in ("bf16", "fp16") else 4
    opt_bytes = OPTIMIZER_ACCESSES.get(setup.optimizer, 7) * element * model_trainable(model, setup)
    return StepTime(
        micro_seconds=launch + compute,
        optimizer_seconds=opt_bytes / (gpu.bandwidth_gb_s * 1e9 * BANDWIDTH_EFFICIENCY),
        tokens_per_micro_step=tokens,
        model_flops_per_token=model_flops_per_token,
        peak_flops=peak,
    )


def model_trainable(model: ModelInfo, setup: TrainingSetup) -> float:
    """Trainable parameters: all of them, or LoRA's adapters."""
    if setup.method == "full":
        return float(model.total_params)
    return float(model.lora_params(setup.lora_rank, setup.lora_targets))
