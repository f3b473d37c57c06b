"""``TrainingSetup``: the one validated description of how a model is trained."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal, cast, get_args

from batchfit._units import ordinal
from batchfit.errors import UsageError
from batchfit.optimizers import get_optimizer, registered
from batchfit.presets import FRAMEWORKS, Preset, preset

# "image-classification": a transformers image model (ViT, ConvNeXt, Swin, CLIP vision) or a
# torchvision model; its per-sample size is the image side in pixels, not tokens.
Task = Literal["causal-lm", "classification", "masked-lm", "seq2seq", "image-classification"]
Precision = Literal["auto", "fp32", "amp-fp16", "amp-bf16", "bf16", "fp16"]
# An optimizer's name in batchfit.optimizers' registry (``OPTIMIZERS``): each registered spec
# says what it keeps, allocates, streams and exports, and the shardings it runs under.
Optimizer = str
OptimizerImpl = Literal["auto", "fused", "foreach", "for-loop"]
Method = Literal["full", "lora", "qlora"]
Attention = Literal["auto", "eager", "sdpa", "flash"]
Sharding = Literal["none", "ddp", "zero1", "zero2", "zero3", "fsdp"]
Offload = Literal["none", "optimizer", "optimizer+params"]
# What outlives forward: "trainer" (HF Trainer, TRL, Lightning: only the loss; the model's
# outputs die before backward) or "keep-outputs" (a hand loop that holds ``out`` through
# ``out.loss.backward()``: the HF course, nanoGPT). It decides one logits-sized tensor.
Loop = Literal["trainer", "keep-outputs"]
# How a language-model head's loss is computed. "full": the head's vocabulary-wide logits, then
# cross-entropy (transformers' ForCausalLMLoss upcasts them to fp32). "chunked": the head and
# the loss per chunk of the sequence, fp32 per chunk (torchtune's CEWithChunkedOutputLoss,
# litgpt's chunked_cross_entropy). "fused": Liger's fused linear cross-entropy, which never
# holds the logits: it computes the gradients of the head's input and weight chunk by chunk
# during forward and keeps those for backward.
LossKind = Literal["full", "chunked", "fused"]
# The dtype LoRA adapters are stored (and trained) in: peft upcasts them to fp32 by default
# (``autocast_adapter_dtype=True``); litgpt ``bf16-true`` keeps them in bf16.
LoraDtype = Literal["fp32", "bf16", "fp16"]
# The dtype of the frozen base under LoRA: "auto" = 16-bit under a 16-bit precision (a model
# loaded with ``torch_dtype``), fp32 under fp32; "fp32" as Lightning ``bf16-mixed`` keeps it.
FrozenDtype = Literal["auto", "fp32", "bf16", "fp16"]
DEFAULT_LOSS_CHUNKS = 8  # torchtune's LinearCrossEntropyLoss(num_output_chunks=8)
# The training framework whose conventions the step follows: a name in batchfit/presets.py
# (each preset's loop, loss, dtypes, optimizer and traits, with the framework's source lines).
# None: batchfit's defaults (HF Trainer's loop and loss, PyTorch's optimizer implementation).
Framework = str

TASKS: tuple[str, ...] = get_args(Task)
PRECISIONS: tuple[str, ...] = get_args(Precision)
OPTIMIZER_IMPLS: tuple[str, ...] = get_args(OptimizerImpl)
METHODS: tuple[str, ...] = get_args(Method)
ATTENTIONS: tuple[str, ...] = get_args(Attention)
SHARDINGS: tuple[str, ...] = get_args(Sharding)
OFFLOADS: tuple[str, ...] = get_args(Offload)
LOOPS: tuple[str, ...] = get_args(Loop)
LOSSES: tuple[str, ...] = get_args(LossKind)
LORA_DTYPES: tuple[str, ...] = get_args(LoraDtype)
FROZEN_DTYPES: tuple[str, ...] = get_args(FrozenDtype)


def check_choice(name: str, value: object, choices: tuple[str, ...]) -> str:
    """``value`` when it is one of ``choices``; else a UsageError naming the option."""
    if not isinstance(value, str) or value not in choices:
        raise UsageError(f"{name} {value!r} is not one of: {', '.join(choices)}")
    return value


def parse_loss(text: str) -> tuple[LossKind, int, int | None]:
    """``--loss``'s value as (kind, chunks, chunk tokens): ``full``, ``fused``, ``chunked``,
    ``chunked:N`` (N chunks of the tokens) or ``chunked:Nt`` (chunks of N tokens along the
    sequence, as litgpt's ``lm_head_chunk_size``).

    Example:
        >>> parse_loss("chunked:16")
        ('chunked', 16, None)
        >>> parse_loss("chunked:128t")
        ('chunked', 8, 128)
        >>> parse_loss("fused")
        ('fused', 8, None)
    """
    kind, sep, count = text.partition(":")
    choices = "full, chunked, chunked:N (N chunks), chunked:Nt (chunks of N tokens), fused"
    if kind not in LOSSES or (sep and kind != "chunked"):
        raise UsageError(f"--loss {text!r} is not one of: {choices}")
    if not sep:
        return cast(LossKind, kind), DEFAULT_LOSS_CHUNKS, None
    per_token = count.endswith("t")
    digits = count[:-1] if per_token else count
    if not digits.isdigit() or not 1 <= int(digits) <= 1 << 20:
        raise UsageError(
            f"--loss {text!r}: N in chunked:N (or chunked:Nt) must be an integer from 1 to 1048576"
        )
    if per_token:
        return "chunked", DEFAULT_LOSS_CHUNKS, int(digits)
    return "chunked", int(digits), None


def _check_finite(name: str, value: object) -> float:
    """A real, finite number (NaN and infinity compare False with every bound, so check first)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise UsageError(f"{name} must be a finite number, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class TrainingSetup:
    """How a model is trained: precision, optimizer, method, memory techniques, GPUs.

    Batch size and sequence length are not part of the setup: they are what the planner
    varies. ``precision="auto"`` is resolved per device by :meth:`resolved`.

    Example:
        >>> TrainingSetup(precision="bf16", optimizer="adamw").optimizer
        'adamw'
        >>> TrainingSetup(method="qlora", precision="fp32")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        batchfit.errors.UsageError: method qlora computes in 16-bit: ...
    """

    task: Task | None = None
    precision: Precision = "auto"
    optimizer: Optimizer = "adamw"
    optimizer_impl: OptimizerImpl = "auto"
    method: Method = "full"
    lora_rank: int = 8
    lora_alpha: float = 8.0
    lora_dropout: float = 0.0
    lora_targets: tuple[str, ...] | None = None
    grad_ckpt: bool = False
    attention: Attention = "auto"
    num_gpus: int = 1
    sharding: Sharding = "none"
    offload: Offload = "none"
    loop: Loop = "trainer"
    loss: LossKind = "full"
    loss_chunks: int = DEFAULT_LOSS_CHUNKS  # chunks of the tokens, for loss="chunked"
    # or chunks of this many tokens along the sequence (litgpt's lm_head_chunk_size=128)
    loss_chunk_tokens: int | None = None
    lora_dtype: LoraDtype = "fp32"
    frozen_dtype: FrozenDtype = "auto"
    framework: Framework | None = None
    # the loss was chosen on purpose (an explicit --loss): the planner keeps it, and does not
    # switch on a lean loss to make a model fit
    keep_loss: bool = False
    # the method is the run's own (no --method: pre-training): the planner offers neither
    # LoRA nor QLoRA in its place
    keep_method: bool = False
    # PyTorch's caching allocator with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (the
    # allocator simulation maps pages into one growing segment instead of fixed segments)
    expandable_segments: bool = False
    # torch.compile: changes the step's time only (fused kernels), never its planned memory
    compile: bool = False
    # checkpoint every K-th layer of the stack, layers K-1, 2K-1, ... counted from 0
    # (torchtitan's per-layer selective checkpointing counts so); None: every layer when
    # grad_ckpt is on. Setting it switches checkpointing on.
    grad_ckpt_every: int | None = None
    # --sharding fsdp's generation: 1 = FullyShardedDataParallel (flat parameters), 2 =
    # fully_shard; None: the framework's default (presets.py), 2 without a framework
    fsdp_version: int | None = None

    def __post_init__(self) -> None:
        if self.task is not None:
            check_choice("--task", self.task, TASKS)
        check_choice("--precision", self.precision, PRECISIONS)
        check_choice("--optimizer", self.optimizer, registered())
        check_choice("--optimizer-impl", self.optimizer_impl, OPTIMIZER_IMPLS)
        check_choice("--method", self.method, METHODS)
        check_choice("--attention", self.attention, ATTENTIONS)
        check_choice("--sharding", self.sharding, SHARDINGS)
        check_choice("--offload", self.offload, OFFLOADS)
        check_choice("--loop", self.loop, LOOPS)
        check_choice("--loss", self.loss, LOSSES)
        check_choice("--lora-dtype", self.lora_dtype, LORA_DTYPES)
        check_choice("--frozen-dtype", self.frozen_dtype, FROZEN_DTYPES)
        if self.framework is not None:
            check_choice("--framework", self.framework, FRAMEWORKS)
        tokens = self.loss_chunk_tokens
        if tokens is not None and (
            isinstance(tokens, bool) or not isinstance(tokens, int) or not 1 <= tokens <= 1 << 40
        ):
            raise UsageError(f"--loss chunked:Nt needs 1 <= N tokens, got {tokens!r}")
        if isinstance(self.loss_chunks, bool) or not isinstance(self.loss_chunks, int):
            raise UsageError(f"--loss chunked:N needs an integer N, got {self.loss_chunks!r}")
        if not 1 <= self.loss_chunks <= 1 << 20:
            raise UsageError(f"--loss chunked:N needs 1 <= N <= 1048576, got {self.loss_chunks}")
        if isinstance(self.lora_targets, list):  # accept lists from Python callers
            object.__setattr__(self, "lora_targets", tuple(self.lora_targets))
        every = self.grad_ckpt_every
        if every is not None:
            if isinstance(every, bool) or not isinstance(every, int) or every < 1:
                raise UsageError(
                    f"--grad-ckpt-every must be a positive integer (1 = every layer), got {every!r}"
                )
            object.__setattr__(self, "grad_ckpt", True)
            if every == 1:
                object.__setattr__(self, "grad_ckpt_every", None)
        if self.fsdp_version not in (None, 1, 2) or isinstance(self.fsdp_version, bool):
            raise UsageError(f"--fsdp-version must be 1 or 2, got {self.fsdp_version!r}")
        if not isinstance(self.num_gpus, int) or self.num_gpus < 1:
            raise UsageError(f"--num-gpus must be a positive integer, got {self.num_gpus!r}")
        if not isinstance(self.lora_rank, int) or self.lora_rank < 1:
            raise UsageError(f"--lora-rank must be a positive integer, got {self.lora_rank!r}")
        if _check_finite("--lora-alpha", self.lora_alpha) <= 0:
            raise UsageError(f"--lora-alpha must be positive, got {self.lora_alpha!r}")
        if not 0.0 <= _check_finite("--lora-dropout", self.lora_dropout) < 1.0:
            raise UsageError(f"--lora-dropout must be in [0, 1), got {self.lora_dropout!r}")
        if self.lora_targets is not None and not self.lora_targets:
            raise UsageError("--lora-targets is empty: name modules, e.g. q_proj,v_proj")
        if self.method == "qlora" and self.precision == "fp32":
            raise UsageError(
                "--method qlora computes in 16-bit: use --precision amp-bf16, amp-fp16, "
                "bf16 or fp16, not fp32"
            )
        if not self.is_lora and (self.lora_dtype != "fp32" or self.frozen_dtype != "auto"):
            raise UsageError("--lora-dtype and --frozen-dtype need --method lora or qlora")
        if self.offload == "optimizer" and self.sharding not in ("zero1", "zero2", "zero3", "fsdp"):
            raise UsageError(
                "--offload optimizer needs ZeRO: add --sharding zero1, zero2, zero3 or fsdp"
            )
        if self.offload == "optimizer+params" and self.sharding not in ("zero3", "fsdp"):
            raise UsageError("--offload optimizer+params needs --sharding zero3 or fsdp")
        get_optimizer(self.optimizer).check_sharding(self.sharding)

    @property
    def conventions(self) -> Preset:
        """The framework's preset, with its traits (``presets.DEFAULT`` without a framework)."""
        return preset(self.framework)

    @property
    def is_lora(self) -> bool:
        return self.method in ("lora", "qlora")

    @property
    def kbit_upcast(self) -> bool:
        """Whether the QLoRA base runs peft's ``prepare_model_for_kbit_training`` (the
        framework's recipe, ``Preset.kbit_prepare``): the parameters the 4-bit quantizer leaves
        16-bit (embeddings, norms, output head, biases, fused MoE experts) are cast to fp32.
        Sharded runs skip it (TRL's ``prepare_peft_model``; the FSDP-QLoRA recipes)."""
        unsharded = self.sharding in ("none", "ddp")
        return self.method == "qlora" and unsharded and self.conventions.kbit_prepare

    @property
    def traits(self) -> str:
        """What sets the setup apart from a full fine-tune with AdamW, in a few words.

        Example:
            >>> TrainingSetup(method="lora", grad_ckpt=True, loss="chunked").traits
            'lora + checkpointing + chunked loss'
            >>> TrainingSetup(optimizer_impl="fused", precision="bf16", loss="fused").traits
            'fused adamw + pure bf16 + fused loss'
            >>> TrainingSetup(grad_ckpt=True, grad_ckpt_every=3).traits
            'checkpointing every 3rd layer'
        """
        ckpt = "checkpointing" if self.grad_ckpt else ""
        if ckpt and self.grad_ckpt_every:
            ckpt += f" every {ordinal(self.grad_ckpt_every)} layer"
        parts = [
            self.method if self.method != "full" else "",
            ckpt,
            self.optimizer if self.optimizer != "adamw" else "",
            f"fused {self.optimizer}" if self.optimizer_impl == "fused" else "",
            f"pure {self.precision}" if self.precision in ("bf16", "fp16") else "",
            f"{self.loss} loss" if self.loss != "full" else "",
            self.sharding if self.sharding != "none" else "",
            f"offload {self.offload}" if self.offload != "none" else "",
        ]
        return " + ".join(p for p in parts if p)

    @property
    def loss_label(self) -> str:
        """The loss as ``--loss`` spells it: ``full``, ``chunked:8``, ``chunked:128t``, ``fused``.

        Example:
            >>> TrainingSetup(loss="chunked", loss_chunk_tokens=128).loss_label
            'chunked:128t'
        """
        if self.loss != "chunked":
            return self.loss
        if self.loss_chunk_tokens:
            return f"chunked:{self.loss_chunk_tokens}t"
        return f"chunked:{self.loss_chunks}"

    def loss_chunk_count(self, tokens: int, seq_len: int) -> int:
        """How many chunks the chunked loss splits a micro-batch of ``tokens`` into.

        Chunks of N tokens (``chunked:Nt``) split the micro-batch's tokens as torchtune does
        (all sequences flattened) under the trainer loop, and each sequence along its length
        as litgpt's ``lm_head_chunk_size`` does under a loop that keeps the outputs.
        """
        if self.loss_chunk_tokens:
            span = seq_len if self.loop == "keep-outputs" else tokens
            return -(-span // self.loss_chunk_tokens)
        return min(self.loss_chunks, max(tokens, 1))

    @property
    def outputs_fp32(self) -> bool:
        """Whether the framework casts the model's outputs to fp32 after a 16-bit forward:
        accelerate's ``convert_outputs_to_fp32`` (``accelerator.py``: ``prepare`` wraps
        ``model.forward``; HF Trainer and axolotl go through it) and Fabric's
        ``convert_output`` (litgpt; ``fabric/wrappers.py``), both to the default dtype."""
        mixed = self.precision not in ("fp32", "auto")
        return mixed and self.conventions.outputs_fp32

    # What the planner may switch on from this setup: the ladder (plan/_ladder.py) asks these,
    # so the rule lives with the setup it is about.
    @property
    def can_shard(self) -> bool:
        """ZeRO or FSDP2 may be switched on: more than one GPU, none sharding yet."""
        return self.num_gpus > 1 and self.sharding in ("none", "ddp")

    @property
    def can_offload(self) -> bool:
        """CPU offload may be switched on: none yet, and not QLoRA (batchfit does not plan
        offload for bitsandbytes' 4-bit layers)."""
        return self.offload == "none" and self.method != "qlora"

    @property
    def can_switch_to_lora(self) -> bool:
        """A full fine-tune, which LoRA adapters may replace (changes training); not a run
        whose method is its own (``keep_method``: pre-training)."""
        return self.method == "full" and not self.keep_method

    def can_switch_to_pure_bf16(self, gpu_bf16: bool) -> bool:
        """Pure bf16 (no fp32 master) may replace this setup's precision on a GPU with or
        without bf16: a full fine-tune not in pure bf16 already (a pure-bf16 preset's
        ``auto`` is)."""
        precision = self.resolved(device="cuda", bf16_supported=gpu_bf16).precision
        return precision != "bf16" and gpu_bf16 and self.method == "full"

    def can_switch_to_qlora(self, gpu_bf16: bool) -> bool:
        """QLoRA may replace this setup: not QLoRA already, not computing in fp32, and not a
        run whose method is its own (``keep_method``: pre-training)."""
        precision = self.resolved(device="cuda", bf16_supported=gpu_bf16).precision
        return self.method != "qlora" and precision != "fp32" and not self.keep_method

    def checkpointed_layers(self, num_layers: int) -> int:
        """How many of ``num_layers`` layers are checkpointed (``grad_ckpt_every``).

        Example:
            >>> TrainingSetup(grad_ckpt_every=4).checkpointed_layers(30)  # layers 3, 7, ..., 27
            7
        """
        if not self.grad_ckpt:
            return 0
        return num_layers // (self.grad_ckpt_every or 1)

    def resolved(self, *, device: Literal["cpu", "cuda"], bf16_supported: bool) -> TrainingSetup:
        """Return a copy with ``precision="auto"`` and ``attention="auto"`` made concrete.

        Example:
            >>> TrainingSetup().resolved(device="cpu", bf16_supported=False).precision
            'fp32'
            >>> TrainingSetup().resolved(device="cuda", bf16_supported=True).precision
            'amp-bf16'
        """
        precision = self.precision
        # a preset without autocast (torchtune's recipes' `dtype: bf16`; litgpt's shipped
        # configs' `precision: bf16-true`) trains in pure bf16
        conventions = self.conventions
        pure_bf16 = conventions.pure_bf16
        if precision == "auto" and device != "cpu" and bf16_supported and pure_bf16:
            precision = "bf16"
        lora_dtype = self.lora_dtype
        if precision == "auto" and device != "cpu" and not bf16_supported and pure_bf16:
            if conventions.qlora_needs_bf16 and self.method == "qlora":
                name = conventions.name
                raise UsageError(
                    f"{name}'s QLoRA needs bf16: {name} trains in bf16 or fp32 (no fp16) "
                    f"and this GPU has no bf16; drop --framework {name} (bitsandbytes QLoRA "
                    "computes in fp16) or choose a GPU with bf16"
                )
            # no bf16 (T4, V100): what the preset trains in instead (its sources say)
            precision = cast(Precision, conventions.no_bf16_precision or "amp-fp16")
            lora_dtype = "fp32" if lora_dtype == "bf16" else lora_dtype
        if precision == "auto" and device == "cpu" and self.method == "qlora":
            precision = "amp-bf16"  # QLoRA computes in 16-bit: bf16 autocast, which CPUs run
        if precision == "auto":
            precision = "fp32" if device == "cpu" else "amp-bf16" if bf16_supported else "amp-fp16"
        attention = self.attention
        if attention == "auto":
            # transformers picks SDPA; on CUDA SDPA dispatches to the flash / memory-efficient
            # kernels, on the CPU to its own flash kernel (torch/_C SDPA backend selection).
            attention = "sdpa"
        sharding = self.sharding
        if sharding == "none" and self.num_gpus > 1:
            sharding = "ddp"  # several GPUs without sharding are data parallel (DDP)
        # concrete where FSDP runs, None elsewhere (the version means nothing without it)
        fsdp_version = (self.fsdp_version or 2) if sharding == "fsdp" else None
        return replace(
            self,
            precision=precision,
            attention=attention,
            sharding=sharding,
            lora_dtype=lora_dtype,
            fsdp_version=fsdp_version,
        )


# DeepSpeed's ZeRO stages by ``--sharding`` (``fsdp`` is FSDP, ``ddp`` torch DDP)
ZERO_STAGES = {"zero1": 1, "zero2": 2, "zero3": 3}


def is_deepspeed(setup: TrainingSetup) -> bool:
    """Whether ``setup`` runs DeepSpeed's ZeRO optimizer (``--sharding zero1|zero2|zero3``)."""
    return setup.sharding in ZERO_STAGES


def zero_stage(setup: TrainingSetup) -> int:
    """The ZeRO stage of ``setup`` (0 when it is not DeepSpeed)."""
    return ZERO_STAGES.get(setup.sharding, 0)
