"""Fitting the largest micro-batch from a few traces: the affine memory law, its moment lines,
and the limit."""

import math

import pytest

from batchfit.hardware import get_gpu
from batchfit.memory.fit import fit_micro_batch, fitting_guess, seeded_fit
from batchfit.memory.types import MemoryEstimate
from batchfit.models import resolve_model
from batchfit.plan._max_micro_batch import DEFAULT_HEADROOM_BYTES, search_budget, traced_fit
from batchfit.spec import TrainingSetup

GIB = 1 << 30


def law(fixed_gib: float, per_sample_gib: float, step_gib: float = 0.0, moments: bool = False):
    """A memory law: max(optimizer step (constant), backward (affine in the batch)); with
    ``moments`` the estimates carry each moment's bytes, as the trace engine's do."""
    calls: list[int] = []

    def at(b: int) -> MemoryEstimate:
        calls.append(b)
        step, backward = int(step_gib * GIB), int((fixed_gib + per_sample_gib * b) * GIB)
        total = max(step, backward)
        extras = {"moments": {"optimizer-step|s2": step, "backward|s2m1.head": backward}}
        return MemoryEstimate(
            "m",
            "trace",
            "cuda",
            b,
            1,
            TrainingSetup(),
            {},
            total,
            total,
            total,
            0,
            0,
            "backward",
            extras=extras if moments else {},
        )

    return at, calls


def test_affine_law_is_solved_and_confirmed_in_four_traces():
    at, calls = law(10, 3)
    result = fit_micro_batch(at, 40 * GIB)
    assert result.micro_batch_size == 10  # 10 + 3 * 10 = 40
    assert calls == [2, 3, 10, 11]  # the answer fits, the size after it does not


def test_moment_lines_see_through_a_flat_optimizer_step():
    # At b = 2, 3 the optimizer step is the peak (flat totals): the totals' secant cannot see
    # the backward line beneath it, each moment's own line can.
    at, calls = law(2, 1, step_gib=20, moments=True)
    result = fit_micro_batch(at, 30 * GIB, limit=4096)
    assert result.micro_batch_size == 28
    assert calls == [2, 3, 28, 29]


def test_constant_step_phase_hides_the_slope_then_refits():
    # At b = 2, 3 the optimizer step dominates (flat): the first guess overshoots, the re-fit
    # through a traced point below and above lands on the boundary.
    at, calls = law(2, 1, step_gib=20)
    result = fit_micro_batch(at, 30 * GIB, limit=4096)
    assert result.micro_batch_size == 28
    assert len(calls) <= 6
    assert all(total <= 30 * GIB for b, total in result.traced if b == result.micro_batch_size)


def _growing_reserve(at):
    """``at`` with a reserve of 4 GiB more past size 8 (fragmentation the lines through sizes
    1 and 2 cannot see)."""

    def grown(b: int) -> MemoryEstimate:
        est = at(b)
        extra = 4 * GIB if b > 8 else 0
        return MemoryEstimate(
            "m",
            "trace",
            "cuda",
            b,
            1,
            TrainingSetup(),
            {},
            est.peak_bytes,
            est.peak_bytes + extra,
            est.peak_bytes + extra,
            0,
            0,
            "backward",
            extras=est.extras,
        )

    return grown


def test_a_fitting_guess_traces_the_lines_answer_and_steps_down_until_it_fits():
    at, calls = law(10, 3, moments=True)
    assert fitting_guess(at, 40 * GIB).micro_batch_size == 10  # the lines' answer fits
    assert calls == [1, 2, 10]  # the size after it is not traced
    at, calls = law(10, 3, moments=True)
    guess = fitting_guess(_growing_reserve(at), 40 * GIB)
    assert guess is not None and guess.estimate is not None
    # 10 by the lines is 44 GiB: down the secant through 2 (16) and 10 (44), to 8 (34)
    assert (guess.micro_batch_size, calls) == (8, [1, 2, 10, 8])
    assert guess.estimate.device_total_bytes <= 40 * GIB
    at, _ = law(50, 1, moments=True)
    assert fitting_guess(at, 40 * GIB).micro_batch_size == 0  # not even 1
    at, _ = law(10, 3)  # no moments: no lines
    assert fitting_guess(at, 40 * GIB) is None


def _formulas(fixed_gib: float, per_sample_gib: float):
    """What the formulas say of a law (no trace): each device total in bytes."""
    return lambda b: int((fixed_gib + per_sample_gib * b) * GIB)


def test_a_seeded_search_confirms_the_formulas_answer_in_two_traces():
    at, calls = law(10, 3)
    found = seeded_fit(at, 40 * GIB, _formulas(10, 3))
    assert found.micro_batch_size == 10 and calls == [10, 11]
    at, calls = law(10, 3)
    assert seeded_fit(at, 40 * GIB, _formulas(10, 3), confirm=False).micro_batch_size == 10
    assert calls == [10]  # the slope says 11 does not fit: not traced


