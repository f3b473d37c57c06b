"""The analytic engine's numbers and lines, pinned for a spread of setups.

The golden file was written by the engine before ``estimate_analytic`` was split into steps, so
this test proves the split preserved every number and every printed formula. Regenerate it only
for an intended change of output: set ``BATCHFIT_REGEN_GOLDEN=1`` and run this file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from batchfit.hardware import get_gpu
from batchfit.memory.formulas.analytic import estimate_analytic
from batchfit.memory.types import MemoryEstimate
from batchfit.models import resolve_model
from batchfit.spec import TrainingSetup
from batchfit.workload import Workload

GOLDEN = Path(__file__).parent / "golden" / "analytic.json"

# name: (model, micro, seq, device, gpu, grad_accum_steps, setup)
CASES: dict[str, tuple[str, int, int, str, str | None, int, dict[str, Any]]] = {
    "gpt2-full-cpu": ("gpt2", 8, 512, "cpu", None, 1, {}),
    "gpt2-amp-bf16-a100": ("gpt2", 8, 1024, "cuda", "a100-80gb", 1, {"precision": "amp-bf16"}),
    "gpt2-lora-amp-fp16-t4": (
        "gpt2",
        4,
        512,
        "cuda",
        "t4",
        1,
        {"precision": "amp-fp16", "method": "lora"},
    ),
    "gpt2-eager-dropout-cpu-lora": (
        "gpt2",
        2,
        256,
        "cpu",
        None,
        2,
        {"method": "lora", "lora_dropout": 0.1, "attention": "sdpa"},
    ),
    "llama8b-bf16-h100-accum": (
        "llama-3.1-8b",
        2,
        2048,
        "cuda",
        "h100-80gb",
        4,
        {"precision": "bf16"},
    ),
    "llama8b-fp32-h200-foreach": ("llama-3.1-8b", 1, 16, "cuda", "h200", 1, {"precision": "fp32"}),
    "llama8b-lora-ckpt-a100": (
        "llama-3.1-8b",
        4,
        2048,
        "cuda",
        "a100-80gb",
        1,
        {"precision": "bf16", "method": "lora", "grad_ckpt": True, "lora_dropout": 0.05},
    ),
    "llama8b-qlora-ckpt-h100": (
        "llama-3.1-8b",
        4,
        4096,
        "cuda",
        "h100-80gb",
        1,
        {
            "precision": "amp-bf16",
            "method": "qlora",
            "grad_ckpt": True,
            "lora_targets": ("q_proj", "k_proj", "v_proj", "o_proj"),
        },
    ),
    "llama8b-zero3-offload-8gpu": (
        "llama-3.1-8b",
        1,
        2048,
        "cuda",
        "h100-80gb",
        2,
        {"precision": "bf16", "num_gpus": 8, "sharding": "zero3", "offload": "optimizer+params"},
    ),
    "llama8b-zero2-offload-opt-4gpu": (
        "llama-3.1-8b",
        2,
        1024,
        "cuda",
        "a100-80gb",
        1,
        {
            "precision": "amp-bf16",
            "num_gpus": 4,
            "sharding": "zero2",
            "offload": "optimizer",
            "grad_ckpt": True,
        },
    ),
    "llama8b-zero1-one-gpu": (
        "llama-3.1-8b",
        1,
        512,
        "cuda",
        "a100-80gb",
        1,
        {"precision": "bf16", "sharding": "zero1"},
    ),
    "llama8b-ddp-2gpu-fused": (
        "llama-3.1-8b",
        1,
        512,
        "cuda",
        "h100-80gb",
        1,
        {"precision": "bf16", "num_gpus": 2, "sharding": "ddp", "optimizer_impl": "fused"},
    ),
    "llama8b-fp16-a100": ("llama-3.1-8b", 1, 512, "cuda", "a100-80gb", 2, {"precision": "fp16"}),
    "llama8b-flash-v100-fp32": (
        "llama-3.1-8b",
        1,
        512,
        "cuda",
        "v100-32gb",
        1,
        {"precision": "fp32", "attention": "flash"},
    ),
    "llama1b-bf16-on-v100": ("llama-3.2-1b", 1, 512, "cuda", "v100-32gb", 1, {"precision": "bf16"}),
    "llama1b-cuda-no-gpu-adafactor": (
        "llama-3.2-1b",
        4,
        512,
        "cuda",
        None,
        1,
        {"optimizer": "adafactor"},
    ),
    "llama1b-adamw-8bit-l4": (
        "llama-3.2-1b",
        4,
        512,
        "cuda",
        "l4",
        1,
        {"optimizer": "adamw-8bit"},
    ),
    "llama1b-lion-for-loop": (
        "llama-3.2-1b",
        2,
        256,
        "cuda",
        "rtx-4090",
        1,
        {"optimizer": "lion", "optimizer_impl": "for-loop", "attention": "eager"},
    ),
    "llama1b-sgd-momentum-cpu": (
        "llama-3.2-1b",
        1,
        128,
        "cpu",
        None,
        1,
        {"optimizer": "sgd-momentum"},
    ),
    "bert-fp32-cpu": ("bert-base-uncased", 8, 128, "cpu", None, 1, {}),
    "bert-amp-fp16-eager-t4": (
        "bert-base-uncased",
        16,
        512,
        "cuda",
        "t4",
        1,
        {"precision": "amp-fp16", "attention": "eager"},
    ),
    "bert-lora-ckpt-a10": (
        "bert-base-uncased",
        16,
        512,
        "cuda",
        "a10",
        1,
        {"method": "lora", "grad_ckpt": True},
    ),
    "distilbert-lora-guessed": (
        "distilbert-base-uncased",
        8,
        256,
        "cuda",
        "a10g",
        1,
        {"method": "lora"},
    ),
    "phi3-lora-guessed": ("phi-3-mini", 1, 1024, "cuda", "a100-40gb", 1, {"method": "lora"}),
    "t5-small-sdpa-eager": ("t5-small", 8, 512, "cuda", "a100-80gb", 1, {"attention": "sdpa"}),
    "t5-small-ckpt-cpu": ("t5-small", 4, 256, "cpu", None, 1, {"grad_ckpt": True}),
    # auto is eager: transformers' Gemma-2 has no SDPA (soft-capping); sdpa is refused
    "gemma2-auto-eager": ("gemma-2-2b", 1, 1024, "cuda", "h100-80gb", 1, {}),
    "gemma2-flash-lora": (
        "gemma-2-2b",
        1,
        1024,
        "cuda",
        "h100-80gb",
        1,
        {"attention": "flash", "method": "lora"},
    ),
    "mixtral-full-zero3-8gpu": (
        "mixtral-8x7b",
        1,
        2048,
        "cuda",
        "h100-80gb",
        1,
        {"precision": "bf16", "num_gpus": 8, "sharding": "zero3"},
    ),
    "mixtral-qlora-fsdp-mi300x": (
        "mixtral-8x7b",
        1,
        1024,
        "cuda",
        "mi300x",
        1,
        {"method": "qlora", "num_gpus": 2, "sharding": "fsdp", "grad_ckpt": True},
    ),
    "pythia-paged-8bit-b200": (
        "pythia-160m",
        8,
        2048,
        "cuda",
        "b200",
        1,
        {"optimizer": "paged-adamw-8bit"},
    ),
    "opt-sgd-p100": (
        "opt-125m",
        4,
        1024,
        "cuda",
        "p100",
        1,
        {"optimizer": "sgd", "precision": "amp-fp16"},
    ),
}


def _record(est: MemoryEstimate) -> dict[str, Any]:
    """What the engine promises: numbers, the printed lines, the warnings (not the setup echo)."""
    out = est.to_json()
    keep = (
        "engine",
        "device",
        "peak_bytes",
        "reserved_bytes",
        "device_total_bytes",
        "components",
        "total_params",
        "trainable_params",
        "peak_phase",
        "host_bytes",
        "activation_peak_bytes",
        "breakdown",
        "warnings",
    )
    return {k: out[k] for k in keep} | {"attention": est.setup.attention}


def _run(name: str) -> dict[str, Any]:
    model, micro, seq, device, gpu, accum, setup = CASES[name]
    est = estimate_analytic(
        resolve_model(model),
        TrainingSetup(**setup),
        Workload(
            micro_batch_size=micro,
            seq_len=seq,
            device=device,  # type: ignore[arg-type]
            gpu=get_gpu(gpu) if gpu else None,
            grad_accum_steps=accum,
        ),
    )
    return _record(est)


def _text(value: Any) -> str:
    # Dumped text, so an int that became a float (5 vs 5.0) shows as a difference too.
    return json.dumps(value, indent=1, sort_keys=True)


if os.environ.get("BATCHFIT_REGEN_GOLDEN"):
    GOLDEN.write_text(_text({name: _run(name) for name in CASES}) + "\n")


@pytest.mark.parametrize("name", sorted(CASES))
def test_analytic_output_matches_the_golden_file(name: str) -> None:
    golden = json.loads(GOLDEN.read_text())
    assert _text(_run(name)) == _text(golden[name])


def test_golden_file_has_every_case() -> None:
    assert sorted(json.loads(GOLDEN.read_text())) == sorted(CASES)
