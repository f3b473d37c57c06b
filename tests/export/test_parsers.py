"""Every export kind loads into the real parser it is written for.

hf -> ``transformers.TrainingArguments`` (+ ``peft.LoraConfig`` / ``BitsAndBytesConfig``);
lightning -> ``lightning.pytorch.Trainer``; accelerate -> accelerate's own config-file loader;
deepspeed -> ``deepspeed.runtime.config.DeepSpeedConfig``, which asserts
``train_batch_size == micro x accumulation x world size``.

This runs on CPU-only machines, so the GPU-only parts are swapped out, never the values under
test: Lightning's ``accelerator="gpu"`` becomes ``"cpu"``; ``TrainingArguments`` gets
``use_cpu=True`` (it refuses ``bf16=True`` otherwise); DeepSpeed's world size comes from a stub
``mpu`` instead of a process group.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import warnings
from functools import cache
from typing import Any, get_args

import pytest

from batchfit.export import _PEFT_TASK, EXPORT_KINDS, export, render
from batchfit.hardware import get_gpu
from batchfit.models import resolve_model
from batchfit.optimizers import OPTIMIZERS, get_optimizer
from batchfit.plan import Plan, make_plan
from batchfit.spec import TrainingSetup
from tests._cli import CONTRACT, run_cli

# The planner's logic, on the fast analytic engine (the trace engine's plans: test_fit.py,
# test_plan_estimate_agree.py).
make_plan_analytic = functools.partial(make_plan, engine="analytic")

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # read when deepspeed is first imported

# name -> (model, gpu, setup, make_plan keyword arguments)
PLANS: dict[str, tuple[str, str, TrainingSetup, dict[str, Any]]] = {
    # the CLI contract: single GPU, precision auto -> amp-bf16 on an Ampere card
    "gpt2-rtx3060-amp": (
        "gpt2",
        "rtx-3060",
        TrainingSetup(),
        {"seq_len": 256, "global_batch_tokens": 32768, "micro_batch_size": 16},
    ),
    # no bf16 on a T4: auto -> amp-fp16
    "gpt2-t4-amp-fp16": ("gpt2", "t4", TrainingSetup(), {"seq_len": 512, "global_batch": 32}),
    "gpt2-t4-fp16": (
        "gpt2",
        "t4",
        TrainingSetup(precision="fp16"),
        {"seq_len": 512, "global_batch": 32},
    ),
    "gpt2-a100-bf16": (
        "gpt2",
        "a100-40gb",
        TrainingSetup(precision="bf16"),
        {"seq_len": 512, "global_batch": 32, "base_lr": 1e-4, "base_batch": 16},
    ),
    "llama8b-a100-qlora": (
        "llama-3.1-8b",
        "a100-40gb",
        TrainingSetup(method="qlora"),
        {"seq_len": 2048, "global_batch": 32},
    ),
    "llama1b-t4-qlora-fp16": (
        "llama-3.2-1b",
        "t4",
        TrainingSetup(method="qlora", precision="amp-fp16"),
        {"seq_len": 1024, "global_batch": 16},
    ),
    "bert-lora-classification": (
        "bert-base-uncased",
        "t4",
        TrainingSetup(task="classification", method="lora", lora_rank=16, lora_alpha=32.0),
        {"seq_len": 512, "global_batch": 64},
    ),
    "gpt2-4gpu-ddp": (
        "gpt2",
        "a100-40gb",
        TrainingSetup(num_gpus=4),
        {"seq_len": 1024, "global_batch": 64},
    ),
    "llama8b-4gpu-zero2": (
        "llama-3.1-8b",
        "a100-80gb",
        TrainingSetup(num_gpus=4, sharding="zero2"),
        {"seq_len": 2048, "global_batch": 64, "base_lr": 2e-5, "base_batch": 32},
    ),
    "llama8b-4gpu-zero3-offload": (
        "llama-3.1-8b",
        "a100-40gb",
        TrainingSetup(num_gpus=4, sharding="zero3", offload="optimizer+params", grad_ckpt=True),
        {"seq_len": 2048, "global_batch": 64},
    ),
    "llama8b-4gpu-zero1-offload": (
        "llama-3.1-8b",
        "a100-80gb",
        TrainingSetup(num_gpus=4, sharding="zero1", offload="optimizer"),
        {"seq_len": 2048, "global_batch": 64},
    ),
    "gpt2-4gpu-fsdp-offload": (
        "gpt2",
        "a100-40gb",
        TrainingSetup(num_gpus=4, sharding="fsdp", offload="optimizer", grad_ckpt=True),
        {"seq_len": 1024, "global_batch": 64},
    ),
}
ZERO_PLANS = [name for name, spec in PLANS.items() if spec[2].sharding.startswith("zero")]


@cache
def plan_for(name: str) -> Plan:
    model, gpu, setup, kwargs = PLANS[name]
    return make_plan_analytic(resolve_model(model, setup.task), get_gpu(gpu), setup, **kwargs)


@pytest.fixture(params=list(PLANS))
def plan(request: pytest.FixtureRequest) -> Plan:
    return plan_for(request.param)


def test_plans_cover_what_they_claim():
    """The plans above really are the cases this file is meant to exercise."""
    precisions = {plan_for(n).setup.precision for n in PLANS}
    assert {"amp-bf16", "amp-fp16", "bf16", "fp16"} <= precisions
    assert {plan_for(n).setup.sharding for n in PLANS} >= {"none", "zero1", "zero2", "zero3"}
    assert plan_for("llama8b-4gpu-zero3-offload").setup.offload == "optimizer+params"
    assert plan_for("llama8b-a100-qlora").setup.method == "qlora"
    assert plan_for("gpt2-rtx3060-amp").num_gpus == 1
    assert plan_for("llama8b-4gpu-zero2").num_gpus == 4
    for name in PLANS:
        p = plan_for(name)
        assert p.micro_batch_size * p.grad_accum_steps * p.num_gpus == p.global_batch_size, name


def _use_cpu() -> bool:
    import torch

    return not torch.cuda.is_available()


# --------------------------------------------------------------------------- deepspeed


class _DataParallelOnly:
    """The slice of DeepSpeed's ``mpu`` interface that DeepSpeedConfig asks for."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size

    def get_data_parallel_world_size(self) -> int:
        return self.world_size

    def get_data_parallel_rank(self) -> int:
        return 0

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_rank(self) -> int:
        return 0


