"""Dry runs read from neighbouring setups' histories are the dry runs themselves: every moment,
the peak and the allocator's reserve, on CUDA (a rebuilt first step) and on the CPU.

A step of one micro-step read from a step of two (the later micro-step's forward and backward
left out); where the later micro-step keeps something it made or frees what it did not make,
nothing is read. A setup read at a new size from one traced size of its own and the line of
its sibling with another optimizer; without a sibling's line, it is traced."""

from __future__ import annotations

import json
from typing import Any

import pytest

from batchfit.hardware import get_gpu
from batchfit.memory.estimate import interpolated_sizes
from batchfit.memory.formulas.analytic import resolve_setup
from batchfit.memory.trace import alike, sized
from batchfit.memory.trace import estimate as trace_estimate
from batchfit.memory.trace.result import MomentLog, PhaseResult, TraceResult
from batchfit.models import resolve_model
from batchfit.spec import TrainingSetup
from batchfit.workload import Workload
from tests._tiny import TINY_GPT2

# each dry run once for the file, fresh histories for each test
from tests.memory._once import each_dry_run_once, histories_per_test  # noqa: F401


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = tmp_path_factory.mktemp("one_step") / "config.json"
    path.write_text(json.dumps({**TINY_GPT2, "n_layer": 4}))
    return resolve_model(str(path))


def _at(
    model: Any, setup: TrainingSetup, micro: int, accum: int = 2, device: str = "cuda"
) -> TraceResult:
    gpu = get_gpu("t4") if device == "cuda" else None
    resolved = resolve_setup(model, setup, device, gpu)  # type: ignore[arg-type]
    work = Workload(micro, 64, device, gpu, grad_accum_steps=accum)  # type: ignore[arg-type]
    return trace_estimate.traced_result(model, resolved, work, full_depth=False)[0]


@pytest.mark.parametrize(
    ("setup", "device", "traced"),
    [
        (TrainingSetup(), "cuda", (2, 3)),
        (TrainingSetup(grad_ckpt=True, optimizer="adamw-8bit"), "cuda", (5,)),
        (TrainingSetup(method="lora"), "cpu", (2, 3)),
    ],
    ids=["full-cuda-between", "ckpt-8bit-cuda-traced", "lora-cpu"],
)
def test_one_micro_step_from_two_is_the_dry_run(gpt2, setup, device, traced):
    with interpolated_sizes():
        for micro in traced:  # with two micro-steps, their histories kept
            _at(gpt2, setup, micro, 2, device)
        read = _at(gpt2, setup, 5, 1, device)
    assert sized.from_histories(read)
    assert not any("m2" in p.moment for p in read.phases)  # no later micro-step's moments
    truth = _at(gpt2, setup, 5, 1, device)
    assert not sized.from_histories(truth)
    assert read.phases == truth.phases
    assert read.peak == truth.peak
    assert read.reserved_bytes == truth.reserved_bytes
    assert read.top_modules == truth.top_modules


def test_without_histories_of_two_the_step_of_one_is_traced(gpt2):
    with interpolated_sizes():
        _at(gpt2, TrainingSetup(), 2, 2, "cuda")  # one size: no line to read 5 from
        assert not sized.from_histories(_at(gpt2, TrainingSetup(), 5, 1, "cuda"))


def _step(later: tuple[tuple[int, int], ...]) -> TraceResult:
    """A fake step of two micro-steps: weights (key 0), micro-step 1 makes an activation (1),
    ``later`` is micro-step 2's events, then the optimizer step."""
    events = ((0, 100), (1, 40), (1, -40), *later, (5, 8), (5, -8))
    marks = (
        (1, ("forward|s2m1",), True),
        (3, ("forward|s2m2",), True),
        (3 + len(later), ("optimizer-step|s2",), True),
    )
    log = MomentLog(events, marks, {0: "weights"}, {})
    phase = PhaseResult("forward", {"weights": 100, "activations": 40}, "s2m1")
    return TraceResult((phase,), 1.0, events=events, moments=log)


def test_the_later_micro_step_is_left_out_only_where_it_frees_what_it_made():
    (cut,) = alike.one_micro_step((_step(((2, 40), (2, -40))),)) or ()
    assert cut.events == ((0, 100), (1, 40), (1, -40), (5, 8), (5, -8))
    assert [m[0] for m in cut.moments.marks] == [1, 3]  # type: ignore[union-attr]
    assert alike.one_micro_step((_step(((2, 40),)),)) is None  # keeps what it made
    assert alike.one_micro_step((_step(((2, 40), (2, -40), (0, -100))),)) is None  # frees weights
    assert alike.one_micro_step(None) is None


@pytest.mark.parametrize(
    ("setup", "sibling", "device"),
    [
        (TrainingSetup(), TrainingSetup(optimizer_impl="fused"), "cuda"),
        (
            TrainingSetup(grad_ckpt=True),
            TrainingSetup(grad_ckpt=True, optimizer="adamw-8bit"),
            "cuda",
        ),
        (TrainingSetup(method="lora"), TrainingSetup(method="lora", optimizer="sgd"), "cpu"),
    ],
    ids=["fused-cuda", "ckpt-8bit-cuda", "lora-sgd-cpu"],
)
def test_another_optimizer_is_read_from_its_sibling_s_line(gpt2, setup, sibling, device):
    with interpolated_sizes():
        for micro in (2, 3):
            _at(gpt2, setup, micro, device=device)
        _at(gpt2, sibling, 2, device=device)  # one size of its own
        read = _at(gpt2, sibling, 7, device=device)
        one = _at(gpt2, sibling, 6, 1, device)  # and its step of one micro-step, cut
    for got, accum in ((read, 2), (one, 1)):
        assert sized.from_histories(got)
        truth = _at(gpt2, sibling, 7 if accum == 2 else 6, accum, device)
        assert not sized.from_histories(truth)
        assert (got.phases, got.peak, got.reserved_bytes) == (
            truth.phases,
            truth.peak,
            truth.reserved_bytes,
        )


def test_without_a_sibling_s_line_another_optimizer_is_traced(gpt2):
    with interpolated_sizes():
        _at(gpt2, TrainingSetup(), 2)  # the sibling has one size: no line
        _at(gpt2, TrainingSetup(optimizer="sgd"), 2)
        assert not sized.from_histories(_at(gpt2, TrainingSetup(optimizer="sgd"), 7))
    sized.forget()
    with interpolated_sizes():  # another method is not a sibling
        _at(gpt2, TrainingSetup(method="lora"), 2)
        _at(gpt2, TrainingSetup(method="lora"), 3)
        _at(gpt2, TrainingSetup(optimizer="sgd"), 2)
        assert not sized.from_histories(_at(gpt2, TrainingSetup(optimizer="sgd"), 6))
