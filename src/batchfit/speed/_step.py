"""What a step computes, whatever it runs on: its FLOPs a token (``step_flops``), the trainable
parameters, and the ``StepTime`` value the GPU model (``batchfit.speed``) and the CPU model
(``_cpu``) both return."""

from __future__ import annotations

from dataclasses import dataclass

from batchfit.models import ModelInfo
from batchfit.spec import TrainingSetup


@dataclass(frozen=True)
class StepTime:
    """Predicted seconds of a step: ``micro_seconds`` per micro-step (forward and backward),
    ``optimizer_seconds`` once per optimizer step; the rest follows for any accumulation."""

    micro_seconds: float
    optimizer_seconds: float
    tokens_per_micro_step: int  # an image model's: its images
    model_flops_per_token: float  # 6 x matmul params (4 under LoRA) + attention, no recompute
    peak_flops: float  # the dense peak of the step's dtype on this GPU
    # parts of the two above, for the output: communication compute does not hide (per
    # micro-step, and once per step), and CPU offload's transfers and CPU update per step
    comm_micro_seconds: float = 0.0
    comm_step_seconds: float = 0.0
    offload_seconds: float = 0.0
    # CPU offload in each micro-step: the parameters' copies up (ZeRO-Infinity, in
    # micro_seconds), and when accumulating, the gradients accumulated in CPU RAM down and up
    # again in every micro-step but the last (DeepSpeed's async_accumulate_grad_in_cpu_via_gpu)
    offload_micro_seconds: float = 0.0
    offload_accum_seconds: float = 0.0

    def step_seconds(self, grad_accum_steps: int = 1) -> float:
        """One optimizer step: ``grad_accum_steps`` micro-steps and the optimizer's update."""
        accumulating = self.offload_accum_seconds * (grad_accum_steps - 1)
        return self.micro_seconds * grad_accum_steps + accumulating + self.optimizer_seconds

    def to_json(self, grad_accum_steps: int = 1) -> dict[str, float]:
        """``step_seconds``, ``tokens_per_s_per_gpu`` and ``mfu`` (model FLOPs over the peak),
        and the parts of the step spent on communication compute does not hide
        (``comm_seconds``) and on CPU offload (``offload_seconds``)."""
        step = self.step_seconds(grad_accum_steps)
        tokens = self.tokens_per_micro_step * grad_accum_steps
        return {
            "step_seconds": step,
            "tokens_per_s_per_gpu": tokens / step,
            "mfu": self.model_flops_per_token * tokens / (step * self.peak_flops),
            "comm_seconds": self.comm_micro_seconds * grad_accum_steps + self.comm_step_seconds,
            "offload_seconds": self.offload_seconds
            + self.offload_micro_seconds * grad_accum_steps
            + self.offload_accum_seconds * (grad_accum_steps - 1),
        }


def _matmul_params(model: ModelInfo) -> float:
    """Parameters a token multiplies by in forward: the matmul weights (experts: the routed
    share), and a tied head's embedding, which the head multiplies by too."""
    kinds = model.params_by_kind()
    arch = model.arch
    dense = float(sum(v for k, v in kinds.items() if k in ("attention", "mlp", "other", "head")))
    experts = kinds.get("experts", 0)
    if experts and arch.num_experts:
        dense += experts * arch.experts_per_token / arch.num_experts
    # a tied head counts as embedding; a masked LM's head group (BERT's transform: a dense
    # layer, a norm, the decoder's bias) holds no vocab-sized matrix either: its decoder is tied
    vocab_matrix = arch.vocab_size * arch.hidden_size
    if model.task in ("causal-lm", "masked-lm") and kinds.get("head", 0) < vocab_matrix:
        dense += vocab_matrix
    return dense


@dataclass(frozen=True)
class StepFlops:
    """FLOPs of a micro-step, per token: what the device computes (``per_token``: forward,
    backward, recompute) and the model FLOPs MFU counts (``model_per_token``)."""

    per_token: float
    model_per_token: float  # 6 x matmul params (4 under LoRA) + attention, no recompute
    backward_share: float  # of per_token: backward and recompute
    layers: int
    recompute_share: float  # checkpointed layers over all layers
    # bytes the operators other than matmuls, convolutions and attention move, per token
    # (counted by a dry run; 0: in the utilisation, as the formulas' calibration has them)
    bytes_per_token: float = 0.0
    # what the method adds to a full fine-tune's step (``method_costs``): kernels launched,
    # as a multiple of a full fine-tune's; LoRA adapters' memory traffic a token; QLoRA's
    # dequantisation traffic a micro-step
    launch_scale: float = 1.0
    adapter_bytes_per_token: float = 0.0
    dequant_bytes: float = 0.0


