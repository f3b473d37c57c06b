"""The technique ladder: what to switch on, in order, when a model does not fit (docs/design.md).

A ``Technique`` is a value that carries its name, its kind (``exact``: the same training, only
slower or spread wider; ``changes-training``: what is learned differs) and the change it makes
to a ``TrainingSetup``. ``ladder`` lists the combinations to try, exact ones first, cheapest in
time first.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import reduce
from typing import Literal

from batchfit._units import ordinal
from batchfit.errors import UsageError
from batchfit.frameworks import adapter_defaults
from batchfit.hardware import GpuSpec
from batchfit.models import ModelInfo
from batchfit.optimizers import get_optimizer
from batchfit.spec import TrainingSetup

Kind = Literal["exact", "changes-training"]
Combo = tuple["Technique", ...]


@dataclass(frozen=True)
class Technique:
    """A rung of the ladder: ``exact`` ones change nothing about what is learned."""

    name: str
    kind: Kind
    why: str
    transform: Callable[[TrainingSetup], TrainingSetup] = field(compare=False, repr=False)
    # the code the run needs for it, which the framework's config cannot switch on: such a
    # technique is offered as an alternative, never chosen ("": the config switches it on)
    needs: str = ""

    def __call__(self, setup: TrainingSetup) -> TrainingSetup:
        """The setup with this technique switched on."""
        return self.transform(setup)


GRAD_CKPT = Technique(
    "gradient-checkpointing",
    "exact",
    "recompute each layer in backward",
    lambda s: replace(s, grad_ckpt=True),
)
# Options whose predicted step times are this close are a tie: the time model is 10-20% off
# at the median on published runs (docs/benchmarks.md), so the simpler option goes first.
TIME_TOLERANCE = 0.05
OFFLOADS = frozenset({"offload-optimizer", "offload-optimizer+params", "fsdp-cpu-offload"})
# CPU offload wins a time ranking only when predicted this much faster than the best option
# without it: its CPU Adam step runs on the host's cores, which batchfit does not know (the
# time model assumes a typical server CPU), and its PCIe traffic competes with other ranks
OFFLOAD_MARGIN = 0.25

# every K-th layer, K tried by the planner when full checkpointing fits (``partial_ckpt``)
PARTIAL_CKPT_EVERY = (2, 3, 4)
# Whether a run's config can checkpoint a chosen set of layers is the framework preset's
# trait (``Preset.selects_ckpt_layers``): torchtune can (selective ``ac_option: K``, as
# torchtitan's per-layer mode). HF Trainer's (the default), Lightning's, accelerate's and
# axolotl's switch (gradient_checkpointing_enable) wraps every layer, and no export here can
# name layers, so under those presets every K-th layer is an alternative that needs code.


def partial_ckpt(
    every: int, num_layers: int | None = None, *, selectable: bool = True
) -> Technique:
    """Checkpointing of every ``every``-th layer (``TrainingSetup.grad_ckpt_every``): less
    recompute than ``GRAD_CKPT``, less memory saved. ``selectable=False``: the framework's
    config wraps every layer, so the technique carries the code it needs.

    Example:
        >>> partial_ckpt(2, 32).name, partial_ckpt(2, 32).why
        ('gradient-checkpointing-every-2', 'recompute every 2nd layer in backward (16 of 32)')
        >>> partial_ckpt(2, 32, selectable=False).needs.split(" transformer")[0]
        'code: wrap every 2nd'
    """
    count = f" ({num_layers // every} of {num_layers})" if num_layers else ""
    needs = (
        ""
        if selectable
        else f"code: wrap every {ordinal(every)} transformer layer's forward in "
        "torch.utils.checkpoint yourself (gradient_checkpointing=True wraps every layer)"
    )
    return Technique(
        f"gradient-checkpointing-every-{every}",
        "exact",
        f"recompute every {ordinal(every)} layer in backward{count}",
        lambda s: replace(s, grad_ckpt=True, grad_ckpt_every=every),
        needs,
    )


FUSED_ADAMW = Technique(
    "fused-adamw",
    "exact",
    "torch's fused AdamW kernel (fused=True; TrainingArguments optim adamw_torch_fused): the "
    "same update without foreach's fp32 temporary of every parameter during step()",
    lambda s: replace(s, optimizer_impl="fused"),
)
FUSED_LOSS = Technique(
    "fused-loss",
    "exact",
    "Liger's fused linear cross-entropy: no logits held (TrainingArguments use_liger_kernel)",
    lambda s: replace(s, loss="fused"),
)
CHUNKED_LOSS = Technique(
    "chunked-loss",
    "exact",
    "head and loss per chunk of tokens (torchtune LinearCrossEntropyLoss, axolotl "
    "chunked_cross_entropy)",
    lambda s: replace(s, loss="chunked"),
)
# The model types Liger patches (liger_kernel/transformers/monkey_patch.py,
# MODEL_TYPE_TO_APPLY_LIGER_FN, at ead96b61 of 2026-08-21); others get the chunked loss.
LIGER_TYPES = frozenset(
    [
        "deepseek_v4",
        "gemma",
        "gemma2",
        "gemma3_text",
        "gemma3",
        "gemma4_text",
        "gemma4",
        "glm4",
        "glm4v",
        "glm4v_moe",
        "gpt_oss",
        "internvl",
        "llama",
        "llama4_text",
        "llama4",
        "llava",
        "granite",
        "mllama",
        "mllama_text_model",
        "ministral",
        "mistral",
        "mixtral",
        "nemotron",
        "olmo2",
        "pixtral",
        "olmo3",
        "qwen2",
        "qwen3",
        "qwen3_moe",
        "qwen2_vl",
        "qwen2_vl_text",
        "qwen2_5_vl",
        "qwen2_5_vl_text",
        "qwen3_next",
        "qwen3_5",
        "qwen3_5_text",
        "qwen3_5_moe",
        "qwen3_5_moe_text",
        "qwen3_vl",
        "qwen3_vl_text",
        "qwen3_vl_moe",
        "qwen3_vl_moe_text",
        "smollm3",
        "phi3",
        "paligemma",
        "falcon_h1",
        "smolvlm",
        "hunyuan_v1_dense",
        "hunyuan_v1_moe",
        "exaone4",
    ]
)


def lean_loss(model: ModelInfo | None, setup: TrainingSetup) -> Technique | None:
    """The loss rung for ``model``: fused where Liger supports the model type, else chunked;
    None for a classification head, a loss that is already lean or one the user fixed. Where
    the framework's config cannot switch it on (``Preset.liger_switch``,
    ``Preset.chunked_switch``), the technique carries the code it needs.

    Example:
        >>> from batchfit.models import resolve_model
        >>> lean_loss(resolve_model("gpt2"), TrainingSetup()).needs.split(":")[0]
        'code'
        >>> lean_loss(resolve_model("gpt2"), TrainingSetup(framework="axolotl")).needs
        ''
    """
    heads = ("classification", "image-classification")  # a label per sample: no vocabulary
    if model is None or model.task in heads or setup.loss != "full" or setup.keep_loss:
        return None
    conventions = setup.conventions
    if model.arch.model_type in LIGER_TYPES:
        if conventions.liger_switch:
            return FUSED_LOSS
        return replace(FUSED_LOSS, needs=LIGER_NEEDS)
    return CHUNKED_LOSS if conventions.chunked_switch else replace(CHUNKED_LOSS, needs=CHUNK_NEEDS)


LIGER_NEEDS = (
    "code: liger_kernel.transformers' apply_liger_kernel_to_<model type>() before the model "
    "is built (the framework's config has no switch for it)"
)
CHUNK_NEEDS = (
    "code: a loss that runs the output head and the cross-entropy per chunk of tokens "
    "(the framework's config has no switch for it; Liger has no kernel for this model type)"
)


ZeroStage = Literal["zero1", "zero2", "zero3"]
_ZERO_STAGES: tuple[ZeroStage, ...] = ("zero1", "zero2", "zero3")
_SHARDINGS = frozenset({*_ZERO_STAGES, "fsdp"})  # the rungs that shard, without offload


def zero(stage: ZeroStage, why: str) -> Technique:
    """Shard optimizer state (1), also gradients (2), also weights (3) over the GPUs."""
    return Technique(stage, "exact", why, lambda s: replace(s, sharding=stage))


OFFLOAD_OPTIMIZER = Technique(
    "offload-optimizer",
    "exact",
    "optimizer state in CPU RAM",
    lambda s: replace(s, offload="optimizer"),
)
OFFLOAD_ALL = Technique(
    "offload-optimizer+params",
    "exact",
    "optimizer state and weights in CPU RAM",
    lambda s: replace(s, offload="optimizer+params"),
)
FSDP = Technique(
    "fsdp",
    "exact",
    "FSDP2: weights, gradients and optimizer state sharded across the GPUs",
    lambda s: replace(s, sharding="fsdp"),
)
FSDP_OFFLOAD = Technique(
    "fsdp-cpu-offload",
    "exact",
    "FSDP2's CPUOffloadPolicy: weights, gradients and optimizer state in CPU RAM",
    lambda s: replace(s, sharding="fsdp", offload="optimizer+params"),
)


ADAMW_8BIT = Technique(
    "adamw-8bit",
    "changes-training",
    "8-bit optimizer states",
    lambda s: replace(s, optimizer="adamw-8bit"),
)


def swap_optimizer(name: str) -> Technique:
    """Train with ``name``, the lighter optimizer the setup's registered spec names."""
    return Technique(
        name,
        "changes-training",
        get_optimizer(name).summary,
        lambda s: replace(s, optimizer=name),
    )


