"""``PlanRequest``: each rule refuses a bad value with the fix; the request and the keyword form
of ``make_plan`` plan the same; a request cannot be changed."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Any

import pytest

import batchfit
from batchfit.errors import UsageError, python_spelling
from batchfit.hardware import get_gpu
from batchfit.lengths import LengthsSummary
from batchfit.models import resolve_model
from batchfit.plan import PlanRequest, make_plan, make_plan_auto
from batchfit.spec import TrainingSetup
from tests._tiny import TINY_VIT

GPT2 = resolve_model("gpt2")
VIT = resolve_model("vit-base-patch16-224")
T4 = get_gpu("t4")
GPT2_BATCH = {"seq_len": 1024, "global_batch": 64, "engine": "analytic"}


def _request(**changes: Any) -> PlanRequest:
    fields: dict[str, Any] = {"model": GPT2, "gpu": T4, **GPT2_BATCH, **changes}
    return PlanRequest(**fields)


def _lengths(padding: str, seq_len: int = 512) -> LengthsSummary:
    return LengthsSummary(seq_len, padding, seq_len, seq_len / 2, 100, ("lengths.txt",))  # type: ignore[arg-type]


def _factory() -> object:  # an own-model factory: never built by these checks
    raise AssertionError("not called")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        # the target batch: one unit, reachable on the GPUs
        ({"global_batch": None}, "exactly one of --global-batch"),
        ({"global_batch_tokens": 65536}, "exactly one of --global-batch"),
        ({"global_batch": 0}, "--global-batch must be positive, got 0"),
        ({"setup": TrainingSetup(num_gpus=3)}, "cannot be split evenly over 3 GPUs"),
        (
            {"global_batch": None, "global_batch_tokens": 1000},
            "not a multiple of seq-len x GPUs = 1024; nearest reachable: 1,024 tokens",
        ),
        # tokens for a token model, and its sample size
        ({"seq_len": None}, "make_plan needs seq_len"),
        ({"seq_len": 0}, "--seq-len must be a positive integer"),
        ({"seq_len": 4096}, "1024 learned positions"),
        ({"image_size": 224}, "--image-size is for image models; gpt2 reads tokens"),
        ({"seq_len": 1024, "lengths": _lengths("max")}, "seq_len 1024 and lengths"),
        (
            {
                "seq_len": None,
                "lengths": _lengths("longest"),
                "global_batch": None,
                "global_batch_tokens": 65536,
            },
            "--padding longest",
        ),
        # a catalog model builds its own batches
        ({"batch_fn": lambda n: n}, "batch_fn and loss_fn are for your own nn.Module"),
        # the GPU count
        ({"num_gpus": "auto", "setup": TrainingSetup(num_gpus=2)}, "give it without a number"),
        ({"num_gpus": 0}, "--num-gpus must be a positive integer or 'auto', got 0"),
        ({"num_gpus": 2, "setup": TrainingSetup(num_gpus=4)}, "disagree: give the count once"),
        ({"max_gpus": 4}, "--max-gpus goes with --num-gpus auto"),
        ({"num_gpus": "auto", "max_gpus": 0}, "--max-gpus must be 1 to"),
        # the run's length, and its price
        ({"epochs": 2.0}, "--epochs and --dataset-size go together"),
        ({"dataset_size": 1000}, "--epochs and --dataset-size go together"),
        ({"epochs": 0.0, "dataset_size": 1000}, "--epochs must be positive, got 0.0"),
        ({"epochs": math.nan, "dataset_size": 1000}, "--epochs must be positive, got nan"),
        # a dataset size below 1 is the product's, as `batchfit plan` has always said it
        ({"epochs": 1.0, "dataset_size": 0}, "--epochs x --dataset-size must be a positive"),
        ({"epochs": 1.0, "dataset_size": 2.5}, "--dataset-size must be a whole number"),
        ({"epochs": math.inf, "dataset_size": 10}, "must be a finite number of samples"),
        ({"epochs": 1.0, "dataset_size": 9, "train_samples": 9}, "not both"),
        ({"train_tokens": 0}, "--train-tokens must be a positive number, got 0"),
        ({"train_tokens": 10**9, "train_samples": 10**6}, "give --train-tokens or --epochs"),
        ({"gpu_hour_price": 2.0}, "--gpu-hour-price prices the run: give its length too"),
        ({"gpu_hour_price": -1.0}, "--gpu-hour-price must be a positive number of dollars"),
        # the micro-batch and the LR's base
        ({"micro_batch_size": 0}, "--micro-batch must be positive, got 0"),
        ({"micro_batch_size": 3}, "--micro-batch 3 does not divide the 64 samples"),
        ({"base_lr": 3e-4}, "give --base-lr with --base-batch"),
        ({"base_batch": 256}, "give --base-lr with --base-batch"),
        ({"base_lr": 3e-4, "base_batch": 8, "base_batch_tokens": 8192}, "not both"),
        ({"base_betas": (0.9, 0.95)}, "--base-betas and --base-eps go with --base-lr"),
        ({"critical_batch": 64, "critical_batch_tokens": 65536}, "not both"),
        # the headroom, the engine, the GPU
        ({"headroom_bytes": -1}, "headroom_bytes must be a whole number of bytes from 0"),
        ({"headroom_bytes": T4.memory_bytes}, "--headroom 15.00 GiB is all of t4's 15.00 GiB"),
        ({"headroom_bytes": "16GiB"}, "--headroom 16GiB is all of t4's 15.00 GiB: keep less"),
        ({"headroom_bytes": "lots"}, "--headroom 'lots' is not a size"),
        ({"headroom_bytes": 1.5}, "headroom_bytes must be a whole number of bytes from 0"),
        ({"engine": "fast"}, "engine must be 'trace' or 'analytic', got 'fast'"),
        ({"gpu": "t4"}, "gpu must be a GpuSpec"),
    ],
)
def test_each_rule_raises_with_the_fix(changes: dict[str, Any], message: str) -> None:
    # written as the command line says it; a Python caller reads the argument's name
    with pytest.raises(UsageError, match=re.escape(python_spelling(message))):
        _request(**changes)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        # a price without the run's length first, unless epochs were given without a size
        ({"gpu_hour_price": 2.0, "dataset_size": 10}, "--gpu-hour-price prices the run"),
        ({"gpu_hour_price": 2.0, "epochs": 2.0}, "--epochs and --dataset-size go together"),
        ({"max_gpus": 4, "epochs": 2.0}, "--max-gpus goes with --num-gpus auto"),
        ({"headroom_bytes": "16GiB", "epochs": 2.0}, "--epochs and --dataset-size go together"),
        ({"headroom_bytes": "16GiB", "gpu_hour_price": 2.0}, "--gpu-hour-price prices the run"),
        ({"headroom_bytes": "16GiB", "global_batch": 0}, "--headroom 16GiB is all of"),
        ({"headroom_bytes": "16GiB", "micro_batch_size": 3}, "--headroom 16GiB is all of"),
        ({"headroom_bytes": "16GiB", "seq_len": 4096}, "--headroom 16GiB is all of"),
        # the run's size comes after the target batch, and before the micro-batch
        (
            {"epochs": 1.0, "dataset_size": 0, "global_batch": None, "global_batch_tokens": 1000},
            "--global-batch-tokens 1000 is not a multiple",
        ),
        (
            {"epochs": 1.0, "dataset_size": 0, "micro_batch_size": 3},
            "--epochs x --dataset-size must be a positive number, got 0",
        ),
        (
            {"train_tokens": 10**9, "epochs": 1.0, "dataset_size": 10, "gpu_hour_price": -1.0},
            "give --train-tokens or --epochs with --dataset-size, not both",
        ),
    ],
)
def test_two_mistakes_name_the_one_batchfit_plan_names(
    changes: dict[str, Any], message: str
) -> None:
    with pytest.raises(UsageError, match=python_spelling(message)):
        _request(**changes)


def test_the_headroom_as_typed() -> None:
    auto = _request(headroom_bytes=" AUTO ")  # as `--headroom` takes it
    assert auto.headroom_auto and auto.headroom_wanted_bytes is None
    assert _request(headroom_bytes="1GiB").headroom_wanted_bytes == 2**30
    assert _request(headroom_bytes=0).headroom_wanted_bytes == 0
    assert not _request(headroom_bytes="0.5GiB").headroom_auto
    # tokens on an image model is a sample rule: the headroom's comes first
    with pytest.raises(UsageError, match="headroom_bytes 16GiB is all of"):
        PlanRequest(VIT, T4, global_batch_tokens=2048, headroom_bytes="16GiB")
    _same(make_plan(_request(headroom_bytes="2GiB")), make_plan(_request(headroom_bytes=2**31)))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"global_batch": None, "global_batch_tokens": 2048},
            "--global-batch-tokens counts tokens",
        ),
        ({"seq_len": 1024}, "--seq-len counts tokens; vit-base-patch16-224 is an image model"),
        ({"image_size": 0}, "--image-size must be a positive number of pixels"),
    ],
)
def test_an_image_model_takes_pixels_and_samples(changes: dict[str, Any], message: str) -> None:
    fields: dict[str, Any] = {"seq_len": None, "global_batch": 64, **changes}
    with pytest.raises(UsageError, match=python_spelling(message)):
        PlanRequest(VIT, T4, engine="analytic", **fields)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"batch_fn": None}, "batch_fn"),
        ({"engine": "analytic"}, "engine='trace'"),
        ({"global_batch": None, "global_batch_tokens": 64}, "needs seq_len"),
        ({"image_size": 32}, "image_size and lengths are for a catalog or config model"),
    ],
)
def test_your_own_module_needs_its_batches(changes: dict[str, Any], message: str) -> None:
    fields: dict[str, Any] = {"global_batch": 8, "batch_fn": lambda n: n, **changes}
    with pytest.raises(UsageError, match=python_spelling(message)):
        PlanRequest(_factory, T4, **fields)


def test_a_bad_value_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="global_batch must be positive"):
        _request(global_batch=-4)


def test_what_follows_from_the_inputs() -> None:
    r = _request(global_batch=None, global_batch_tokens=131072, num_gpus=2, micro_batch_size=8)
    assert (r.global_samples, r.per_gpu_samples, r.gpu_count) == (128, 64, 2)
    assert r.run_setup.num_gpus == 2 and r.setup.num_gpus == 1
    assert r.target_batch == (131072, "tokens")
    runs = _request(epochs=2.5, dataset_size=100)
    assert (runs.run_samples, runs.train_steps) == (250, 4)  # ceil(250 / 64)
    assert _request(seq_len=None, lengths=_lengths("packed")).sample_size == 512
    assert PlanRequest(VIT, T4, global_batch=8).sample_size == VIT.arch.image_size


def test_a_request_cannot_be_changed() -> None:
    r = _request()
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.global_batch = 128  # type: ignore[misc]
    with pytest.raises(UsageError, match="global_batch must be positive"):
        dataclasses.replace(r, global_batch=0)  # a changed copy is checked again


def _same(a: batchfit.Plan, b: batchfit.Plan) -> None:
    assert a == b
    assert json.dumps(a.to_json(), sort_keys=True) == json.dumps(b.to_json(), sort_keys=True)


@pytest.mark.parametrize(
    "options",
    [
        {"seq_len": 1024, "global_batch": 64},
        {"seq_len": 256, "global_batch_tokens": 32768, "micro_batch_size": 16},
        {
            "seq_len": 512,
            "global_batch": 256,
            "base_lr": 3e-4,
            "base_batch": 64,
            "critical_batch_tokens": 65536,
            "train_tokens": 10**9,
            "gpu_hour_price": 0.5,
            "headroom_bytes": 2**30,
        },
    ],
)
def test_the_keyword_form_and_the_request_plan_the_same(options: dict[str, Any]) -> None:
    setup = TrainingSetup(num_gpus=2, sharding="ddp")
    keywords = make_plan(GPT2, T4, setup, engine="analytic", **options)
    request = make_plan(PlanRequest(GPT2, T4, setup, engine="analytic", **options))
    _same(keywords, request)


# ``TINY_VIT`` narrowed to one layer of width 32 and 32 px images (4 patches): each rung of
# the plan's ladder is one dry run at a per-GPU batch of 2
SMALL_VIT = {
    **TINY_VIT,
    "hidden_size": 32,
    "num_hidden_layers": 1,
    "intermediate_size": 64,
    "image_size": 32,
}


def test_an_image_model_s_keyword_seq_len_is_its_image_size(tmp_path: Any) -> None:
    # the trace engine: the formulas model token models only
    config = tmp_path / "config.json"
    config.write_text(json.dumps(SMALL_VIT))
    vit = resolve_model(str(config))
    keywords = make_plan(vit, T4, TrainingSetup(), seq_len=32, global_batch=2)
    request = make_plan(PlanRequest(vit, T4, image_size=32, global_batch=2))
    _same(keywords, request)
    assert request.seq_len == 32 and request.estimate.engine == "trace"


def test_auto_gpus_by_keywords_and_by_request() -> None:
    gpu = get_gpu("a100-80gb")
    keywords = make_plan_auto(
        GPT2, gpu, TrainingSetup(), max_gpus=4, seq_len=1024, global_batch=64, engine="analytic"
    )
    request = PlanRequest(
        GPT2, gpu, num_gpus="auto", max_gpus=4, seq_len=1024, global_batch=64, engine="analytic"
    )
    seen: list[str] = []
    _same(keywords, make_plan(request, progress=seen.append))
    assert [c.num_gpus for c in keywords.gpu_counts] == [1, 2, 4] and len(seen) == 3


def test_auto_headroom_reads_the_calibration_records(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BATCHFIT_DATA_DIR", str(tmp_path))  # no records: the default share
    p = make_plan(_request(headroom_bytes="auto"))
    assert p.headroom_wanted_bytes == int(0.05 * T4.memory_bytes)
    assert p.warnings[0].startswith("--headroom auto: 5.0% of")
    _same(
        p.__class__(**{**p.__dict__, "warnings": p.warnings[1:]}),
        make_plan(_request(headroom_bytes=p.headroom_wanted_bytes)),
    )


def test_the_request_form_takes_nothing_else() -> None:
    with pytest.raises(TypeError, match="takes the request alone"):
        make_plan(_request(), T4)  # type: ignore[call-overload]


def test_plan_request_is_public() -> None:
    assert batchfit.PlanRequest is PlanRequest and "PlanRequest" in batchfit.__all__
