import pytest
import torch
from torch._subclasses import fake_tensor

from batchfit.memory import _hf_trace
from batchfit.memory.estimate import estimate
from batchfit.models import resolve_model
from batchfit.spec import TrainingSetup

GPT2 = resolve_model("gpt2")


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