PURE_BF16 = Technique(
    "pure-bf16",
    "changes-training",
    "bf16 weights and states, no fp32 master",
    lambda s: replace(s, precision="bf16"),
)


def _to_lora(s: TrainingSetup) -> TrainingSetup:
    return replace(s, method="lora", **adapter_defaults(s))  # the preset's adapter dtype


LORA = Technique("lora", "changes-training", "train low-rank adapters", _to_lora)


def qlora(gpu: GpuSpec) -> Technique:
    """4-bit frozen base + adapters, computing in 16-bit: bf16 where ``gpu`` has it, else fp16."""

    def to_qlora(s: TrainingSetup) -> TrainingSetup:
        precision = s.precision
        # "auto" under a pure-bf16 preset stays: it resolves to the preset's bf16 (the ladder
        # offers QLoRA there only on a GPU with bf16)
        pure_preset = s.conventions.pure_bf16 and precision == "auto"
        if precision in ("auto", "fp32") and not pure_preset:
            precision = "amp-bf16" if gpu.bf16 else "amp-fp16"
        return replace(
            s,
            **adapter_defaults(s),
            method="qlora",
            precision=precision,
            sharding="none" if s.sharding in ("zero3", "fsdp") else s.sharding,
            offload="none",
        )

    return Technique("qlora", "changes-training", "4-bit frozen base + adapters", to_qlora)