def step_flops(model: ModelInfo, setup: TrainingSetup, seq_len: int) -> StepFlops:
    """FLOPs per token of one training micro-step of ``model`` at ``seq_len`` under ``setup``.

    Example:
        >>> from batchfit.models import resolve_model
        >>> f = step_flops(resolve_model("gpt2"), TrainingSetup(), 1024)
        >>> round(f.model_per_token / 1e6)  # 6 x 124M matmul params + attention
        798
    """
    arch = model.arch
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
    # checkpointed layers run their forward again in backward (the head and loss do not)
    recompute_share = setup.checkpointed_layers(layers) / max(layers, 1)
    recompute = (forward - 2.0 * _head_params(model)) * recompute_share
    per_token = forward + backward + recompute
    costs = method_costs(model, setup, recompute_share)
    return StepFlops(
        per_token=per_token,
        model_per_token=(6.0 if full else 4.0) * mm_params + 3 * attn,
        backward_share=(backward + recompute) / per_token,
        layers=layers,
        recompute_share=recompute_share,
        launch_scale=costs.launch_scale,
        adapter_bytes_per_token=costs.adapter_bytes_per_token,
        dequant_bytes=costs.dequant_bytes,
    )


# Kernels one decoder layer launches in a micro-step, forward and backward: aten operators
# other than views, counted in a dry run of a llama-3.2-1b layer (transformers 5.24, peft
# 0.21.2, torch 2.13, autocast bf16): 137 in a full fine-tune. peft's LoRA ``Linear.forward``
# (tuners/lora/layer.py) runs ``result + lora_B(lora_A(dropout(x))) * scaling`` beside the
# base layer: 18 more kernels an adapted module forward and backward, 4 more with dropout; a
# frozen linear computes no weight gradient, and a 16-bit one is not cast under autocast: 5
# fewer (3 for an fp32 one). The layer counted 136 with q,v adapters on a bf16 base, 226
# with all seven linears adapted, 254 with dropout; on an fp32 base 151 and 235. Each 4-bit
# linear dequantises its weight in forward and again for backward's input gradient
# (bitsandbytes ``MatMul4Bit``: ``dequantize_4bit`` in both): 2 more. A fused-expert MoE
# layer (transformers 5's grouped GEMMs: a mixtral layer counted 169) 32 more.
LAYER_OPS = 137
LORA_OPS = 18
LORA_DROPOUT_OPS = 4
FROZEN_OPS = {"cast": 5, "plain": 3}
DEQUANT_OPS = 2
MOE_GROUPED_OPS = 32
# bitsandbytes' ``dequantize_4bit`` reads the packed NF4 weight (half a byte a parameter) and
# writes it in the 16-bit compute dtype (2 bytes), once in forward, once for backward's input
# gradient, and again in a recomputed forward
DEQUANT_BYTES_PER_PARAM = 2.5
# autocast's cast of an fp32 weight: 4 bytes read, 2 written
CAST_BYTES_PER_PARAM = 6


@dataclass(frozen=True)
class MethodCosts:
    """What a method adds to a full fine-tune's micro-step (``StepFlops``' fields)."""

    launch_scale: float = 1.0
    adapter_bytes_per_token: float = 0.0
    dequant_bytes: float = 0.0


