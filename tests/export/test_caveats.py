"""An export says what its target cannot carry: the HF export names the chunked loss it
drops, and a DeepSpeed export of a pure-bf16 plan says it needs an fp32 master partition."""

from __future__ import annotations

import json

from batchfit.export import export_caveats
from batchfit.frameworks import with_framework
from batchfit.hardware import get_gpu
from batchfit.models import resolve_model
from batchfit.plan import make_plan
from batchfit.spec import TrainingSetup
from tests._cli import run_cli


def test_hf_export_says_what_it_cannot_carry(capsys):
    args = ["plan", "gpt2", "--gpu", "a100-40gb", "--seq-len", "256", "--global-batch", "64"]
    args += ["--loss", "chunked", "--optimizer-impl", "fused", "--engine", "analytic"]
    code, out, err = run_cli([*args, "--export", "hf", "--json"], capsys)
    assert code == 0, err
    data = json.loads(out)
    assert data["exports"]["hf"]["training_arguments"]["optim"] == "adamw_torch_fused"
    assert any("chunked loss" in w for w in data["warnings"])


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


def test_hf_export_of_an_optimizer_transformers_cannot_name_leaves_optim_out(capsys):
    # transformers' OptimizerNames has no Adan: the export says how to hand it to the Trainer
    args = ["plan", "gpt2", "--gpu", "a100-40gb", "--seq-len", "256", "--global-batch", "64"]
    args += ["--optimizer", "adan", "--engine", "analytic"]
    code, out, err = run_cli([*args, "--export", "hf", "--json"], capsys)
    assert code == 0, err
    data = json.loads(out)
    assert "optim" not in data["exports"]["hf"]["training_arguments"]
    assert any("optimizer_cls_and_kwargs" in w for w in data["warnings"])