def apply(setup: TrainingSetup, techniques: Combo) -> TrainingSetup:
    """The setup with the techniques switched on, in order."""
    return reduce(lambda s, t: t(s), techniques, setup)


def _exact_rungs(setup: TrainingSetup, base: Combo) -> list[Combo]:
    rungs: list[Combo] = []
    if not setup.conventions.plans_deepspeed:
        # torchtune shards with FSDP2 and litgpt's finetune scripts with Fabric's FSDPStrategy
        # (their presets' sources); neither plans DeepSpeed, and their single-device recipes
        # shard and offload nothing
        if setup.can_shard:
            rungs.append((*base, FSDP))
            if setup.can_offload:
                rungs.append((*base, FSDP_OFFLOAD))
        return rungs
    if setup.can_shard:
        why = f"shard across {setup.num_gpus} GPUs"
        rungs += [(*base, zero(stage, why)) for stage in _ZERO_STAGES]
        rungs.append((*base, FSDP))
    if setup.can_offload:
        if setup.sharding == "fsdp":  # FSDP2 asked: its own offload, not DeepSpeed's
            rungs.append((*base, FSDP_OFFLOAD))
            return rungs
        rungs.append((*base, zero("zero2", "ZeRO-Offload needs ZeRO"), OFFLOAD_OPTIMIZER))
        rungs.append((*base, zero("zero3", "parameter offload needs ZeRO-3"), OFFLOAD_ALL))
    return rungs


