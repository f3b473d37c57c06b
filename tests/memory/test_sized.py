"""A dry run at a new micro-batch size, interpolated from the histories of two traced sizes of
the same setup, is the dry run at that size: every moment, the peak and the allocator's
reserve. Where the histories cannot stand for other sizes it is refused and the size traced:
histories that do not line up, a traced size off their line, size 1, a loss cut into chunks
whose count follows the size. The plan's confirmations are traced, never interpolated."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

from batchfit.hardware import get_gpu
from batchfit.memory.estimate import interpolated_sizes
from batchfit.memory.fit import FitResult
from batchfit.memory.formulas.analytic import resolve_setup
from batchfit.memory.trace import estimate as trace_estimate
from batchfit.memory.trace import sized
from batchfit.memory.trace.result import PhaseResult, TraceResult
from batchfit.memory.types import MemoryEstimate
from batchfit.models import resolve_model
from batchfit.plan._max_micro_batch import _confirmed
from batchfit.spec import TrainingSetup
from batchfit.workload import Workload
from tests._tiny import TINY_GPT2

# each dry run once for the file, fresh histories for each test
from tests.memory._once import each_dry_run_once, histories_per_test  # noqa: F401

GPT2 = {**TINY_GPT2, "n_layer": 4}


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = tmp_path_factory.mktemp("sized") / "config.json"
    path.write_text(json.dumps(GPT2))
    return resolve_model(str(path))


def _at(
    model: Any, setup: TrainingSetup, micro: int, *, interpolate: bool, gpu_name: str = "t4"
) -> TraceResult:
    gpu = get_gpu(gpu_name)
    resolved = resolve_setup(model, setup, "cuda", gpu)
    work = Workload(micro, 64, "cuda", gpu, grad_accum_steps=1)
    with interpolated_sizes(interpolate):
        return trace_estimate.traced_result(model, resolved, work, full_depth=False)[0]


@pytest.mark.parametrize(
    "setup",
    [
        TrainingSetup(),
        TrainingSetup(method="lora", grad_ckpt=True, optimizer="adamw-8bit"),
        TrainingSetup(optimizer="sgd", grad_ckpt=True),
    ],
    ids=["full", "lora-ckpt-8bit", "sgd-ckpt"],
)
def test_an_interpolated_size_is_the_dry_run_at_that_size(gpt2, setup):
    for base in (2, 5):
        _at(gpt2, setup, base, interpolate=True)
    guess = _at(gpt2, setup, 11, interpolate=True)
    truth = _at(gpt2, setup, 11, interpolate=False)
    assert guess.seconds == 0.0 < truth.seconds  # no dry run made the guess
    assert guess.phases == truth.phases
    assert guess.reserved_bytes == truth.reserved_bytes > guess.peak.total
    assert guess.top_modules == truth.top_modules


@pytest.mark.parametrize("micro", [1, 2, 6])
def test_another_gpu_s_workspace_is_resized_not_traced_again(gpt2, micro):
    """An A100 and an H100 run the same kernels; only the cuBLAS workspace differs (8.1 and 32
    MiB per handle): the H100's dry runs are the A100's with the workspace resized."""
    setup = TrainingSetup(grad_ckpt=True)
    # a traced size is resized beside another traced one; a size off the traced ones is read
    # from the line through three
    for base in (1, 2, 5) if micro > 2 else (1, 2):
        _at(gpt2, setup, base, interpolate=True, gpu_name="a100-40gb")
    guess = _at(gpt2, setup, micro, interpolate=True, gpu_name="h100-80gb")
    truth = _at(gpt2, setup, micro, interpolate=False, gpu_name="h100-80gb")
    assert guess.seconds == 0.0 < truth.seconds
    assert guess.phases == truth.phases
    assert guess.reserved_bytes == truth.reserved_bytes


def test_without_interpolation_every_size_is_traced(gpt2):
    for base in (2, 5):
        _at(gpt2, TrainingSetup(), base, interpolate=True)
    assert _at(gpt2, TrainingSetup(), 11, interpolate=False).seconds > 0


@pytest.mark.parametrize(
    ("setup", "read"),
    [
        (TrainingSetup(loss="chunked"), True),  # 8 chunks of 64 tokens: equal at every size
        (TrainingSetup(loss="chunked", loop="keep-outputs"), True),  # cut along the sequence
        (TrainingSetup(loss="chunked", loss_chunk_tokens=24), False),  # their count follows
        (TrainingSetup(loss="fused"), False),  # 2 chunks a sample (96 words over 64 features)
    ],
    ids=["chunked", "keep-outputs", "chunk-tokens", "fused"],
)
def test_a_loss_in_chunks_is_read_from_histories_only_where_its_chunks_are_alike(gpt2, setup, read):
    """Where the chunks have the same count and size at every size, a third size is the
    line through two, as with the model's own loss; where they follow the tokens, it is
    traced."""
    for base in (2, 5):
        _at(gpt2, setup, base, interpolate=True)
    guess = _at(gpt2, setup, 11, interpolate=True)
    assert (guess.seconds == 0.0) == read
    if read:
        truth = _at(gpt2, setup, 11, interpolate=False)
        assert guess.phases == truth.phases
        assert guess.reserved_bytes == truth.reserved_bytes


def test_liger_s_loss_is_read_only_between_sizes_of_one_chunk_row_count(tmp_path):
    """1,000 words over 64 features: chunks of 32 rows from 5 to 8 samples of 64 tokens, 64
    rows from 9. Size 8 is the line through 5 and 6; size 9 is traced."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**GPT2, "vocab_size": 1000}))
    model, setup = resolve_model(str(path)), TrainingSetup(loss="fused")
    assert {sized.line_of(model, setup, 64, m) for m in (5, 6, 8)} == {"chunks of 32 rows"}
    assert sized.line_of(model, setup, 64, 9) == "chunks of 64 rows"
    for base in (5, 6):
        _at(model, setup, base, interpolate=True)
    guess = _at(model, setup, 8, interpolate=True)
    truth = _at(model, setup, 8, interpolate=False)
    assert guess.seconds == 0.0 < truth.seconds
    assert guess.phases == truth.phases
    assert guess.reserved_bytes == truth.reserved_bytes
    assert _at(model, setup, 9, interpolate=True).seconds > 0


