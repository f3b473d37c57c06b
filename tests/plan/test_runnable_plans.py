"""Plans a user can run: the plan chooses only what the framework's config switches on (HF
Trainer's, the default), and offers what needs code as an alternative that says so."""

from __future__ import annotations

import json

import pytest

from tests._cli import run_cli

# an 8B LoRA fine-tune on a 24 GB card: every K-th layer's checkpointing is predicted faster
# than every layer's, but HF Trainer's gradient_checkpointing wraps every layer
LORA_4090 = [
    "plan",
    "llama-3.1-8b",
    "--gpu",
    "rtx-4090",
    "--method",
    "lora",
    "--seq-len",
    "2048",
    "--global-batch",
    "32",
    "--engine",
    "analytic",
]


def _plan_json(args: list[str], capsys: pytest.CaptureFixture[str]) -> dict:
    code, out, err = run_cli([*args, "--json"], capsys)
    assert code == 0, err
    return dict(json.loads(out))


def test_the_4090_lora_plan_chooses_only_what_training_arguments_switch_on(capsys, tmp_path):
    plan = _plan_json(LORA_4090, capsys)
    setup = plan["setup"]
    assert setup["grad_ckpt"] and setup["grad_ckpt_every"] is None  # every layer
    assert plan["headroom_bytes"] >= plan["headroom_wanted_bytes"]
    assert any("pip install liger-kernel" in w for w in plan["warnings"])
    offered = [a for a in plan["alternatives"] if a["needs"]]
    assert offered, "every K-th layer is offered, with the code it needs"
    for alt in offered:
        assert any(t.startswith("gradient-checkpointing-every-") for t in alt["techniques"])
        assert all(n.startswith("code: ") for n in alt["needs"])
    chosen = [t["name"] for t in plan["techniques"]]
    assert chosen == ["fused-loss", "gradient-checkpointing"]

    out = tmp_path / "hf.json"
    code, _, err = run_cli([*LORA_4090, "--export", "hf", "--out", str(out)], capsys)
    assert code == 0, err
    kwargs = json.loads(out.read_text())["training_arguments"]
    transformers = pytest.importorskip("transformers")
    import torch

    kwargs = {**kwargs, "output_dir": str(tmp_path / "run")}
    if not torch.cuda.is_available():
        kwargs["use_cpu"] = True  # else bf16=True is refused on a machine without a GPU
    args = transformers.TrainingArguments(**kwargs)
    # every technique the plan counts is switched on by the arguments alone
    assert args.per_device_train_batch_size == plan["micro_batch_size"]
    assert args.gradient_accumulation_steps == plan["grad_accum_steps"]
    assert args.activation_checkpointing is True
    assert args.use_liger_kernel is (setup["loss"] == "fused")
    assert setup["loss"] == "fused"
    assert args.bf16 is (setup["precision"] in ("amp-bf16", "bf16"))
    assert args.fp16 is (setup["precision"] in ("amp-fp16", "fp16"))
    assert args.bf16 or args.fp16
    fused = setup["optimizer_impl"] == "fused"
    assert str(args.optim.value) == ("adamw_torch_fused" if fused else "adamw_torch")


def test_a_pretraining_plan_offers_no_adapters(capsys):
    """No --method: pre-training; --method full: a fine-tune, which LoRA may replace."""
    args = ["plan", "llama-3.2-1b", "--gpu", "t4", "--seq-len", "2048", "--global-batch", "16"]
    args += ["--engine", "analytic"]
    names = {t for a in _plan_json(args, capsys)["alternatives"] for t in a["techniques"]}
    assert not names & {"lora", "qlora"}
    finetune = _plan_json([*args, "--method", "full"], capsys)
    assert {"lora", "qlora"} & {t for a in finetune["alternatives"] for t in a["techniques"]}
