"""Fixes from the new-user trial of #13: QLoRA under FSDP stores its 4-bit weights in the
model's dtype (F7), the launch line follows ``--export`` (F8), an implausible
``--throughput-from`` probe is named (F12), and one optimizer step is singular (F13)."""

import json

import pytest

from batchfit.export import export, launch_command
from batchfit.hardware import get_gpu
from batchfit.models import resolve_model
from batchfit.plan import make_plan
from batchfit.plan._throughput import ProbeFile, _implausible, bind
from batchfit.spec import TrainingSetup
from batchfit.speed import step_time
from tests._cli import run_cli

# --------------------------------------------------------------------------- F7


def _llama_plan(**setup):
    return make_plan(
        resolve_model("llama-3.1-8b"),
        get_gpu("h100-80gb"),
        TrainingSetup(num_gpus=8, **setup),
        seq_len=2048,
        global_batch_tokens=1 << 20,
        engine="analytic",
    )


@pytest.fixture(scope="module")
def qlora_fsdp():
    plan = _llama_plan(method="qlora", sharding="fsdp")
    assert plan.setup.sharding == "fsdp" and plan.setup.method == "qlora"
    return plan


@pytest.mark.parametrize("kind", ["hf", "lightning"])
def test_qlora_under_fsdp_stores_4bit_weights_in_the_model_dtype(qlora_fsdp, kind):
    data = export(qlora_fsdp, kind)
    storage = data["bnb_config"]["bnb_4bit_quant_storage"]
    assert storage == data["from_pretrained_kwargs"]["torch_dtype"] == "bfloat16"
    import torch
    from transformers import BitsAndBytesConfig

    bnb = BitsAndBytesConfig(**data["bnb_config"])
    assert bnb.bnb_4bit_quant_storage == torch.bfloat16


def test_qlora_without_fsdp_keeps_the_default_uint8_storage():
    plan = make_plan(
        resolve_model("llama-3.1-8b"),
        get_gpu("a100-80gb"),
        TrainingSetup(method="qlora"),
        seq_len=2048,
        global_batch=16,
        engine="analytic",
    )
    assert "bnb_4bit_quant_storage" not in export(plan, "hf")["bnb_config"]


def test_the_cli_export_carries_the_quant_storage(capsys):
    args = ["plan", "llama-3.1-8b", "--gpu", "h100-80gb", "--seq-len", "2048"]
    args += ["--global-batch-tokens", "1048576", "--sharding", "fsdp", "--method", "qlora"]
    args += ["--num-gpus", "8", "--export", "hf", "--engine", "analytic", "--json"]
    code, out, _ = run_cli(args, capsys)
    assert code == 0
    data = json.loads(out)
    assert data["exports"]["launch"] == "torchrun --nproc-per-node 8 train.py"


# --------------------------------------------------------------------------- F8


@pytest.fixture(scope="module")
def zero3():
    plan = _llama_plan(sharding="zero3")
    assert plan.setup.sharding == "zero3"
    return plan


def test_lightning_launches_its_own_processes(zero3, qlora_fsdp):
    assert export(zero3, "lightning")["trainer"]["strategy"].startswith("deepspeed_stage_3")
    assert launch_command(zero3, "lightning") == "python train.py"
    assert launch_command(qlora_fsdp, "lightning") == "python train.py"


def test_hf_launch_reads_no_file(zero3, qlora_fsdp):
    # the DeepSpeed dict is inline in TrainingArguments: torchrun, no --deepspeed FILE
    assert "deepspeed" in export(zero3, "hf")["training_arguments"]
    assert launch_command(zero3, "hf") == "torchrun --nproc-per-node 8 train.py"
    # fsdp=True in TrainingArguments: no accelerate.yaml was written to launch with
    assert launch_command(qlora_fsdp, "hf") == "torchrun --nproc-per-node 8 train.py"