def _changing_rungs(setup: TrainingSetup, gpu: GpuSpec, base: Combo) -> list[Combo]:
    changing: list[Technique] = []
    lighter = get_optimizer(setup.optimizer).lighter
    if lighter is not None:
        changing.append(ADAMW_8BIT if lighter == ADAMW_8BIT.name else swap_optimizer(lighter))
    if setup.can_switch_to_pure_bf16(gpu.bf16):
        changing.append(PURE_BF16)
    rungs: list[Combo] = [(*base, tech) for tech in changing]
    if len(changing) == 2:
        rungs.append((*base, *changing))
    if setup.can_switch_to_lora:
        rungs.append((*base, LORA))
    if setup.can_switch_to_qlora(gpu.bf16):
        rungs.append((*base, qlora(gpu)))
    return rungs


def ladder(
    setup: TrainingSetup,
    gpu: GpuSpec,
    model: ModelInfo | None = None,
    *,
    checkpointing: bool = True,
) -> tuple[Combo, ...]:
    """Technique combinations to try, exact ones first, cheapest in time first (docs/design.md).

    A lean loss (``model``'s: fused or chunked; it costs no time) comes first, then gradient
    checkpointing (recompute: about a fifth of the step), and both stay on under every later
    rung. ``checkpointing=False``: a model batchfit cannot checkpoint (your own module, which
    checkpoints itself) gets the ladder without it.

    Example:
        >>> from batchfit.hardware import get_gpu
        >>> from batchfit.models import resolve_model
        >>> rungs = ladder(TrainingSetup(), get_gpu("t4"), resolve_model("llama-3.2-1b"))
        >>> for combo in rungs[:3]:
        ...     print(" + ".join(t.name for t in combo))
        fused-adamw
        fused-loss
        fused-loss + gradient-checkpointing
    """
    loss = lean_loss(model, setup)
    offered: list[Combo] = []  # a lean loss that needs code: offered, never chosen
    if loss is not None and loss.needs:
        offered = [(loss,)]
        if checkpointing and not setup.grad_ckpt:
            offered.append((loss, GRAD_CKPT))
        loss = None
    base: Combo = () if loss is None else (loss,)
    first: list[Combo] = [base] if base else []
    if get_optimizer(setup.optimizer).fused_first and setup.optimizer_impl in ("auto", "foreach"):
        # PyTorch's default on CUDA is foreach (torch/optim/optimizer.py), whose step holds an
        # fp32 copy of every parameter; fused costs no time, so it is tried first, alone (later
        # rungs change where the peak is, and DeepSpeed's bring their own fused optimizer)
        first.insert(0, (FUSED_ADAMW,))
    sharded: list[Combo] = []
    if checkpointing and not setup.grad_ckpt:
        if setup.can_shard:
            # sharding alone, before sharding with recompute: on 8 GPUs ZeRO-3 or FSDP2 often
            # fits a few samples without checkpointing, faster than any checkpointed option
            sharded = [r for r in _exact_rungs(setup, base) if r[-1].name in _SHARDINGS]
        base = (*base, GRAD_CKPT)
        first.append(base)
    changing = _changing_rungs(setup, gpu, base)
    combos = (*first, *sharded, *_exact_rungs(setup, base), *offered, *changing)
    return tuple(c for c in combos if _accepted(setup, c))


def _accepted(setup: TrainingSetup, combo: Combo) -> bool:
    """Whether the setup takes ``combo`` (an optimizer may refuse a sharding, QLoRA fp32, ...)."""
    try:
        apply(setup, combo)
    except UsageError:
        return False
    return True
