"""``TrainingSetup``: defaults, contradictions refused, precision resolved by the device."""

import dataclasses

import pytest

from batchfit.errors import UsageError, python_spelling
from batchfit.spec import TrainingSetup


def test_defaults_and_frozen():
    setup = TrainingSetup()
    assert setup.optimizer == "adamw" and setup.method == "full"
    with pytest.raises(dataclasses.FrozenInstanceError):
        setup.optimizer = "sgd"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"precision": "fp8"}, "--precision"),
        ({"optimizer": "adamx"}, "--optimizer"),
        ({"method": "qlora", "precision": "fp32"}, "16-bit"),
        ({"offload": "optimizer"}, "needs ZeRO"),
        ({"offload": "optimizer+params", "sharding": "zero2"}, "zero3"),
        ({"num_gpus": 0}, "--num-gpus"),
        ({"lora_rank": 0}, "--lora-rank"),
        ({"lora_dropout": 1.0}, "--lora-dropout"),
        ({"lora_targets": ()}, "--lora-targets"),
        ({"lora_alpha": float("nan")}, "--lora-alpha must be a finite number"),
        ({"lora_alpha": float("inf")}, "--lora-alpha must be a finite number"),
        ({"lora_alpha": "8"}, "--lora-alpha must be a finite number"),
        ({"lora_dropout": float("nan")}, "--lora-dropout must be a finite number"),
        ({"lora_dropout": float("-inf")}, "--lora-dropout must be a finite number"),
    ],
)
def test_contradictions_and_bad_values_raise(kwargs, needle):
    # written as the command line says it; a Python caller reads the argument's name
    with pytest.raises(UsageError, match=python_spelling(needle).replace("+", r"\+")):
        TrainingSetup(**kwargs)


def test_auto_precision_by_device():
    assert TrainingSetup().resolved(device="cpu", bf16_supported=True).precision == "fp32"
    assert TrainingSetup().resolved(device="cuda", bf16_supported=True).precision == "amp-bf16"
    assert TrainingSetup().resolved(device="cuda", bf16_supported=False).precision == "amp-fp16"
    assert (
        TrainingSetup(precision="bf16").resolved(device="cpu", bf16_supported=False).precision
        == "bf16"
    )


def test_lists_become_tuples():
    setup = TrainingSetup(method="lora", lora_targets=["q_proj", "v_proj"])  # type: ignore[arg-type]
    assert setup.lora_targets == ("q_proj", "v_proj")
    hash(setup)


def test_pure_bf16_presets_on_a_gpu_without_bf16():
    t4 = dict(device="cuda", bf16_supported=False)
    tune = TrainingSetup(framework="torchtune", method="lora", lora_dtype="bf16").resolved(**t4)
    assert (tune.precision, tune.lora_dtype) == ("fp32", "fp32")
    lit = TrainingSetup(framework="litgpt", method="lora", lora_dtype="bf16").resolved(**t4)
    assert (lit.precision, lit.lora_dtype) == ("amp-fp16", "fp32")


def test_the_setup_says_what_the_planner_may_switch_on():
    assert TrainingSetup(num_gpus=2).can_shard and not TrainingSetup().can_shard
    assert not TrainingSetup(num_gpus=2, sharding="zero3").can_shard
    assert TrainingSetup().can_offload
    assert not TrainingSetup(method="qlora", precision="amp-bf16").can_offload
    assert (
        TrainingSetup().can_switch_to_lora and not TrainingSetup(method="lora").can_switch_to_lora
    )
    assert TrainingSetup().can_switch_to_pure_bf16(gpu_bf16=True)
    assert not TrainingSetup().can_switch_to_pure_bf16(gpu_bf16=False)  # a T4: no bf16
    # a pure-bf16 preset's "auto" already is pure bf16
    assert not TrainingSetup(framework="torchtune").can_switch_to_pure_bf16(gpu_bf16=True)
    assert TrainingSetup().can_switch_to_qlora(gpu_bf16=True)
    assert not TrainingSetup(precision="fp32").can_switch_to_qlora(gpu_bf16=True)