def test_launch_names_the_file_that_was_exported(zero3, qlora_fsdp):
    assert launch_command(zero3, "deepspeed", "z.json") == (
        "deepspeed --num_gpus 8 train.py --deepspeed z.json"
    )
    # FSDP exported as DeepSpeed (ZeRO-3) still launches the file exported
    assert launch_command(qlora_fsdp, "deepspeed", "z.json").endswith("--deepspeed z.json")
    assert launch_command(zero3, "accelerate", "a.yaml") == (
        "accelerate launch --config_file a.yaml train.py"
    )
    assert launch_command(zero3) == "deepspeed --num_gpus 8 train.py --deepspeed ds_config.json"


def test_hf_on_one_gpu_with_inline_deepspeed_uses_torchrun():
    plan = make_plan(
        resolve_model("gpt2"),
        get_gpu("t4"),
        TrainingSetup(precision="fp16"),
        seq_len=256,
        global_batch=16,
        engine="analytic",
    )
    assert "deepspeed" in export(plan, "hf")["training_arguments"]
    assert launch_command(plan, "hf") == "torchrun --nproc-per-node 1 train.py"
    assert launch_command(plan, "lightning") == "python train.py"


# --------------------------------------------------------------------------- F12


def _probe(factor: float) -> tuple[ProbeFile, object, object, TrainingSetup]:
    """A probe of GPT-2 on a T4 whose steps are ``factor`` x the step-time model's compute."""
    from batchfit.memory.formulas.analytic import resolve_setup

    model, gpu, setup = resolve_model("gpt2"), get_gpu("t4"), TrainingSetup()
    theirs = resolve_setup(model, setup, "cuda", gpu)
    seconds = {}
    for n in (4, 8):
        t = step_time(model, theirs, gpu, micro_batch_size=n, seq_len=256)
        assert t is not None
        compute = t.step_seconds(1) - t.comm_micro_seconds - t.comm_step_seconds
        seconds[n] = factor * (compute - t.offload_seconds)
    probe = ProbeFile(
        path="probe.json",
        model="gpt2",
        device="cuda",
        gpu="t4",
        gpu_name="Tesla T4",
        seq_len=256,
        setup=setup,
        step_seconds=seconds,
        samples_per_s={n: n / s for n, s in seconds.items()},
    )
    return probe, model, gpu, setup


def test_a_plausible_probe_binds_without_a_warning():
    probe, model, gpu, setup = _probe(1.3)
    measured, note = bind(probe, model, gpu, setup, 256)
    assert measured is not None and note is None


@pytest.mark.parametrize("factor", [0.01, 0.15, 8.0])
def test_an_implausible_probe_is_named(factor):
    probe, model, gpu, setup = _probe(factor)
    measured, note = bind(probe, model, gpu, setup, 256)
    assert measured is not None  # still used, as asked
    assert note is not None and "\n" not in note
    assert f"{factor:.3g} x the model's predicted time" in note
    assert "edited" in note and "something else" in note


def test_over_the_peak_is_named_even_within_the_factor_bound():
    # factor 0.5 alone is plausible; a step faster than the GPU's peak is not
    assert _implausible("p", {4: 0.5, 8: 0.6}, {4: 0.6, 8: 0.7}) is None
    note = _implausible("p", {4: 0.5, 8: 0.6}, {4: 0.6, 8: 1.2})
    assert note is not None and "micro-batch 8" in note and "implied MFU 120%" in note


def test_the_plan_carries_the_warning():
    probe, model, gpu, setup = _probe(0.01)
    plan = make_plan(
        model, gpu, setup, seq_len=256, global_batch=16, throughput_from=probe, engine="analytic"
    )
    assert any("x the model's predicted time" in w for w in plan.warnings)


# --------------------------------------------------------------------------- F13


def test_one_optimizer_step_is_singular(capsys):
    args = ["plan", "gpt2", "--gpu", "rtx-3060", "--seq-len", "256"]
    args += ["--global-batch-tokens", "32768", "--train-tokens", "32768", "--engine", "analytic"]
    code, out, _ = run_cli(args, capsys)
    assert code == 0
    assert "1 optimizer step," in out and "1 optimizer steps" not in out
