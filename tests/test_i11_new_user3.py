"""More of issue #11's second new-user trial: framework-aware ladders and precisions, export
caveats, QLoRA on MoE, own-module warnings, wording. Each test failed before its fix."""

from __future__ import annotations

import json

import pytest
import torch

import batchfit
from batchfit.hardware import get_gpu
from batchfit.memory.estimate import estimate
from batchfit.models import resolve_model
from batchfit.plan._ladder import ladder
from batchfit.spec import TrainingSetup
from tests._cli import run_cli


def _rungs(setup: TrainingSetup, gpu: str) -> list[list[str]]:
    return [[t.name for t in c] for c in ladder(setup, get_gpu(gpu), resolve_model("gpt2"))]


def test_torchtune_ladder_has_no_deepspeed_rungs_and_no_redundant_pure_bf16():
    one = _rungs(TrainingSetup(framework="torchtune"), "a100-40gb")
    names = {n for combo in one for n in combo}
    assert not names & {"zero1", "zero2", "zero3", "offload-optimizer", "pure-bf16"}
    several = _rungs(TrainingSetup(framework="torchtune", num_gpus=4), "a100-40gb")
    assert any("fsdp" in combo for combo in several)
    plain = {n for combo in _rungs(TrainingSetup(), "a100-40gb") for n in combo}
    assert {"zero2", "offload-optimizer", "pure-bf16"} <= plain  # HF: unchanged


def test_pure_bf16_presets_on_a_gpu_without_bf16():
    t4 = dict(device="cuda", bf16_supported=False)
    tune = TrainingSetup(framework="torchtune", method="lora", lora_dtype="bf16").resolved(**t4)
    assert (tune.precision, tune.lora_dtype) == ("fp32", "fp32")
    lit = TrainingSetup(framework="litgpt", method="lora", lora_dtype="bf16").resolved(**t4)
    assert (lit.precision, lit.lora_dtype) == ("amp-fp16", "fp32")


def test_hf_export_says_what_it_cannot_carry(capsys):
    args = ["plan", "gpt2", "--gpu", "a100-40gb", "--seq-len", "256", "--global-batch", "64"]
    args += ["--loss", "chunked", "--optimizer-impl", "fused", "--engine", "analytic"]
    code, out, err = run_cli([*args, "--export", "hf", "--json"], capsys)
    assert code == 0, err
    data = json.loads(out)
    assert data["exports"]["hf"]["training_arguments"]["optim"] == "adamw_torch_fused"
    assert any("chunked loss" in w for w in data["warnings"])


@pytest.mark.slow
def test_qlora_on_moe_leaves_fused_experts_16bit_in_both_engines():
    info = resolve_model("qwen3-30b-a3b")
    setup = TrainingSetup(method="qlora", precision="amp-bf16")
    kw = dict(micro_batch_size=1, seq_len=128, gpu=get_gpu("h100-80gb"))
    trace = estimate(info, setup, engine="trace", **kw)
    analytic = estimate(info, setup, engine="analytic", **kw)
    experts = info.fused_expert_params()
    assert experts > 0.9 * info.total_params
    assert trace.components["weights"] > 2 * experts  # 16-bit, not 4-bit
    assert analytic.components["weights"] == pytest.approx(trace.components["weights"], rel=0.02)
    assert any("bitsandbytes leaves them 16-bit" in n for n in trace.extras["notes"])


def test_own_module_estimate_warns_on_batchnorm_and_reports_the_image_side():
    def net() -> torch.nn.Module:
        return torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3),
            torch.nn.BatchNorm2d(8),
            torch.nn.Flatten(),
            torch.nn.Linear(8 * 30 * 30, 10),
        )

    est = batchfit.estimate(
        net,
        TrainingSetup(),
        gpu=get_gpu("t4"),
        batch_fn=lambda: torch.randn(8, 3, 32, 32),
        loss_fn=lambda out, batch: out.sum(),
    )
    assert (est.micro_batch_size, est.seq_len) == (8, 32)
    assert any("BatchNorm" in w for w in est.warnings)


def test_models_table_shows_no_vocabulary_for_image_models(capsys):
    code, out, _ = run_cli(["models"], capsys)
    assert code == 0
    row = next(line for line in out.splitlines() if "convnext-tiny-224" in line)
    assert " 0 " not in row and "1/1" not in row


def test_lengths_messages_name_the_real_problem(tmp_path, capsys):
    lengths = tmp_path / "l.txt"
    lengths.write_text("100\n2000\n")
    code, _, err = run_cli(
        ["estimate", "gpt2", "-b", "2", "--lengths", str(lengths), "--seq-len", "2048"], capsys
    )
    assert code == 2 and "--seq-len 2048 is more than gpt2's 1024" in err
    code, _, err = run_cli(["estimate", "gpt2", "-b", "2", "--lengths", f"{lengths}:abc"], capsys)
    assert code == 2 and "the weight after ':'" in err