def deepspeed_parse(config: dict[str, Any], world_size: int, monkeypatch: pytest.MonkeyPatch):
    """``DeepSpeedConfig(config, mpu)`` with ``world_size`` data-parallel ranks, no process group.

    DeepSpeedConfig calls ``dist.get_rank()`` first and, when no process group exists, falls back
    to world size 1 and ignores ``mpu``; answering rank 0 makes it read the world size from mpu.
    """
    ds_config = pytest.importorskip("deepspeed.runtime.config")
    monkeypatch.setattr(ds_config.dist, "get_rank", lambda *args, **kwargs: 0)
    return ds_config.DeepSpeedConfig(config, mpu=_DataParallelOnly(world_size))


def test_deepspeed_config_parses(plan: Plan, monkeypatch: pytest.MonkeyPatch):
    data = export(plan, "deepspeed")
    assert json.loads(render(data, "deepspeed")) == data
    micro = data["train_micro_batch_size_per_gpu"]
    accum = data["gradient_accumulation_steps"]
    assert (micro, accum) == (plan.micro_batch_size, plan.grad_accum_steps)
    assert micro * accum * plan.num_gpus == data["train_batch_size"] == plan.global_batch_size

    cfg = deepspeed_parse(data, plan.num_gpus, monkeypatch)
    assert cfg.world_size == plan.num_gpus
    assert cfg.train_batch_size == plan.global_batch_size
    assert cfg.train_micro_batch_size_per_gpu == plan.micro_batch_size
    assert cfg.gradient_accumulation_steps == plan.grad_accum_steps
    # every key that was written is read back with the same value
    zero = data["zero_optimization"]
    assert cfg.zero_optimization_stage == zero["stage"]
    assert cfg.zero_config.stage == {"zero1": 1, "zero2": 2, "zero3": 3}.get(
        plan.setup.sharding, 3 if plan.setup.sharding == "fsdp" else 0
    )
    for key in ("offload_optimizer", "offload_param"):
        parsed = getattr(cfg.zero_config, key)
        if key in zero:
            assert parsed is not None and parsed.device == zero[key]["device"] == "cpu"
            assert parsed.pin_memory == zero[key]["pin_memory"]
        else:
            assert parsed is None
    assert cfg.bfloat16_config.enabled == data["bf16"]["enabled"]
    assert cfg.float16_config.enabled == data["fp16"]["enabled"]
    assert cfg.float16_config.loss_scale == data["fp16"]["loss_scale"]  # 0 = dynamic
    assert not (cfg.bfloat16_config.enabled and cfg.float16_config.enabled)
    assert cfg.bfloat16_config.enabled == (plan.setup.precision in ("bf16", "amp-bf16"))
    assert cfg.float16_config.enabled == (plan.setup.precision in ("fp16", "amp-fp16"))
    assert cfg.gradient_clipping == data["gradient_clipping"]
    if "optimizer" in data:
        assert cfg.optimizer_name == data["optimizer"]["type"].lower()
        assert cfg.optimizer_params == data["optimizer"]["params"]
        if plan.learning_rate is not None:
            assert cfg.optimizer_params["lr"] == pytest.approx(plan.learning_rate)
    known = {
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "zero_optimization",
        "bf16",
        "fp16",
        "gradient_clipping",
        "optimizer",
    }
    assert set(data) <= known, "DeepSpeedConfig ignores unknown top-level keys: check them here"


