"""Framework presets: the conventions of the step each training framework runs (``--framework``).

Each preset sets what decides memory beyond the model and the batch: the loop (whether the
outputs outlive forward), the loss implementation, the LoRA adapters' dtype, the frozen base's
dtype, the optimizer implementation and, where the framework has no autocast, the precision.
Every value cites the framework's code it follows (read at the commit named; line numbers are
of that snapshot). An explicit option (``--loop``, ``--loss``, ``--lora-dtype``,
``--frozen-dtype``, ``--optimizer-impl``, ``--precision``) overrides its preset value.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from batchfit.spec import FRAMEWORKS, Framework, TrainingSetup, check_choice


@dataclass(frozen=True)
class Preset:
    """One framework's conventions, as ``TrainingSetup`` field values, and where they come from."""

    name: Framework
    values: dict[str, Any]
    sources: tuple[str, ...]


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
                "optimizer_impl": "fused",
            },
            (
                # transformers 5.24.0 (PyPI wheel)
                "loop: trainer.py:2217 compute_loss returns `loss` unless return_outputs",
                "loss: loss/loss_utils.py:61 `logits = logits.float()`, then cross_entropy",
                "adapters: peft mapping_func.py:110 `autocast_adapter_dtype: bool = True` (fp32)",
                "optimizer: training_args.py:811 default_optim = 'adamw_torch_fused' (torch>=2.8)",
                "outputs: accelerate accelerator.py:1824 convert_outputs_to_fp32 under bf16/fp16",
            ),
        ),
        Preset(
            "accelerate",
            {
                "loop": "keep-outputs",
                "loss": "full",
                "lora_dtype": "fp32",
                "frozen_dtype": "auto",
                "optimizer_impl": "auto",
            },
            (
                # huggingface/accelerate 16cb6eb8
                "loop: examples/nlp_example.py:163-166 `outputs = model(**batch)` ... "
                "`accelerator.backward(loss)` (outputs alive through backward)",
                "optimizer: nlp_example.py:140 `AdamW(params=model.parameters(), lr=lr)` "
                "(torch's default: foreach on CUDA)",
                "outputs: accelerator.py:1824 convert_outputs_to_fp32 under mixed precision",
            ),
        ),
        Preset(
            "lightning",
            {
                "loop": "trainer",
                "loss": "full",
                "lora_dtype": "fp32",
                "frozen_dtype": "fp32",
                "optimizer_impl": "auto",
            },
            (
                # Lightning-AI/pytorch-lightning 7f0c3436
                "loop: loops/optimization/automatic.py:65-73 closure_loss = "
                "training_step_output.get('loss') (only the loss goes to backward)",
                "frozen base: bf16-mixed keeps the module's fp32 weights and autocasts "
                "(plugins/precision/amp.py:168 `torch.autocast(self.device, dtype=dtype)`)",
                "optimizer: the user's configure_optimizers (torch's default)",
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
            ),
        ),
        Preset(
            "torchtune",
            {
                "loop": "trainer",
                "loss": "chunked",
                "loss_chunks": 8,
                "lora_dtype": "bf16",
                "frozen_dtype": "auto",
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
            ),
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
            ),
        ),
    )
}


def with_framework(
    setup: TrainingSetup, framework: str, explicit: frozenset[str] = frozenset()
) -> TrainingSetup:
    """``setup`` following ``framework``'s conventions, except the fields in ``explicit``
    (what the user set on purpose, which wins over the preset).

    Example:
        >>> s = with_framework(TrainingSetup(method="lora"), "litgpt")
        >>> s.loop, s.loss_label, s.lora_dtype
        ('keep-outputs', 'chunked:128t', 'bf16')
        >>> with_framework(TrainingSetup(loop="trainer"), "litgpt", frozenset({"loop"})).loop
        'trainer'
    """
    preset = PRESETS[check_choice("--framework", framework, FRAMEWORKS)]
    values = {k: v for k, v in preset.values.items() if k not in explicit}
    if "loss" in explicit:  # --loss names its own chunking
        values = {k: v for k, v in values.items() if not k.startswith("loss_chunk")}
    if not setup.is_lora:  # adapter and frozen dtypes describe LoRA only
        values.pop("lora_dtype", None)
        values.pop("frozen_dtype", None)
    return replace(setup, framework=preset.name, **values)


def adapter_defaults(setup: TrainingSetup) -> dict[str, Any]:
    """The preset's adapter and frozen-base dtypes, for a full fine-tune the planner switches to
    LoRA (``with_framework`` leaves them out while the method is full).

    Example:
        >>> adapter_defaults(with_framework(TrainingSetup(), "litgpt"))
        {'lora_dtype': 'bf16', 'frozen_dtype': 'auto'}
        >>> adapter_defaults(TrainingSetup())
        {}
    """
    if setup.framework is None or setup.is_lora:
        return {}
    values = PRESETS[setup.framework].values
    return {k: values[k] for k in ("lora_dtype", "frozen_dtype") if k in values}
