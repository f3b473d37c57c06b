"""Issue #11's third new-user trial: plans whose alternatives, presets and exports disagreed
with `estimate`, and errors that named the wrong thing. Each test failed before its fix."""

from __future__ import annotations

import json

import pytest

from batchfit.export import export_caveats
from batchfit.frameworks import with_framework
from batchfit.hardware import get_gpu
from batchfit.models import resolve_model
from batchfit.plan import make_plan
from batchfit.plan._fit_table import fit_table
from batchfit.plan._ladder import LORA
from batchfit.spec import TrainingSetup
from tests._cli import run_cli


def test_the_lora_rung_keeps_the_presets_adapter_dtype():
    for framework in ("torchtune", "litgpt"):
        assert LORA(with_framework(TrainingSetup(), framework)).lora_dtype == "bf16"
    assert LORA(TrainingSetup()).lora_dtype == "fp32"


def test_torchtune_qlora_without_bf16_is_one_line_and_one_row(capsys):
    args = ["plan", "llama-3.2-1b", "--gpu", "t4", "--framework", "torchtune"]
    code, _, err = run_cli(
        [*args, "--method", "qlora", "-s", "512", "--global-batch", "16"], capsys
    )
    assert code == 2 and "torchtune's QLoRA needs bf16" in err
    setup = with_framework(TrainingSetup(method="qlora"), "torchtune")
    rows = fit_table(
        resolve_model("gpt2"),
        setup,
        [get_gpu("t4"), get_gpu("a100-40gb")],
        seq_len=256,
        engine="analytic",
    )
    assert rows[0].note and not rows[1].note and rows[1].max_micro_batch > 0


def test_a_deepspeed_export_of_a_pure_bf16_plan_says_it_needs_more():
    setup = with_framework(TrainingSetup(), "torchtune")
    plan = make_plan(
        resolve_model("gpt2"),
        get_gpu("a100-40gb"),
        setup,
        seq_len=256,
        global_batch=64,
        engine="analytic",
    )
    assert any("fp32 master partition" in c for c in export_caveats(plan, "deepspeed"))
    assert not export_caveats(
        make_plan(
            resolve_model("gpt2"),
            get_gpu("a100-40gb"),
            TrainingSetup(),
            seq_len=256,
            global_batch=64,
            engine="analytic",
        ),
        "deepspeed",
    )


@pytest.mark.slow
def test_the_alternatives_sizes_are_traced_and_fit():
    info = resolve_model("gpt2")
    gpu = get_gpu("t4")
    plan = make_plan(info, gpu, TrainingSetup(), seq_len=1024, global_batch=64)
    from batchfit.memory.estimate import estimate

    for alt in plan.alternatives:
        if alt.max_micro_batch:
            est = estimate(
                info,
                alt.setup,
                micro_batch_size=alt.max_micro_batch,
                seq_len=1024,
                gpu=gpu,
                grad_accum_steps=max(64 // alt.max_micro_batch, 1),
            )
            assert est.device_total_bytes == pytest.approx(alt.device_total_bytes, rel=0.03)
            assert est.device_total_bytes <= gpu.memory_bytes - plan.headroom_wanted_bytes


def test_errors_name_what_the_user_gave(tmp_path, capsys):
    code, _, err = run_cli(
        ["estimate", "resnet-50", "--gpu", "t4", "-b", "8", "--method", "lora"], capsys
    )
    assert code == 2 and "default targets" in err and "--lora-targets q_proj" not in err
    lengths = tmp_path / "l.txt"
    lengths.write_text("10\n20\n2000\n")
    code, _, err = run_cli(["estimate", "gpt2", "-b", "2", "--lengths", str(lengths)], capsys)
    assert code == 2 and "line 3" in err
    hist = tmp_path / "h.json"
    hist.write_text(json.dumps({"100": 2.5}))
    code, _, err = run_cli(["estimate", "gpt2", "-b", "2", "--lengths", str(hist)], capsys)
    assert code == 2 and "sample count" in err


@pytest.mark.slow
def test_an_image_model_says_its_lora_targets_are_assumed(capsys):
    code, out, err = run_cli(
        [
            "estimate",
            "vit-base-patch16-224",
            "-b",
            "2",
            "--gpu",
            "t4",
            "--method",
            "lora",
            "--json",
        ],
        capsys,
    )
    assert code == 0, err
    assert any("peft has no default LoRA targets" in w for w in json.loads(out)["warnings"])


@pytest.mark.slow
def test_qlora_quantises_gpt2s_conv1d_layers_in_both_engines():
    from batchfit.memory.estimate import estimate

    info, gpu = resolve_model("gpt2"), get_gpu("t4")
    kw = dict(micro_batch_size=2, seq_len=256, gpu=gpu)
    lora = estimate(info, TrainingSetup(method="lora", precision="amp-fp16"), **kw)
    trace = estimate(info, TrainingSetup(method="qlora", precision="amp-fp16"), **kw)
    analytic = estimate(
        info, TrainingSetup(method="qlora", precision="amp-fp16"), engine="analytic", **kw
    )
    assert trace.components["weights"] < 0.6 * lora.components["weights"]
    assert analytic.components["weights"] == pytest.approx(trace.components["weights"], rel=0.01)


def test_own_module_in_pure_bf16_takes_fp32_inputs():
    import torch

    import batchfit

    def net() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))

    est = batchfit.estimate(
        net,
        TrainingSetup(precision="bf16"),
        gpu=get_gpu("a100-40gb"),
        batch_fn=lambda: torch.randn(8, 64),
        loss_fn=lambda out, batch: out.float().sum(),
    )
    assert est.peak_bytes > 0