@pytest.mark.parametrize("seed_error", [0.7, 0.9, 0.97, 1.03, 1.2, 1.6])
@pytest.mark.parametrize(
    "shape", [(10, 3, 0.0), (2, 1, 20.0), (1, 0.05, 0.0), (30, 0.4, 0.0), (37, 2, 0.0)]
)
def test_a_seeded_search_finds_the_largest_fit_whatever_the_formulas_miss(
    seed_error: float, shape: tuple[float, float, float]
):
    """Formulas off by -30% .. +60% per sample (a flat optimizer step on top in one law): the
    confirmed answer is the law's own, and the unconfirmed one a size that fits below it."""
    fixed, per_sample, step = shape
    budget = 40 * GIB
    truth = max(
        (b for b in range(1, 5000) if max(step, fixed + per_sample * b) * GIB <= budget),
        default=0,
    )
    seed = _formulas(fixed * seed_error, per_sample * seed_error)
    at, calls = law(fixed, per_sample, step_gib=step)
    found = seeded_fit(at, budget, seed, limit=4096)
    assert found.micro_batch_size == min(truth, 4096)
    assert len(calls) <= 8
    at, calls = law(fixed, per_sample, step_gib=step)
    bound = seeded_fit(at, budget, seed, limit=4096, confirm=False).micro_batch_size
    assert 0 < bound <= truth and bound in calls


@pytest.mark.parametrize("seed_error", [0.8, 0.95, 1.05, 1.3])
@pytest.mark.parametrize("fixed", [2, 10])
@pytest.mark.parametrize("segment", [0.5, 2.0])
def test_a_staircase_of_totals_does_not_make_the_search_creep(
    seed_error: float, fixed: float, segment: float
):
    """Totals rounded up to whole allocator segments are flat across many sizes: a secant
    through two sizes on one stair is zero, and through two stairs creeps a size a trace. The
    search still ends at the law's own answer, within its traces."""

    def device_gib(b: int) -> float:
        return math.ceil((fixed + 0.05 * b) / segment) * segment

    calls: list[int] = []

    def at(b: int) -> MemoryEstimate:
        calls.append(b)
        t = int(device_gib(b) * GIB)
        return MemoryEstimate("m", "trace", "cuda", b, 1, TrainingSetup(), {}, t, t, t, 0, 0, "x")

    truth = max(b for b in range(1, 5000) if device_gib(b) <= 15)
    seed = _formulas(fixed, 0.05 * seed_error)
    assert seeded_fit(at, 15 * GIB, seed, limit=4096).micro_batch_size == truth
    assert len(calls) <= 10  # within the search's traces, not out of them


def test_a_flat_moment_under_the_budget_does_not_make_the_search_creep():
    """The optimizer step's flat peak (38 GiB) just under the budget, activations rising past it
    from size 120 on, formulas 50% high per sample: flat secants, stepped along the formulas'
    slope, must not keep stepping by the same few sizes until the dry runs are spent."""
    at, calls = law(2, 0.3, step_gib=38)
    formulas = _formulas(2, 0.45)
    found = seeded_fit(at, 40 * GIB, lambda b: max(38 * GIB, formulas(b)), limit=4096)
    assert found.micro_batch_size == 126  # 2 + 0.3 x 126 = 39.8 GiB; 127 is 40.1
    assert len(calls) <= 10  # a step of 4 sizes a dry run stopped at 120


def test_nothing_fits():
    at, calls = law(50, 1)
    assert fit_micro_batch(at, 40 * GIB).micro_batch_size == 0
    assert calls == [2, 1]  # size 1 traced only where 2 does not fit
    at, _ = law(38, 1)  # 39 GiB at 1, 40 at 2: one sample
    assert fit_micro_batch(at, int(39.5 * GIB)).micro_batch_size == 1
    assert fit_micro_batch(at, 40 * GIB, limit=1).micro_batch_size == 1
    at, calls = law(50, 1)
    assert seeded_fit(at, 40 * GIB, _formulas(45, 1)).micro_batch_size == 0
    assert calls == [1]


def test_limit_caps_the_answer():
    at, _ = law(1, 0.001)
    assert fit_micro_batch(at, 40 * GIB, limit=64).micro_batch_size == 64


@pytest.mark.slow
def test_the_plan_s_traced_search_is_exact_and_confirmed():
    """GPT-2 on a T4 at 1024 tokens: the search the plan runs for its setup starts at the
    formulas' answer and rests on dry runs at its answer (fits, with the headroom kept) and
    the size after it (does not)."""
    gpu = get_gpu("t4")
    found = traced_fit(
        resolve_model("gpt2"),
        TrainingSetup(),
        gpu,
        1024,  # the question tests/plan/test_plan_estimate_agree.py asks: its dry runs
        64,
        DEFAULT_HEADROOM_BYTES,
    )
    budget = search_budget(gpu, DEFAULT_HEADROOM_BYTES)
    size, traced = found.micro_batch_size, dict(found.traced)
    assert 0 < size < 64  # the card, not the batch, bounds it
    assert traced[size] <= budget < traced[size + 1]
    est = found.estimate
    assert est is not None and est.engine == "trace" and est.micro_batch_size == size
    assert est.device_total_bytes == traced[size]
    assert gpu.memory_bytes - est.device_total_bytes >= DEFAULT_HEADROOM_BYTES
