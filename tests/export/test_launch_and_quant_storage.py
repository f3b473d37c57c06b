"""Exports of sharded plans: QLoRA under FSDP stores its 4-bit weights in the model's dtype
(``bnb_4bit_quant_storage``), and the launch line follows the export (torchrun, ``python``,
``deepspeed`` or ``accelerate launch`` with the file that was written)."""

from __future__ import annotations

import json

import pytest

from batchfit.export import export, launch_command
from batchfit.hardware import get_gpu
from batchfit.models import resolve_model
from batchfit.plan import make_plan
from batchfit.spec import TrainingSetup
from tests._cli import run_cli


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
