"""The step's timeline: one dry run of the whole step, its allocation stream by category."""

from __future__ import annotations

import pytest

from batchfit.hardware import get_gpu
from batchfit.memory.formulas.analytic import resolve_setup
from batchfit.memory.trace.estimate import estimate_trace
from batchfit.memory.trace.result import CATEGORIES
from batchfit.memory.trace.timeline import StepTimeline, step_timeline, traced_micro_steps
from batchfit.models import resolve_model
from batchfit.spec import TrainingSetup
from batchfit.workload import Workload


@pytest.fixture(scope="module")
def tiny(timeline_config: str) -> str:
    return timeline_config


def test_the_timeline_is_the_estimates_dry_run(tiny: str) -> None:
    model = resolve_model(tiny)
    setup = resolve_setup(model, TrainingSetup(), "cpu", None)
    tl = step_timeline(model, setup, micro_batch_size=2, seq_len=64, device="cpu", gpu=None)
    est = estimate_trace(
        model,
        TrainingSetup(),
        Workload(micro_batch_size=2, seq_len=64, device="cpu"),
        full_depth=True,
    )
    assert tl.peak_bytes == est.peak_bytes
    assert all(len(s) == len(tl.events) for s in tl.series.values())
    assert {p for _, p in tl.phases} >= {"forward", "backward", "optimizer-step", "zero-grad"}
    assert tl.reserved is None  # no allocator on the CPU


def test_cuda_timeline_draws_the_reserve_and_accumulation(
    cuda_timeline: StepTimeline,
) -> None:
    tl = cuda_timeline
    assert tl.reserved is not None
    totals = [sum(tl.series[c][i] for c in CATEGORIES) for i in range(len(tl.events))]
    assert all(r >= t for r, t in zip(tl.reserved, totals, strict=True))
    # two steps of two micro-steps: four forwards
    assert sum(1 for _, p in tl.phases if p == "forward") == 4
    assert "later micro-step" in tl.peak_label


def test_each_traced_step_runs_at_most_two_micro_steps(tiny: str) -> None:
    """What the report's caption says: accumulating 4, each of the two traced optimizer steps
    runs 2 micro-steps (forwards); the later ones are not traced."""
    model, gpu = resolve_model(tiny), get_gpu("t4")
    setup = resolve_setup(model, TrainingSetup(), "cuda", gpu)
    tl = step_timeline(
        model, setup, micro_batch_size=1, seq_len=32, device="cuda", gpu=gpu, grad_accum_steps=4
    )
    phases = [p for _, p in tl.phases]
    assert phases.count("optimizer-step") == 2
    assert phases.count("forward") == 2 * traced_micro_steps(4) == 4
    assert traced_micro_steps(1) == 1