@pytest.mark.parametrize("name", ["gpt2-rtx3060-amp", "llama8b-4gpu-zero2"])
def test_deepspeed_checks_the_world_size(name: str, monkeypatch: pytest.MonkeyPatch):
    """The stub mpu really drives the batch assertion (so the parse above proves something)."""
    plan = plan_for(name)
    with pytest.raises(AssertionError, match="train_batch_size"):
        deepspeed_parse(export(plan, "deepspeed"), plan.num_gpus * 2, monkeypatch)


# --------------------------------------------------------------------------- hf


def _training_arguments(plan: Plan, tmp_path, monkeypatch: pytest.MonkeyPatch, kwargs=None):
    """``TrainingArguments(**kwargs)``, the DeepSpeed config inline as the export gives it."""
    transformers = pytest.importorskip("transformers")
    if kwargs is None:
        kwargs = export(plan, "hf")["training_arguments"]
    kwargs = {**kwargs, "output_dir": str(tmp_path / "out")}
    if _use_cpu():
        kwargs["use_cpu"] = True  # else bf16=True is refused: "Your setup doesn't support bf16/gpu"
    if "deepspeed" in kwargs:
        pytest.importorskip("deepspeed")
        # TrainingArguments checks the DeepSpeed config against world_size x micro x accumulation;
        # on this machine that would be 1 process, not the plan's GPUs.
        monkeypatch.setattr(
            transformers.TrainingArguments,
            "world_size",
            property(lambda self: plan.num_gpus),
        )
    return transformers.TrainingArguments(**kwargs)


def test_hf_training_arguments_construct(plan: Plan, tmp_path, monkeypatch: pytest.MonkeyPatch):
    from transformers import TrainingArguments

    data = export(plan, "hf")
    assert json.loads(render(data, "hf")) == data
    kwargs = data["training_arguments"]
    fields = {f.name for f in dataclasses.fields(TrainingArguments)}
    assert set(kwargs) <= fields, f"not TrainingArguments fields: {set(kwargs) - fields}"
    micro = kwargs["per_device_train_batch_size"]
    accum = kwargs["gradient_accumulation_steps"]
    assert (micro, accum) == (plan.micro_batch_size, plan.grad_accum_steps)
    assert micro * accum * plan.num_gpus == plan.global_batch_size
    assert kwargs["bf16"] == (plan.setup.precision in ("bf16", "amp-bf16"))
    assert kwargs["fp16"] == (plan.setup.precision in ("fp16", "amp-fp16"))

    args = _training_arguments(plan, tmp_path, monkeypatch)

    for key, value in kwargs.items():
        if key == "output_dir":
            continue
        if key == "fsdp_config":  # TrainingArguments adds its defaults to the dict
            assert value.items() <= args.fsdp_config.items()
            assert args.fsdp_config["cpu_offload"] == (plan.setup.offload != "none")
            assert args.fsdp_plugin_args["reshard_after_forward"] is True  # full_shard
            continue
        assert getattr(args, key) == value, key
    if plan.setup.sharding.startswith("zero"):
        assert args.hf_deepspeed_config.config["zero_optimization"]["stage"] == int(
            plan.setup.sharding[-1]
        )