def _run(grow: int, *, key: int = 1, extra: int = 0) -> TraceResult:
    """A fake dry run: weights of 100 bytes, an activation of ``grow`` bytes freed."""
    from batchfit.memory.trace.result import MomentLog

    events = ((0, 100), (key, grow), (key, -grow), *(((9, extra),) if extra else ()))
    log = MomentLog(events, ((0, ("forward|",), True),), {0: "weights", key: "activations"}, {})
    phase = PhaseResult("forward", {"weights": 100, "activations": grow}, "")
    return TraceResult((phase,), 1.0, events=events, moments=log)


def _remember(runs: dict[int, TraceResult]) -> None:
    for micro, run in runs.items():
        sized.remember("setup", micro, 0, (run,))


def test_histories_on_a_line_answer_any_size_above_one():
    _remember({1: _run(7), 2: _run(40), 4: _run(80)})
    (run,) = sized.runs_at("setup", 9) or ()
    assert run.events == ((0, 100), (1, 180), (1, -180))
    assert run.peak.total == 280
    assert sized.runs_at("setup", 1) is None  # one sample may take another path: traced
    assert sized.runs_at("setup", 4) is None  # traced already


@pytest.mark.parametrize(
    ("runs", "why"),
    [
        ({2: _run(40)}, "one size above 1 traced"),
        ({2: _run(40), 4: _run(80, key=2)}, "another storage"),
        ({2: _run(40), 4: _run(80, extra=8)}, "another count of events"),
        ({2: _run(40), 4: _run(81)}, "bytes off an integer line at 9 (40 + 20.5 x 7)"),
        ({2: _run(40), 4: _run(80), 6: _run(124)}, "a third traced size off the line"),
        ({2: _run(40), 4: _run(20)}, "an allocation that would turn into a free at 9"),
    ],
)
def test_histories_that_cannot_stand_for_another_size_are_refused(runs, why):
    _remember(runs)
    if why.startswith("bytes"):
        assert sized.runs_at("setup", 10) is not None  # on the line at even sizes
    assert sized.runs_at("setup", 9) is None, why


def _estimate(total: int) -> MemoryEstimate:
    return MemoryEstimate(
        "m", "trace", "cuda", 1, 1, TrainingSetup(), {}, total, total, total, 0, 0, "backward"
    )


def test_a_plan_confirms_its_size_by_dry_runs_not_histories():
    calls: list[tuple[int, bool]] = []

    def at(micro: int) -> MemoryEstimate:
        calls.append((micro, sized.enabled.get()))
        return _estimate(10 * micro)

    found = FitResult(7, _estimate(70), ((7, 70),))
    with interpolated_sizes():
        confirmed = _confirmed(found, at, budget=75, limit=100)
    assert confirmed is not None and confirmed.micro_batch_size == 7
    assert calls == [(7, False), (8, False)]
    # a search whose answer the dry runs contradict is searched again (None here)
    assert _confirmed(replace(found, micro_batch_size=6), at, budget=75, limit=100) is None


@pytest.mark.parametrize("confirm", [False, True])
def test_a_plan_search_lists_as_traced_only_the_sizes_it_dry_ran(gpt2, monkeypatch, confirm):
    """An alternative whose next size was read from histories is shown as not confirmed
    (``from_lines``), and the plan's own answer and the size after it are dry runs."""
    from batchfit.plan._max_micro_batch import fits, search_budget, traced_fit

    gpu = get_gpu("t4")
    setup = resolve_setup(gpt2, TrainingSetup(), "cuda", gpu)
    ran: list[int] = []
    dry_runs = trace_estimate._dry_runs

    def counted(model: Any, setup: Any, sizes: Any, depths: Any) -> Any:
        ran.append(sizes.micro)
        return dry_runs(model, setup, sizes, depths)

    monkeypatch.setattr(trace_estimate, "_dry_runs", counted)
    at_20 = fits(gpt2, setup, gpu, 20, 64, 1, 0, "trace")[1].device_total_bytes
    headroom = gpu.memory_bytes - at_20 - (1 << 20)  # about 20 fit
    with interpolated_sizes():
        found = traced_fit(gpt2, setup, gpu, 64, None, headroom, confirm=confirm)
    assert found.micro_batch_size > 2, ran
    assert {b for b, _ in found.traced} <= set(ran)
    if confirm:
        assert {found.micro_batch_size, found.micro_batch_size + 1} <= set(ran)
        assert found.estimate is not None
        assert found.estimate.device_total_bytes <= search_budget(gpu, headroom)
