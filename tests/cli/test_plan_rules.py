"""``batchfit plan`` checks no plan rule of its own: each error it gives for the plan's inputs
is the one ``PlanRequest`` raises for the same values, word for word, and with two mistakes it
names the same one first."""

from __future__ import annotations

import math
from typing import Any

import pytest

from batchfit.errors import UsageError
from batchfit.hardware import get_gpu
from batchfit.models import resolve_model
from batchfit.plan import PlanRequest
from tests._cli import run_cli

GPT2 = ["plan", "gpt2", "--gpu", "t4", "--seq-len", "1024"]
VIT = ["plan", "vit-base-patch16-224", "--gpu", "t4"]

CASES: list[tuple[list[str], dict[str, Any]]] = [
    # the headroom, as typed
    ([*GPT2, "--global-batch", "64", "--headroom", "16GiB"], {"headroom_bytes": "16GiB"}),
    ([*GPT2, "--global-batch", "64", "--headroom", "lots"], {"headroom_bytes": "lots"}),
    # the run's length and its price, in the command's order
    ([*GPT2, "--global-batch", "64", "--epochs", "2"], {"epochs": 2.0}),
    (
        [*GPT2, "--global-batch", "64", "--dataset-size", "10", "--gpu-hour-price", "3"],
        {"dataset_size": 10, "gpu_hour_price": 3.0},
    ),
    (
        [*GPT2, "--global-batch", "64", "--epochs", "2", "--gpu-hour-price", "3"],
        {"epochs": 2.0, "gpu_hour_price": 3.0},
    ),
    (
        [*GPT2, "--global-batch", "64", "--epochs", "0", "--dataset-size", "10"],
        {"epochs": 0.0, "dataset_size": 10},
    ),
    (
        [*GPT2, "--global-batch", "64", "--epochs", "1", "--dataset-size", "0"],
        {"epochs": 1.0, "dataset_size": 0},
    ),
    (
        [*GPT2, "--global-batch", "64", "--epochs", "inf", "--dataset-size", "10"],
        {"epochs": math.inf, "dataset_size": 10},
    ),
    (
        [*GPT2, "--global-batch", "64", "--headroom", "16GiB", "--epochs", "2"],
        {"headroom_bytes": "16GiB", "epochs": 2.0},
    ),
    (
        [
            *GPT2,
            "--global-batch",
            "64",
            "--train-tokens",
            "1B",
            "--epochs",
            "1",
            "--dataset-size",
            "10",
        ],
        {"train_tokens": 10**9, "epochs": 1.0, "dataset_size": 10},
    ),
    # the GPU count
    ([*GPT2, "--global-batch", "64", "--max-gpus", "4"], {"max_gpus": 4}),
    (
        [*GPT2, "--global-batch", "64", "--num-gpus", "auto", "--max-gpus", "0"],
        {"num_gpus": "auto", "max_gpus": 0},
    ),
    # the target batch in the model's unit
    ([*GPT2, "--global-batch-tokens", "1000"], {"global_batch": None, "global_batch_tokens": 1000}),
    (
        [*VIT, "--global-batch-tokens", "2048", "--headroom", "16GiB"],
        {"model": "vit", "global_batch": None, "global_batch_tokens": 2048, "seq_len": None}
        | {"headroom_bytes": "16GiB"},
    ),
    (
        [*VIT, "--global-batch-tokens", "2048"],
        {"model": "vit", "global_batch": None, "global_batch_tokens": 2048, "seq_len": None},
    ),
    ([*GPT2, "--global-batch", "64", "--micro-batch", "3"], {"micro_batch_size": 3}),
]


@pytest.mark.parametrize(("args", "changes"), CASES)
def test_the_command_gives_the_request_s_error(
    args: list[str], changes: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    model = resolve_model("vit-base-patch16-224" if changes.pop("model", "") else "gpt2")
    fields: dict[str, Any] = {"seq_len": 1024, "global_batch": 64, **changes}
    with pytest.raises(UsageError) as raised:
        PlanRequest(model, get_gpu("t4"), **fields)
    code, out, err = run_cli(args, capsys)
    assert (code, out, err) == (2, "", f"batchfit: error: {raised.value.args[0]}\n")
