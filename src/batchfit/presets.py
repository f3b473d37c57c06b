"""Framework presets: the conventions of the step each training framework runs (``--framework``).

Each preset sets what decides memory beyond the model and the batch: the loop (whether the
outputs outlive forward), the loss implementation, the LoRA adapters' dtype, the frozen base's
dtype, the optimizer implementation and, where the framework has no autocast, the precision;
and its traits, which the setup, the planner and the step-time model ask (``Preset``). Every
value cites the framework's code it follows (read at the commit named; line numbers are of
that snapshot). ``batchfit.frameworks.with_framework`` applies a preset to a setup.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Preset:
    """One framework's conventions, and where they come from (``sources``, file:line each).

    Attributes:
        name: the ``--framework`` value.
        values: ``TrainingSetup`` field values the preset sets (an explicit option wins).
        sources: the framework's code each value and trait follows.
        outputs_fp32: the framework casts the model's outputs to fp32 after a 16-bit forward
            (accelerate's ``convert_outputs_to_fp32``, Fabric's ``convert_output``).
        pure_bf16: ``--precision auto`` is pure bf16 on a GPU with bf16 (no autocast).
        no_bf16_precision: what ``auto`` becomes on a GPU without bf16, under ``pure_bf16``.
        qlora_needs_bf16: its QLoRA refuses a GPU without bf16.
        clips_grad_norm: its loop clips gradients by norm every step (the step-time model
            counts the memory traffic).
        plans_deepspeed: the planner may offer DeepSpeed ZeRO; False: it shards with FSDP2 only.
        selects_ckpt_layers: its runs can checkpoint a chosen set of layers, so the planner
            may offer checkpointing every K-th layer.
        kbit_prepare: its QLoRA recipe runs peft's ``prepare_model_for_kbit_training`` on the
            4-bit model (unsharded runs): every parameter the quantizer left 16-bit is cast to
            fp32, and checkpointing is switched on unless the recipe turns it off.
        quantizes_head: its 4-bit QLoRA quantises the output head too (transformers keeps it
            16-bit).
        liger_switch: its config switches Liger's fused loss on (HF Trainer's
            ``use_liger_kernel``); without it the planner offers the fused loss as needing code.
        chunked_switch: its config switches a chunked loss on (torchtune's loss component,
            axolotl's ``chunked_cross_entropy``); without it, offered as needing code.
    """

    name: str
    values: dict[str, Any]
    sources: tuple[str, ...]
    outputs_fp32: bool = False
    pure_bf16: bool = False
    no_bf16_precision: str | None = None
    qlora_needs_bf16: bool = False
    clips_grad_norm: bool = False
    plans_deepspeed: bool = True
    selects_ckpt_layers: bool = False
    kbit_prepare: bool = False
    quantizes_head: bool = False
    liger_switch: bool = False
    chunked_switch: bool = False


# transformers 5.24.0 (PyPI wheel): the fused loss is a TrainingArguments switch; a chunked
# loss has none (compute_loss runs the model's own full-vocabulary loss)
_LIGER_SOURCES = (
    "losses: training_args.py use_liger_kernel (Liger's fused linear cross-entropy; "
    "liger-kernel installed); no chunked-loss option",
)

# peft 0.21.2 (PyPI wheel), utils/other.py, and the recipes that call it on a 4-bit model
_KBIT_SOURCES = (
    "kbit: peft utils/other.py:204-209 prepare_model_for_kbit_training casts every fp16/bf16 "
    "parameter but Params4bit to fp32; :158-159 use_gradient_checkpointing=True by default",
    "kbit: TRL 4cb07d36 trl/models/utils.py:361-366 SFTTrainer's prepare_peft_model calls it "
    "on a 4/8-bit model not sharded by FSDP/ZeRO-3 (TRL <= 0.26; 0.27 dropped the call)",
)

PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            "hf-trainer",
            {
                "loop": "trainer",
                "loss": "full",
                "lora_dtype": "fp32",
                "frozen_dtype": "auto",
                "fsdp_version": 2,
                "optimizer_impl": "fused",
            },
            (
                # transformers 5.24.0 (PyPI wheel)
                "loop: trainer.py:2217 compute_loss returns `loss` unless return_outputs",
                "loss: loss/loss_utils.py:61 `logits = logits.float()`, then cross_entropy",
                "adapters: peft mapping_func.py:110 `autocast_adapter_dtype: bool = True` (fp32)",
                "optimizer: training_args.py:811 default_optim = 'adamw_torch_fused' (torch>=2.8)",
                "outputs: accelerate accelerator.py:1824 convert_outputs_to_fp32 under bf16/fp16",
                "clipping: training_args.py:866 max_grad_norm default 1.0; trainer.py:2787 "
                "accelerator.clip_grad_norm_ every step",
                *_KBIT_SOURCES,
                'fsdp: training_args.py:2826 `fsdp_config.get("version", 2)` (FSDP1 deprecated)',
                *_LIGER_SOURCES,
            ),
            outputs_fp32=True,
            clips_grad_norm=True,
            kbit_prepare=True,
            liger_switch=True,
        ),
        Preset(
            "accelerate",
            {
                "loop": "keep-outputs",
                "loss": "full",
                "lora_dtype": "fp32",
                "frozen_dtype": "auto",
                "fsdp_version": 1,
                "optimizer_impl": "auto",
            },
            (
                # huggingface/accelerate 16cb6eb8
                "loop: examples/nlp_example.py:163-166 `outputs = model(**batch)` ... "
                "`accelerator.backward(loss)` (outputs alive through backward)",
                "optimizer: nlp_example.py:140 `AdamW(params=model.parameters(), lr=lr)` "
                "(torch's default: foreach on CUDA)",
                "outputs: accelerator.py:1824 convert_outputs_to_fp32 under mixed precision",
                # accelerate 1.15.0 (PyPI wheel)
                "fsdp: utils/dataclasses.py:1831 fsdp_version from FSDP_VERSION, default '1'",
            ),
            outputs_fp32=True,
        ),
        Preset(
            "lightning",
            {
                "loop": "trainer",
                "loss": "full",
                "lora_dtype": "fp32",
                "frozen_dtype": "fp32",
                "fsdp_version": 1,
                "optimizer_impl": "auto",
            },
            (
                # Lightning-AI/pytorch-lightning 7f0c3436
                "loop: loops/optimization/automatic.py:65-73 closure_loss = "
                "training_step_output.get('loss') (only the loss goes to backward)",
                "frozen base: bf16-mixed keeps the module's fp32 weights and autocasts "
                "(plugins/precision/amp.py:168 `torch.autocast(self.device, dtype=dtype)`)",
                "optimizer: the user's configure_optimizers (torch's default)",
                # lightning 2.6.6 (PyPI wheel)
                "fsdp: pytorch_lightning/strategies/fsdp.py:189,310 FullyShardedDataParallel, "
                "use_orig_params=True",
            ),
        ),
        Preset(
            "litgpt",
            {
                "loop": "keep-outputs",
                "loss": "chunked",
                "loss_chunk_tokens": 128,
                "lora_dtype": "bf16",
                "frozen_dtype": "auto",
                "fsdp_version": 1,
                "optimizer_impl": "auto",
            },
            (
                # Lightning-AI/litgpt 26857050
                "loop: finetune/lora.py:355-359 `logits = model(input_ids, lm_head_chunk_size=128)`"
                " ... `fabric.backward(...)` (logits alive through backward)",
                "loss: model.py:177-179 `[lm_head(x_i) for x_i in x.split(lm_head_chunk_size, "
                "dim=1)]`; utils.py:323-328 cross_entropy per chunk",
                "precision: config_hub/finetune/*.yaml `precision: bf16-true` (all 42): bf16 "
                "weights and adapters (lora.py:125-126 under fabric.init_module)",
                "outputs: Fabric wrappers.py:135-138 convert_output to the default dtype (fp32)",
                "optimizer: finetune/lora.py:78 'AdamW' -> torch.optim.AdamW defaults",
                "no bf16: `16-mixed` keeps the parameters, adapters included, in fp32",
                "sharding: the finetune scripts' Fabric FSDPStrategy (no DeepSpeed)",
                "qlora: finetune/lora.py:141-150 BitsandbytesPrecision(mode, dtype of the "
                "-true precision); :210-211 GPT(config) under fabric.init_module, where "
                "Lightning 2.6.6 fabric/plugins/precision/bitsandbytes.py:139-145 replaces every "
                "torch.nn.Linear (lm_head's lora.py:121 included) and builds the rest in dtype",
                "fsdp: lightning 2.6.6 fabric/strategies/fsdp.py:169,298 FSDPStrategy wraps "
                "with FullyShardedDataParallel, use_orig_params=True",
            ),
            outputs_fp32=True,
            pure_bf16=True,
            no_bf16_precision="amp-fp16",
            plans_deepspeed=False,
            chunked_switch=True,
            quantizes_head=True,
        ),
        Preset(
            "torchtune",
            {
                "loop": "trainer",
                "loss": "chunked",
                "loss_chunks": 8,
                "lora_dtype": "bf16",
                "frozen_dtype": "auto",
                "fsdp_version": 2,
                "optimizer_impl": "fused",
            },
            (
                # pytorch/torchtune bd2a0fc7 (0.7.0)
                "loop: recipes/lora_finetune_single_device.py:597-600 `loss = "
                "self._loss_fn(outputs, labels)`; `del outputs` before backward",
                "loss: modules/loss/cross_entropy_loss.py:36 num_output_chunks=8; :107-110 "
                "projection and `.float()` per chunk (162 of 170 configs)",
                "precision: lora recipe:410 built under set_default_dtype(bf16), no autocast; "
                ":470 adapters validated as bf16",
                "optimizer: configs/llama3_2/1B_lora_single_device.yaml:56-58 AdamW fused: True",
                "no bf16: training/precision.py refuses fp16 (fp32 or bf16)",
                "sharding: recipes/full_finetune_distributed.py FSDP2, fsdp_cpu_offload (no "
                "DeepSpeed)",
                "fsdp: recipes/full_finetune_distributed.py shards with fully_shard (FSDP2)",
                "checkpointing: `ac_option: K` selective per-layer checkpointing in the "
                "distributed recipes",
            ),
            pure_bf16=True,
            no_bf16_precision="fp32",
            qlora_needs_bf16=True,
            plans_deepspeed=False,
            selects_ckpt_layers=True,
            chunked_switch=True,
        ),
        Preset(
            "axolotl",
            {
                "loop": "trainer",
                "loss": "full",
                "lora_dtype": "fp32",
                "frozen_dtype": "auto",
                "optimizer_impl": "fused",
            },
            (
                # axolotl-ai-cloud/axolotl 067b021c
                "loop: core/trainers/base.py:446-450 compute_loss defers to HF Trainer's",
                "adapters: loaders/adapter.py:368-385 get_peft_model with peft's default "
                "autocast_adapter_dtype (fp32)",
                "optimizer: utils/schemas/training.py:122-123 default 'adamw_torch_fused'",
                "losses: utils/schemas/config.py chunked_cross_entropy (a chunked loss) and "
                "the Liger plugin's liger_fused_linear_cross_entropy",
            ),
            outputs_fp32=True,
            liger_switch=True,
            chunked_switch=True,
        ),
    )
}

# No --framework: batchfit's defaults, HF Trainer's conventions (its loop and loss, the
# switches of its TrainingArguments: gradient_checkpointing wraps every layer, so the planner
# chooses no every-K-th-layer checkpointing; the HF QLoRA recipe's preparation) with PyTorch's
# optimizer implementation.
DEFAULT = Preset(
    "none", {}, (*_KBIT_SOURCES, *_LIGER_SOURCES), kbit_prepare=True, liger_switch=True
)
FRAMEWORKS: tuple[str, ...] = tuple(PRESETS)


def preset(framework: str | None) -> Preset:
    """The preset of ``framework``; ``DEFAULT`` for None (the name is checked by the setup)."""
    return DEFAULT if framework is None else PRESETS[framework]