def test_hf_export_is_accepted_without_a_warning(
    plan: Plan, tmp_path, monkeypatch: pytest.MonkeyPatch
):
    """No deprecated argument: `gradient_checkpointing` (a FutureWarning) and the `fsdp` string
    (a logged deprecation) were both written once."""
    transformers = pytest.importorskip("transformers")
    logged: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = logged.append  # type: ignore[method-assign]
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            args = _training_arguments(plan, tmp_path, monkeypatch)
    finally:
        logger.removeHandler(handler)
    assert isinstance(args, transformers.TrainingArguments)
    assert args.activation_checkpointing == plan.setup.grad_ckpt
    assert [r.getMessage() for r in logged if "deprecat" in r.getMessage().lower()] == []


def test_hf_export_names_no_other_file(plan: Plan):
    """The DeepSpeed config is inline: the hf export is one self-contained file."""
    kwargs = export(plan, "hf")["training_arguments"]
    if "deepspeed" in kwargs:
        assert kwargs["deepspeed"] == export(plan, "deepspeed")
    assert not any(isinstance(v, str) and v.endswith((".json", ".yaml")) for v in kwargs.values())


@pytest.mark.parametrize("name", ZERO_PLANS)
def test_hf_and_deepspeed_exports_agree(name: str, tmp_path, monkeypatch: pytest.MonkeyPatch):
    """TrainingArguments(deepspeed=...) compares the two; Trainer raises on any mismatch."""
    plan = plan_for(name)
    args = _training_arguments(plan, tmp_path, monkeypatch)
    assert args.hf_deepspeed_config.mismatches == []


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_hf_every_optimizer_is_a_training_arguments_optim(
    optimizer: str, tmp_path, monkeypatch: pytest.MonkeyPatch
):
    from transformers.training_args import OptimizerNames

    names = get_optimizer(optimizer).export
    # None: transformers has no name (the export leaves optim out and warns, test_caveats.py)
    assert names.hf_optim in {None, *(o.value for o in OptimizerNames)}
    assert names.hf_optim_fused in {None, *(o.value for o in OptimizerNames)}
    plan = make_plan_analytic(
        resolve_model("gpt2"),
        get_gpu("a100-80gb"),
        TrainingSetup(optimizer=optimizer),  # type: ignore[arg-type]
        seq_len=512,
        global_batch=32,
        base_lr=1e-4,
        base_batch=16,
    )
    kwargs = export(plan, "hf")["training_arguments"]
    args = _training_arguments(plan, tmp_path, monkeypatch, kwargs)
    assert ("optim" in kwargs) == (names.hf_optim is not None)
    if names.hf_optim is not None:
        assert args.optim == kwargs["optim"]
    assert args.learning_rate == pytest.approx(plan.learning_rate)
    assert args.optim_args == kwargs.get("optim_args")


@pytest.mark.parametrize("kind", ["hf", "lightning"])
@pytest.mark.parametrize(
    "name",
    [n for n in PLANS if PLANS[n][2].method in ("lora", "qlora")],
)
def test_peft_and_quantisation_settings_construct(name: str, kind: str):
    import torch

    peft = pytest.importorskip("peft")
    from transformers import BitsAndBytesConfig

    plan = plan_for(name)
    data = export(plan, kind)
    lora = data["lora_config"]
    config = peft.LoraConfig(**lora)
    assert config.r == plan.setup.lora_rank
    assert config.lora_alpha == plan.setup.lora_alpha
    assert config.lora_dropout == plan.setup.lora_dropout
    assert set(config.target_modules) == set(plan.lora_targets) == set(lora["target_modules"])
    assert config.task_type == lora["task_type"] == _PEFT_TASK[plan.task]

    half = torch.float16 if plan.setup.precision.endswith("fp16") else torch.bfloat16
    if plan.setup.method == "qlora":
        bnb = BitsAndBytesConfig(**data["bnb_config"])
        assert bnb.load_in_4bit and not bnb.load_in_8bit
        assert bnb.bnb_4bit_quant_type == "nf4"
        assert bnb.bnb_4bit_use_double_quant is True
        assert bnb.bnb_4bit_compute_dtype == half
    else:
        assert "bnb_config" not in data
    dtype_name = data["from_pretrained_kwargs"]["torch_dtype"]
    assert getattr(torch, dtype_name) == half


def test_every_peft_task_type_is_a_peft_task_type():
    peft = pytest.importorskip("peft")
    assert set(_PEFT_TASK.values()) <= {t.value for t in peft.TaskType}


# --------------------------------------------------------------------------- lightning


