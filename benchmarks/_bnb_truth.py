"""QLoRA's model for the ground truth, loaded as the QLoRA recipe loads it, with bitsandbytes.

batchfit's own dry runs emulate bitsandbytes' 4-bit layers (``memory/trace/_nf4.py``); the
truth must not, or it would only measure the emulation. Here the model goes through the real
path: a randomly initialised checkpoint is written to a temporary folder and loaded back with
``from_pretrained(quantization_config=BitsAndBytesConfig(load_in_4bit=True, nf4, double
quantisation, bf16 compute))`` (transformers' bitsandbytes quantizer: ``Linear4bit`` layers,
the output head and ``_keep_in_fp32_modules`` left as they are), then peft's
``prepare_model_for_kbit_training`` where the framework's recipe runs it
(``TrainingSetup.kbit_upcast``), checkpointing as the recipe switches it on, and
``get_peft_model``. bitsandbytes 0.50.2 runs ``Linear4bit`` forward and backward on the CPU
(its CPU backend), so the step is real. It must be importable (``pip install bitsandbytes``);
without it the truth refuses rather than fall back on the emulation.
"""

from __future__ import annotations

import tempfile
from typing import Any

import torch

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _own_storage(net: torch.nn.Module) -> None:
    """Copy every tensor still backed by the checkpoint's memory map into memory of its own.

    safetensors maps the file, and a tensor loaded in the file's dtype (the embeddings, the
    head, norms) stays a view of that map: the map, and every page read through it (the 16-bit
    or fp32 weights the quantizer read before packing them to 4 bits), stay in the process's
    RSS as long as one view lives. Those are clean file pages, not memory the step allocates
    (on a GPU the weights move to the device and the map is dropped): the copy frees them.
    """
    for module in net.modules():
        for param in module._parameters.values():
            # the 4-bit weights were packed into new memory already
            if param is not None and type(param).__name__ != "Params4bit":
                param.data = param.data.clone()
        for name, buf in module._buffers.items():
            if buf is not None:
                module._buffers[name] = buf.clone()


def build_4bit(info: Any, setup: Any, depth: int | None) -> torch.nn.Module:
    """The QLoRA model of ``info`` under ``setup`` at ``depth`` layers (None: all of them)."""
    import bitsandbytes  # noqa: F401  (refuse early: no emulated fallback)
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import BitsAndBytesConfig

    from batchfit.memory.trace import hf as _hf_trace
    from batchfit.models import auto_class

    compute = torch.float16 if setup.precision in ("fp16", "amp-fp16") else torch.bfloat16
    dtype = compute if setup.frozen_dtype == "auto" else _DTYPES[setup.frozen_dtype]
    cfg = _hf_trace._config(info, depth)
    attn = _hf_trace._attn_impl(info, setup.attention)
    auto = auto_class(info.task)
    with tempfile.TemporaryDirectory(prefix="batchfit-qlora-") as folder:
        auto.from_config(cfg, dtype=dtype).save_pretrained(folder)
        quant = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=compute,
        )
        net = auto.from_pretrained(
            folder,
            quantization_config=quant,
            dtype=dtype,
            device_map="cpu",
            attn_implementation=attn,
        )
    _own_storage(net)
    ckpt = {"use_reentrant": False}
    if setup.kbit_upcast:
        net = prepare_model_for_kbit_training(
            net, use_gradient_checkpointing=setup.grad_ckpt, gradient_checkpointing_kwargs=ckpt
        )
    elif setup.grad_ckpt:
        net.gradient_checkpointing_enable(gradient_checkpointing_kwargs=ckpt)
    targets = list(setup.lora_targets or info.default_lora_targets())
    config = LoraConfig(
        r=setup.lora_rank,
        lora_alpha=setup.lora_alpha,
        lora_dropout=setup.lora_dropout,
        target_modules=targets,
    )
    peft_model = get_peft_model(net, config)
    if setup.lora_dtype != "fp32":
        for name, param in peft_model.named_parameters():
            if param.requires_grad and "lora_" in name:
                param.data = param.data.to(_DTYPES[setup.lora_dtype])
    peft_model.train()
    return peft_model  # type: ignore[no-any-return]
