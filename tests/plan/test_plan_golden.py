"""The planner's logic on the analytic engine is pinned: ``make_plan(...).to_json()`` and
``fit_table`` rows for varied cases against a reviewed capture (``tests/data/plan_golden.json``;
re-taken for deliberate changes only, e.g. the trainer loop frees the logits, alternatives that
do not fit show their whole device total).

Re-capture (only for a deliberate change of plans, reviewed in the diff):
``PYTHONPATH=src python -m tests.plan.test_plan_golden``
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from batchfit.hardware import get_gpu
from batchfit.models import resolve_model
from batchfit.plan import fit_table, make_plan
from batchfit.spec import TrainingSetup

GOLDEN = Path(__file__).parents[1] / "data" / "plan_golden.json"

# name -> (model, gpu, TrainingSetup keyword arguments, make_plan keyword arguments)
CASES: dict[str, tuple[str, str, dict[str, Any], dict[str, Any]]] = {
    "gpt2-rtx3060-tokens-micro": (
        "gpt2",
        "rtx-3060",
        {},
        {"seq_len": 256, "global_batch_tokens": 32768, "micro_batch_size": 16},
    ),
    "gpt2-t4-amp-fp16": ("gpt2", "t4", {}, {"seq_len": 512, "global_batch": 32}),
    "gpt2-a100-bf16-lr-samples": (
        "gpt2",
        "a100-40gb",
        {"precision": "bf16"},
        {"seq_len": 512, "global_batch": 48, "base_lr": 1e-4, "base_batch": 16},
    ),
    "gpt2-a100-80-micro-too-big": (
        "gpt2",
        "a100-80gb",
        {},
        {"seq_len": 1024, "global_batch": 512, "micro_batch_size": 128},
    ),
    "llama8b-a100-needs-ladder-tokens": (
        "llama-3.1-8b",
        "a100-40gb",
        {},
        {"seq_len": 4096, "global_batch_tokens": 1048576},
    ),
    "llama8b-8gpu-zero": (
        "llama-3.1-8b",
        "a100-80gb",
        {"num_gpus": 8},
        {"seq_len": 4096, "global_batch_tokens": 4 * 1048576},
    ),
    "llama8b-a100-qlora": (
        "llama-3.1-8b",
        "a100-40gb",
        {"method": "qlora"},
        {"seq_len": 2048, "global_batch": 32},
    ),
    "llama1b-t4-qlora-fp16-lr-tokens": (
        "llama-3.2-1b",
        "t4",
        {"method": "qlora", "precision": "amp-fp16"},
        {"seq_len": 1024, "global_batch_tokens": 16384, "base_lr": 2e-4, "base_batch_tokens": 8192},
    ),
    "bert-lora-classification-t4": (
        "bert-base-uncased",
        "t4",
        {"task": "classification", "method": "lora", "lora_rank": 16, "lora_alpha": 32.0},
        {"seq_len": 512, "global_batch": 64},
    ),
    "gpt2-4gpu-fsdp-offload-sgd": (
        "gpt2",
        "a100-40gb",
        {
            "num_gpus": 4,
            "sharding": "fsdp",
            "offload": "optimizer",
            "grad_ckpt": True,
            "optimizer": "sgd-momentum",
        },
        {"seq_len": 1024, "global_batch": 64, "base_lr": 0.1, "base_batch": 256},
    ),
    "mistral7b-v100-fp32-adam-offload": (
        "mistral-7b",
        "v100-32gb",
        {"precision": "fp32", "optimizer": "adam"},
        {"seq_len": 2048, "global_batch": 16},
    ),
    "llama70b-t4-nothing-fits": (
        "llama-3.1-70b",
        "t4",
        {},
        {"seq_len": 8192, "global_batch": 8},
    ),
    "qwen7b-l4-micro1-long-accum": (
        "qwen2.5-7b",
        "l4",
        {"method": "lora"},
        {"seq_len": 4096, "global_batch": 256, "micro_batch_size": 1},
    ),
    "gpt2-4gpu-ddp": ("gpt2", "a100-40gb", {"num_gpus": 4}, {"seq_len": 1024, "global_batch": 64}),
}

FIT_TABLES: dict[str, tuple[str, tuple[str, ...], dict[str, Any], int]] = {
    "bert-small-gpus": ("bert-base-uncased", ("t4", "rtx-3060", "h200"), {}, 512),
    "llama8b-ladder": ("llama-3.1-8b", ("t4", "a10", "a100-40gb", "h100-80gb"), {}, 4096),
}


def plan_json(name: str) -> dict[str, Any]:
    model, gpu, setup_kwargs, kwargs = CASES[name]
    setup = TrainingSetup(**setup_kwargs)
    info = resolve_model(model, setup.task)
    plan = make_plan(info, get_gpu(gpu), setup, engine="analytic", **kwargs)
    return dict(json.loads(json.dumps(plan.to_json())))


def fit_json(name: str) -> list[dict[str, Any]]:
    model, gpus, setup_kwargs, seq_len = FIT_TABLES[name]
    setup = TrainingSetup(**setup_kwargs)
    gpu_specs = [get_gpu(g) for g in gpus]
    rows = fit_table(
        resolve_model(model, setup.task), setup, gpu_specs, seq_len=seq_len, engine="analytic"
    )
    return list(json.loads(json.dumps([r.to_json() for r in rows])))


def _golden() -> dict[str, Any]:
    return dict(json.loads(GOLDEN.read_text(encoding="utf-8")))


@pytest.mark.parametrize("name", list(CASES))
def test_plan_matches_golden(name: str) -> None:
    assert plan_json(name) == _golden()["plans"][name]


@pytest.mark.parametrize("name", list(FIT_TABLES))
def test_fit_table_matches_golden(name: str) -> None:
    assert fit_json(name) == _golden()["fit_tables"][name]


def test_golden_covers_the_cases_it_claims() -> None:
    plans = _golden()["plans"]
    assert set(plans) == set(CASES)
    assert not plans["llama70b-t4-nothing-fits"]["fits"]
    assert plans["llama70b-t4-nothing-fits"]["max_micro_batch"] == 0
    ladder_names = {t["name"] for p in plans.values() for t in p["techniques"]}
    assert {"gradient-checkpointing", "zero1", "offload-optimizer"} & ladder_names
    assert any(p["learning_rate"] is not None for p in plans.values())


if __name__ == "__main__":
    GOLDEN.write_text(
        json.dumps(
            {
                "plans": {n: plan_json(n) for n in CASES},
                "fit_tables": {n: fit_json(n) for n in FIT_TABLES},
            },
            indent=1,
            sort_keys=True,
        )
        + "\n",
        encoding="utf-8",
    )