def test_lightning_trainer_constructs(plan: Plan, tmp_path):
    pytest.importorskip("lightning")
    from lightning.fabric.plugins.precision.precision import _PRECISION_INPUT_STR
    from lightning.pytorch import Trainer
    from lightning.pytorch.strategies import (
        DDPStrategy,
        DeepSpeedStrategy,
        SingleDeviceStrategy,
        StrategyRegistry,
    )

    data = export(plan, "lightning")
    assert json.loads(render(data, "lightning")) == data
    kwargs = dict(data["trainer"])
    batch = data["dataloader"]["batch_size"]
    accum = kwargs["accumulate_grad_batches"]
    assert (batch, accum) == (plan.micro_batch_size, plan.grad_accum_steps)
    assert batch * accum * kwargs["devices"] == plan.global_batch_size
    assert kwargs["devices"] == plan.num_gpus
    assert kwargs["precision"] in get_args(_PRECISION_INPUT_STR)

    strategy = kwargs["strategy"]
    assert strategy in {"auto", *StrategyRegistry.available_strategies()}, strategy
    assert kwargs.pop("accelerator") == "gpu"
    if strategy.startswith("deepspeed"):
        pytest.importorskip("deepspeed")
    if strategy == "fsdp":  # Lightning refuses FSDP without a GPU: build the strategy alone
        assert type(StrategyRegistry.get(strategy)).__name__ == "FSDPStrategy"
        kwargs["strategy"] = "ddp"
    trainer = Trainer(
        accelerator="cpu",
        **kwargs,
        default_root_dir=str(tmp_path),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    assert trainer.accumulate_grad_batches == plan.grad_accum_steps
    assert trainer.num_devices == plan.num_gpus
    wanted = kwargs["precision"]
    got = trainer.precision_plugin.precision
    # Lightning turns 16-mixed into bf16-mixed on the CPU (no fp16 autocast there)
    assert got == wanted or (wanted, got) == ("16-mixed", "bf16-mixed"), (wanted, got)
    if strategy.startswith("deepspeed"):
        assert isinstance(trainer.strategy, DeepSpeedStrategy)
        zero = trainer.strategy.config["zero_optimization"]
        stage = int(plan.setup.sharding[-1])
        if stage == 1 and plan.setup.offload != "none":
            # No stage-1 offload strategy in Lightning: the export says it uses stage 2.
            assert "stage 2" in " ".join(export(plan, "lightning")["notes"])
            stage = 2
        assert zero["stage"] == stage
        assert ("offload_optimizer" in zero) == (plan.setup.offload != "none")
        assert ("offload_param" in zero) == (plan.setup.offload == "optimizer+params")
    elif strategy == "ddp":
        assert isinstance(trainer.strategy, DDPStrategy)
    elif strategy == "auto":
        assert plan.num_gpus == 1 and isinstance(trainer.strategy, SingleDeviceStrategy)


# --------------------------------------------------------------------------- accelerate


def _launch_option_names() -> set[str]:
    from accelerate.commands.launch import launch_command_parser

    return {action.dest for action in launch_command_parser()._actions}


def test_accelerate_config_loads(plan: Plan, tmp_path):
    pytest.importorskip("accelerate")
    import yaml
    from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file
    from accelerate.utils import DistributedType

    data = export(plan, "accelerate")
    text = render(data, "accelerate")
    assert yaml.safe_load(text) == data
    path = tmp_path / "accelerate.yaml"
    path.write_text(text, encoding="utf-8")

    # the loader `accelerate launch --config_file` uses; it rejects unknown top-level keys
    cfg = load_config_from_file(str(path))
    assert isinstance(cfg, ClusterConfig)
    assert cfg.num_processes == data["num_processes"] == plan.num_gpus
    assert cfg.num_machines == 1
    assert cfg.mixed_precision == data["mixed_precision"]
    assert cfg.mixed_precision == {
        "amp-bf16": "bf16",
        "bf16": "bf16",
        "amp-fp16": "fp16",
        "fp16": "fp16",
    }.get(plan.setup.precision, "no")
    assert cfg.distributed_type == DistributedType(data["distributed_type"])
    sharding = plan.setup.sharding
    if sharding.startswith("zero"):
        assert cfg.distributed_type == DistributedType.DEEPSPEED
        ds = cfg.deepspeed_config
        assert ds["zero_stage"] == int(sharding[-1])
        assert ds["zero_stage"] == export(plan, "deepspeed")["zero_optimization"]["stage"]
        assert ds["gradient_accumulation_steps"] == plan.grad_accum_steps
        offload = plan.setup.offload
        assert ds["offload_optimizer_device"] == ("cpu" if offload != "none" else "none")
        assert ds["offload_param_device"] == ("cpu" if offload == "optimizer+params" else "none")
        assert ds["zero3_init_flag"] == (sharding == "zero3")
    elif sharding == "fsdp":
        assert cfg.distributed_type == DistributedType.FSDP
        assert cfg.fsdp_config["fsdp_offload_params"] == (plan.setup.offload != "none")
    else:
        want = DistributedType.MULTI_GPU if plan.num_gpus > 1 else DistributedType.NO
        assert cfg.distributed_type == want
    # micro-batch lives in the training script; the rest of the arithmetic is here
    accum = cfg.deepspeed_config.get("gradient_accumulation_steps", plan.grad_accum_steps)
    assert plan.micro_batch_size * accum * cfg.num_processes == plan.global_batch_size

    # the loader does not check nested keys; `accelerate launch` copies them onto its own
    # options (fsdp_config keys with an fsdp_ prefix), so each must be one of those options
    options = _launch_option_names()
    nested = list(cfg.deepspeed_config) + [
        k if k.startswith("fsdp") else f"fsdp_{k}" for k in cfg.fsdp_config
    ]
    assert [k for k in nested if k not in options] == []


# --------------------------------------------------------------------------- CLI


@pytest.mark.parametrize("kind", EXPORT_KINDS)
def test_cli_writes_the_export(kind: str, tmp_path, capsys):
    target = tmp_path / ("export.yaml" if kind == "accelerate" else "export.json")
    # by the formulas, as plan_for: the file written is what is tested, not the engine
    args = [*CONTRACT, "--export", kind, "--out", str(target), "--engine", "analytic"]
    assert run_cli(args, capsys)[0] == 0
    expected = export(plan_for("gpt2-rtx3060-amp"), kind)
    assert target.read_text(encoding="utf-8") == render(expected, kind)
    if kind == "accelerate":
        from accelerate.commands.config.config_args import load_config_from_file

        assert load_config_from_file(str(target)).num_processes == 1


def test_cli_deepspeed_file_parses(tmp_path, capsys, monkeypatch: pytest.MonkeyPatch):
    target = tmp_path / "ds_config.json"
    args = [*CONTRACT, "--export", "deepspeed", "--out", str(target), "--engine", "analytic"]
    assert run_cli(args, capsys)[0] == 0
    data = json.loads(target.read_text(encoding="utf-8"))
    assert data["train_micro_batch_size_per_gpu"] == 16
    assert data["gradient_accumulation_steps"] == 8
    assert data["train_batch_size"] == 16 * 8 * 1 == 32768 // 256
    cfg = deepspeed_parse(data, 1, monkeypatch)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu) == (128, 16)
    assert cfg.gradient_accumulation_steps == 8
    assert cfg.bfloat16_config.enabled  # rtx-3060 is Ampere: auto -> amp-bf16