def method_costs(model: ModelInfo, setup: TrainingSetup, recompute_share: float) -> MethodCosts:
    """The kernels and memory traffic LoRA's adapters, QLoRA's dequantisation and a fused MoE
    layer add to a micro-step (per token for the adapters, per micro-step for dequantisation;
    a recomputed forward runs its share again).

    An adapted module of ``in`` inputs and ``out`` outputs moves, a token, at ``e`` bytes an
    activation element (2 in 16-bit, 4 in fp32) and with dropout ``d`` (0 or 1, its mask a
    byte an element): forward ``in x e x (1 + 2d) + d x in + 6 x out x e`` (dropout reads and
    writes its input, A reads it; B writes its output, the scaling reads and writes it, the
    sum reads two and writes one), backward ``in x e x (5 + 2d) + d x in + 4 x out x e`` (the
    scaling's and B's gradients, A's input gradient and its weight gradient's read of x, the
    dropout's backward, and the sum of the base layer's and the adapter's input gradients).
    The rank's terms are left out (r is small against in and out). A module inside the
    experts of an MoE layer sees the routed share of the tokens.

    Example:
        >>> from batchfit.models import resolve_model
        >>> m = resolve_model("mistral-7b")
        >>> c = method_costs(m, TrainingSetup(method="lora", precision="amp-bf16",
        ...     lora_targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
        ...                   "down_proj"), lora_dropout=0.05), 0.0)
        >>> round(c.adapter_bytes_per_token / 1e6, 1), round(c.launch_scale, 2)  # counted 1.85
        (54.9, 1.87)
    """
    if not setup.is_lora:
        extra_ops = MOE_GROUPED_OPS if model.fused_expert_params() else 0
        return MethodCosts(launch_scale=1 + extra_ops / LAYER_OPS)
    arch = model.arch
    layers = max(arch.num_layers + arch.num_decoder_layers, 1)
    e = 4 if setup.precision == "fp32" else 2
    d = 1 if setup.lora_dropout > 0 else 0
    adapter_bytes = 0.0
    adapted = 0
    for group in model.lora_groups(setup.lora_targets):
        out_dim, in_dim = group.shape[:2]
        routed = 1.0
        if group.kind == "experts" and arch.num_experts:
            routed = arch.experts_per_token / arch.num_experts
        forward = in_dim * e * (1 + 2 * d) + d * in_dim + 6 * out_dim * e
        backward = in_dim * e * (5 + 2 * d) + d * in_dim + 4 * out_dim * e
        adapter_bytes += (forward * (1 + recompute_share) + backward) * routed * group.count
        adapted += group.count
    linears = sum(g.count for g in model.linear_weights())
    # a 16-bit frozen base under autocast is not cast (``--frozen-dtype``, auto: the 16-bit
    # dtype a 16-bit precision loads it in)
    amp = setup.precision in ("amp-bf16", "amp-fp16")
    frozen = FROZEN_OPS["cast" if amp and setup.frozen_dtype != "fp32" else "plain"]
    ops = adapted * (LORA_OPS + d * LORA_DROPOUT_OPS) - linears * frozen
    dequant = 0.0
    if setup.method == "qlora":
        quantized = model.quantizable_params()
        ops += DEQUANT_OPS * linears
        dequant = DEQUANT_BYTES_PER_PARAM * quantized * (2 + recompute_share)
    # an fp32 frozen weight under autocast is cast to 16 bits in every forward (backward
    # reuses the copy it saved): a LoRA base kept in fp32, and what peft's
    # prepare_model_for_kbit_training upcasts around a 4-bit base (the output head, and the
    # fused MoE experts bitsandbytes leaves unquantised: most of an MoE's weights)
    if amp and setup.method == "lora" and setup.frozen_dtype == "fp32":
        dequant += CAST_BYTES_PER_PARAM * _matmul_params(model) * (1 + recompute_share)
    elif amp and setup.kbit_upcast:
        upcast = model.fused_expert_params() + _head_params(model)
        dequant += CAST_BYTES_PER_PARAM * upcast * (1 + recompute_share)
    if model.fused_expert_params():
        ops += MOE_GROUPED_OPS * layers
    return MethodCosts(
        launch_scale=max(1 + ops / (LAYER_OPS * layers), 0.5),
        adapter_bytes_per_token=adapter_bytes,
        dequant_bytes=dequant,
    )


def _head_params(model: ModelInfo) -> float:
    """Parameters of the output head a token multiplies by (not in any checkpointed layer)."""
    if model.task not in ("causal-lm", "masked-lm"):
        return 0.0
    return float(model.arch.vocab_size * model.arch.hidden_size)


def model_trainable(model: ModelInfo, setup: TrainingSetup) -> float:
    """Trainable parameters: all of them, or LoRA's adapters."""
    if setup.method == "full":
        return float(model.total_params)
    return float(model.lora_params(setup.lora_rank, setup.lora_targets))


def traced_step_flops(
    model: ModelInfo, setup: TrainingSetup, flops_per_sample: tuple[float, ...]
) -> StepFlops:
    """``step_flops`` from what the dry run counted (each sample's forward FLOPs, its backward
    FLOPs with any recompute, then the bytes the other operators move forward and backward),
    per sample: an image model's "tokens" are its images.

    Example:
        >>> from batchfit.models import resolve_model
        >>> vit = resolve_model("vit-base-patch16-224", task="image-classification")
        >>> f = traced_step_flops(vit, TrainingSetup(), (35.1e9, 70.2e9, 1e8, 2e8))
        >>> round(f.per_token / 1e9, 1), round(f.backward_share, 3), f.bytes_per_token
        (105.3, 0.667, 300000000.0)
    """
    forward, backward = flops_per_sample[0], flops_per_sample[1]
    moved = sum(flops_per_sample[2:4])
    layers = model.arch.num_layers
    full = setup.method == "full"
    recompute_share = setup.checkpointed_layers(layers) / max(layers, 1)
    return StepFlops(
        per_token=forward + backward,
        # model FLOPs: forward, and a backward of twice the forward (once without weight
        # gradients), without the recompute
        model_per_token=(3.0 if full else 2.0) * forward,
        backward_share=backward / (forward + backward),
        layers=layers,
        recompute_share=recompute_share,
        bytes_per_token=moved,
    )
