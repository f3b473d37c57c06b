"""``estimate``: engine choice, own modules, and what falls back to the formulas."""

import pytest
import torch
from torch._subclasses import fake_tensor

import batchfit
from batchfit.errors import UsageError
from batchfit.hardware import get_gpu
from batchfit.memory.estimate import estimate
from batchfit.memory.trace import hf as _hf_trace
from batchfit.models import resolve_model
from batchfit.spec import TrainingSetup

GPT2 = resolve_model("gpt2")


def _net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))


def _batch() -> torch.Tensor:
    return torch.randn(4, 8)


def _loss(out: torch.Tensor, _batch: object) -> torch.Tensor:
    return out.square().mean()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"model": GPT2, "micro_batch_size": 1, "seq_len": 32},
        {"model": _net, "batch_fn": _batch, "loss_fn": _loss},
    ],
    ids=["catalog-model", "own-module"],
)
def test_unknown_engine_is_refused_naming_the_choices(kwargs):
    with pytest.raises(UsageError, match=r"engine 'bogus' is not one of: analytic, trace"):
        estimate(setup=TrainingSetup(), device="cpu", engine="bogus", **kwargs)


def test_the_analytic_engine_refuses_an_own_module_instead_of_tracing_it():
    with pytest.raises(UsageError, match=r"engine='analytic' needs a catalog or config model"):
        estimate(
            lambda: torch.nn.Linear(4, 4),
            TrainingSetup(),
            batch_fn=_batch,
            loss_fn=_loss,
            device="cpu",
            engine="analytic",
        )


def test_a_factory_that_returns_no_module_is_a_type_error_naming_the_fix():
    with pytest.raises(TypeError, match=r"returned 'int', not an nn.Module: .*lambda: MyNet\(\)"):
        estimate(lambda: 5, TrainingSetup(), batch_fn=_batch, loss_fn=_loss, device="cpu")


@pytest.mark.parametrize("bug", [TypeError, AttributeError, KeyError, RuntimeError])
def test_a_bug_in_the_dry_run_is_raised_not_answered_by_the_formulas(monkeypatch, bug):
    def broken(*_args, **_kwargs):
        raise bug("a bug in batchfit")

    monkeypatch.setattr(_hf_trace, "trace_once", broken)
    with pytest.raises(bug, match="a bug in batchfit"):
        estimate(GPT2, TrainingSetup(), micro_batch_size=1, seq_len=32, device="cpu")


@pytest.mark.parametrize(
    "limit",
    [
        fake_tensor.DataDependentOutputException(torch.ops.aten.nonzero.default),
        fake_tensor.UnsupportedOperatorException(torch.ops.aten.nonzero.default),
        NotImplementedError(),
        RuntimeError("Tensor.item() cannot be called on meta tensors"),
        ValueError("GPT2LMHeadModel does not support activation checkpointing."),
    ],
    ids=lambda e: type(e).__name__,
)
def test_what_a_dry_run_cannot_do_falls_back_to_the_formulas(monkeypatch, limit):
    def cannot(*_args, **_kwargs):
        raise limit

    monkeypatch.setattr(_hf_trace, "trace_once", cannot)
    est = estimate(GPT2, TrainingSetup(), micro_batch_size=1, seq_len=32, device="cpu")
    assert est.engine == "analytic"
    assert est.warnings[0].startswith("the trace engine cannot run this setup yet: the dry run")
    assert type(limit).__name__ in est.warnings[0]


@pytest.mark.parametrize("engine", ["analytic", "trace"])
def test_a_micro_batch_beyond_any_device_is_refused_in_one_line(engine):
    # the trace overflowed torch's storage size; the analytic engine printed 1.8e31 bytes
    with pytest.raises(UsageError, match=r"tokens in one micro-batch, beyond any device"):
        estimate(GPT2, TrainingSetup(), micro_batch_size=10**18, seq_len=128, engine=engine)


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