@pytest.mark.parametrize("kind", ["deepspeed", "hf", "lightning"])
def test_an_export_without_out_is_stdouts_only_text(kind, capsys):
    # `plan ... --export deepspeed > ds_config.json` gives a file the framework reads
    code, out, err = run_cli([*CONTRACT, "--export", kind, "--engine", "analytic"], capsys)
    assert code == 0, err
    json.loads(out)  # nothing but the export
    assert "micro-batch" in err and "launch:" in err  # the plan, on stderr


def test_more_gpus_than_a_node_launch_on_several_machines():
    from batchfit.export import accelerate_config, launch_command, lightning_trainer_kwargs
    from batchfit.hardware import get_gpu
    from batchfit.models import resolve_model
    from batchfit.plan import make_plan
    from batchfit.spec import TrainingSetup

    p = make_plan(
        resolve_model("gpt2"),
        get_gpu("a100-80gb"),
        TrainingSetup(num_gpus=16, sharding="zero2"),
        seq_len=1024,
        global_batch=256,
        engine="analytic",
    )
    assert launch_command(p, "deepspeed") == (
        "deepspeed --hostfile hostfile --num_nodes 2 --num_gpus 8 train.py --deepspeed "
        "ds_config.json"
    )
    assert "--nnodes 2 --nproc-per-node 8" in launch_command(p, "hf")
    assert "--machine_rank $NODE_RANK" in launch_command(p, "accelerate")
    config = accelerate_config(p)
    assert config["num_machines"] == 2 and config["num_processes"] == 16
    trainer = lightning_trainer_kwargs(p)
    assert trainer["devices"] == 8 and trainer["num_nodes"] == 2
