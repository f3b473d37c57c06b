"""The micro-batch search: it never reports an untested size, survives real OOMs under an OS
limit with flat memory, agrees across ranks, and fits a memory law to start high."""

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch

from batchfit._memwatch import MemoryWatch
from batchfit.errors import NoFitError
from batchfit.search import PLATEAU, Trial, find_batch_size
from batchfit.search._order import Search as _Search
from batchfit.workload import Workload
from tests._rank_scenarios import scenario_out

CHILD = Path(__file__).with_name("_limit_child.py")
pytestmark = pytest.mark.usefixtures("frozen_gc")


# The child's modes one after the other in one process (torch is imported once): ``creep``
# first, in the fresh process, as when run alone; each sets its limit from what the process
# holds when it starts and restores it. The objects alive before the first (torch, batchfit,
# and the modules torch loads when the first optimizer is made: torch._dynamo's) are moved out
# of the collector's reach, as ``frozen_gc`` does here: each out-of-memory error's
# ``gc.collect()`` then scans only what the modes made. Each mode's JSON line follows a line
# naming it.
MODES = ("creep", "search")
_RUN_MODES = """
import gc, os, runpy, sys
import torch
import batchfit.search
torch.optim.AdamW(torch.nn.Linear(1, 1).parameters())
gc.collect()
gc.freeze()
child, mark, *modes = sys.argv[1:]
for mode in modes:
    print(mark + mode, flush=True)
    sys.argv = [child, mode]
    runpy.run_path(child, run_name="__main__")
sys.stdout.flush()
os._exit(0)  # every mode has said its line: no teardown of torch to wait for
"""
_MARK = "--- _limit_child.py mode: "


@pytest.fixture(scope="module")
def limit_child() -> dict[str, Any]:
    """``_limit_child.py MODE`` for each of ``MODES``, in one child process: each mode's
    output, or None where the child ended before it gave one."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", _RUN_MODES, str(CHILD), _MARK, *MODES],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = out.stdout.strip().splitlines()
    found: dict[str, Any] = {"stderr": out.stderr[-2000:], "returncode": out.returncode}
    for mode in MODES:
        at = lines.index(_MARK + mode) if _MARK + mode in lines else None
        if at is None or at + 1 >= len(lines) or lines[at + 1].startswith(_MARK):
            found[mode] = None
        else:
            found[mode] = json.loads(lines[at + 1])
    return found


def _child(limit_child: dict[str, Any], mode: str) -> dict[str, Any]:
    data = limit_child[mode]
    assert limit_child["returncode"] == 0 and data is not None, limit_child["stderr"]
    return cast(dict[str, Any], data)


class Law:
    """A step whose memory law is known: it raises a real OOM type above ``limit``."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.sizes: list[int] = []

    def step(self, batch: torch.Tensor) -> None:
        n = batch.shape[0]
        self.sizes.append(n)
        if n > self.limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {n} GiB")


def test_known_law_never_returns_an_untested_size() -> None:
    law = Law(limit=37)
    result = find_batch_size(
        law.step, lambda n: torch.zeros(n, 1), high=200, start=16, steps_per_trial=2, choose="max"
    )
    ran_ok = {t.micro_batch_size for t in result.trials if t.ok}
    assert result.max_fitting_micro_batch == 37 and result.micro_batch_size in ran_ok
    assert all(t.micro_batch_size <= 200 for t in result.trials)
    assert len(result.trials) <= 10


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="low <= high"):
        find_batch_size(print, lambda n: n, low=4, high=2)
    with pytest.raises(ValueError, match="steps_per_trial"):
        find_batch_size(print, lambda n: n, high=4, steps_per_trial=1)
    with pytest.raises(ValueError, match="memory_budget"):
        find_batch_size(print, lambda n: n)
    with pytest.raises(NoFitError, match="even a micro-batch of 1"):
        find_batch_size(Law(limit=0).step, lambda n: torch.zeros(n, 1), high=4)
    net = torch.nn.Linear(256, 256)  # 257 KiB of weights: no budget of 1 KiB holds them
    with pytest.raises(NoFitError, match="already hold"):
        find_batch_size(print, lambda n: n, model=net, memory_budget=1024)


def test_a_size_the_data_cannot_fill_is_refused_not_reported() -> None:
    data = torch.randn(10, 1)  # a 10-sample dataset: data[:n] gives at most 10 samples
    law = Law(limit=10**6)
    with pytest.raises(ValueError, match=r"make_batch\(64\) gave 10 samples .*dim 0.* high=10"):
        find_batch_size(law.step, lambda n: data[:n], start=64, high=128)
    assert law.sizes == []  # refused before a step ran
    with pytest.raises(ValueError, match=r"make_batch\(2\) gave 3 samples.*return n"):
        find_batch_size(law.step, lambda n: torch.zeros(n + 1, 1), start=2, high=4)
    fits = find_batch_size(law.step, lambda n: data[:n], high=10, choose="max")
    assert fits.max_fitting_micro_batch == 10 and set(law.sizes) <= set(range(1, 11))


@pytest.mark.parametrize(
    "budget, error",
    [
        (1.5e9, TypeError),
        (1e40, TypeError),
        (float("inf"), TypeError),
        (float("nan"), TypeError),
        (True, TypeError),
        (2**80, ValueError),
        (0, ValueError),
        (-1, ValueError),
    ],
)
def test_a_budget_that_is_no_byte_count_is_refused_up_front(
    budget: Any, error: type[Exception]
) -> None:
    law = Law(limit=10**6)
    with pytest.raises(error, match=r"memory_budget must .*16 \* 2\*\*30 for 16 GiB"):
        find_batch_size(law.step, lambda n: torch.zeros(n, 1), memory_budget=budget)
    assert law.sizes == []


def test_non_oom_errors_propagate() -> None:
    def broken(_batch: torch.Tensor) -> None:
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    with pytest.raises(RuntimeError, match="shapes"):
        find_batch_size(broken, lambda n: torch.zeros(n, 1), high=4)


@pytest.mark.slow
def test_real_cpu_oom_under_an_os_limit(limit_child: dict[str, Any]) -> None:
    data = _child(limit_child, "search")
    result = data["result"]
    assert data["state_restored"] and data["optimizer_restored"] and data["limit_restored"]
    assert result["ooms"] >= 1  # a real allocator failure happened and was survived
    assert result["max_fitting_micro_batch"] >= 0.9 * data["truth"]
    assert result["max_fitting_micro_batch"] <= data["truth"]
    ok_sizes = {t["micro_batch_size"] for t in result["trials"] if t["ok"]}
    assert result["micro_batch_size"] in ok_sizes
    # the limit in at most max_trials (8) runs; the timing of halved sizes comes on top, as
    # many as stay within the plateau (timing noise on a loaded machine decides how many)
    largest = result["max_fitting_micro_batch"]
    halves = {largest >> k for k in range(1, largest.bit_length())}
    timed = {t["micro_batch_size"] for t in result["trials"]} & halves
    # the limit, each halving timed once, and one confirming run of the choice
    assert len(result["trials"]) <= 8 + len(timed) + 1


@pytest.mark.slow
def test_twenty_ooms_in_a_row_leave_memory_flat(limit_child: dict[str, Any]) -> None:
    rss = _child(limit_child, "creep")["rss"]
    assert max(rss[1:]) <= 1.05 * rss[1]


@pytest.fixture(scope="module")
def search_ranks_out(request: pytest.FixtureRequest) -> Path:
    """What ``_ranks_worker.py`` wrote on its two ranks (gloo), run in the test run's one launch
    of the rank scenarios (``tests/_rank_scenarios.py``)."""
    return scenario_out(request, "search")


@pytest.mark.slow
def test_two_ranks_agree_on_the_smaller_budget(search_ranks_out: Path) -> None:
    ranks = [json.loads((search_ranks_out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["sizes"] == ranks[1]["sizes"]  # the same trials, in the same order
    assert ranks[0]["choice"] == ranks[1]["choice"] == 20
    assert ranks[0]["max"] == ranks[1]["max"] == 20


class AffineLaw:
    """A step whose peak memory is ``base + per_sample * n``; above ``available`` it fails."""

    def __init__(self, base: int, per_sample: int, available: int) -> None:
        self.base, self.per_sample, self.available = base, per_sample, available
        self.calls: list[int] = []

    @property
    def limit(self) -> int:
        return (self.available - self.base) // self.per_sample

    def step(self, batch: torch.Tensor) -> None:
        n = batch.shape[0]
        self.calls.append(n)
        if self.base + self.per_sample * n > self.available:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


class LawWatch:
    """MemoryWatch's interface over an AffineLaw: the peak of the last size run."""

    def __init__(self, law: AffineLaw) -> None:
        self.law = law
        self.available_bytes = law.available

    def __call__(self, *_args: object, **_kwargs: object) -> "LawWatch":
        return self

    def __enter__(self) -> "LawWatch":
        return self

    def __exit__(self, *_exc: object) -> None:
        return None

    def peak_bytes(self) -> int:
        return self.law.base + self.law.per_sample * self.law.calls[-1]

    def reset_peak(self) -> None: ...
    def synchronize(self) -> None: ...
    def drop_gradients(self) -> None: ...
    def agree(self, ok: bool) -> bool:
        return ok

    def agree_size(self, size: int | None) -> int | None:
        return size

    def agree_speed(self, speed: float) -> float:
        return speed


GIB = 1 << 30


@pytest.mark.parametrize(
    "start, hint, max_trials, max_ooms",
    [
        ("exact", "exact", 1, 0),  # the estimate was right: one trial, steps_per_trial steps
        ("low", "exact", 2, 0),  # two sizes below: one measured step there, then the limit
        ("high", "exact", 3, 1),  # an estimate above the limit: one OOM, then the fit
        ("low", "off", 4, 1),  # the estimate's slope 30% too small
        ("one", None, 5, 1),  # no estimate at all: from micro-batch 1, the fit alone
    ],
)
def test_fit_on_a_known_memory_law(
    monkeypatch: pytest.MonkeyPatch, start: str, hint: str | None, max_trials: int, max_ooms: int
) -> None:
    # limit 42, with room for 0.9 samples more: more than the 1% the fit keeps in hand
    law = AffineLaw(base=6 * GIB, per_sample=GIB // 3, available=int(6 * GIB + 42.9 * GIB / 3))
    monkeypatch.setattr("batchfit.search.MemoryWatch", LawWatch(law))
    first = {"exact": law.limit, "low": law.limit - 2, "high": law.limit + 5, "one": 1}[start]
    per_sample = {"exact": law.per_sample, "off": int(law.per_sample * 0.7), None: None}[hint]
    result = find_batch_size(
        law.step,
        lambda n: torch.zeros(n, 1),
        device="cpu",
        memory_budget=law.available,
        start=first,
        bytes_per_sample=per_sample,
        choose="max",
        steps_per_trial=3,
    )
    assert result.micro_batch_size == result.max_fitting_micro_batch == law.limit
    assert len(result.trials) <= max_trials and result.ooms <= max_ooms
    # never an untested size; the choice ran steps_per_trial steps in a row, as the last trial
    assert result.trials[-1].micro_batch_size == law.limit and result.trials[-1].steps == 3
    # every other size that fitted was measured in one step (two for the first that fitted)
    fitted = [t for t in result.trials[:-1] if t.ok]
    assert [t.steps for t in fitted] == [2, 1, 1, 1, 1][: len(fitted)]
    if start == "exact":
        assert law.calls == [law.limit] * 3


@pytest.mark.parametrize(
    "law, high, expected",
    [
        (lambda m: 6 * GIB + m * (GIB // 3), None, 40),  # 2% below 20 GiB: 6 + 40/3 <= 19.6
        (lambda m: 6 * GIB + int(GIB * m**0.5), None, 184),  # concave: the line undershoots
        (lambda m: 6 * GIB + m * (GIB // 3), 16, 16),  # capped by --max-micro-batch
        (lambda m: 30 * GIB + m, None, 1),  # nothing fits: start at 1, the search says so
    ],
)
def test_predicted_start_is_the_largest_predicted_fit(
    monkeypatch: pytest.MonkeyPatch, law: Callable[[int], int], high: int | None, expected: int
) -> None:
    from batchfit.search import probe as _probe

    calls: list[int] = []

    def fake_estimate(*_a: object, workload: Workload, **_k: object) -> SimpleNamespace:
        calls.append(workload.micro_batch_size)
        return SimpleNamespace(peak_bytes=law(workload.micro_batch_size))

    monkeypatch.setattr("batchfit.memory.estimate.estimate", fake_estimate)
    start, per_sample, need = _probe.predict(None, None, 256, "cpu", 20 * GIB, high)
    assert start == expected and need == law(1)
    assert per_sample == max(1, min(law(start + 1) - law(start), (law(8) - law(1)) // 7))
    assert len(set(calls)) <= 20  # a few predictions, not a scan


def _search(
    law: AffineLaw, step_fn: Callable[[torch.Tensor], None] | None = None, **options: Any
) -> _Search:
    """A ``_Search`` over ``law`` and its stand-in watch (``options`` override the defaults)."""
    defaults = {"low": 1, "high": None, "bytes_per_sample": None, "steps_per_trial": 3}
    settings: dict[str, Any] = {**defaults, "max_trials": 8, **options}
    step = step_fn or law.step
    watch = cast(MemoryWatch, LawWatch(law))
    return _Search(step, lambda n: torch.zeros(n, 1), watch, **settings)


def test_choice_runs_again_only_after_a_later_oom() -> None:
    law = AffineLaw(base=0, per_sample=1, available=100)

    def trial(n: int, ok: bool, steps: int) -> Trial:
        return Trial(n, ok, n if ok else None, 1.0 if steps > 1 else None, 0.1, steps)

    def confirm(trials: list[Trial]) -> tuple[int, list[int]]:
        law.calls.clear()
        search = _search(law)
        search.trials = trials
        return search.confirm(8), list(law.calls)

    # full trial of 8, then a smaller timed size: nothing to run
    assert confirm([trial(8, True, 3), trial(4, True, 3)]) == (8, [])
    # an OOM after the full trial of 8: 8 runs again, steps_per_trial steps
    assert confirm([trial(8, True, 3), trial(9, False, 0), trial(4, True, 3)]) == (8, [8, 8, 8])
    # 8 only measured (one step): it runs its full trial
    assert confirm([trial(8, True, 1)]) == (8, [8, 8, 8])
    # 8 no longer fits when run again, and no smaller size fitted: nothing fits
    law.available = 7
    with pytest.raises(NoFitError, match="no longer fits"):
        confirm([trial(8, True, 1)])


class StepClock:
    """A clock that moves only when a step runs: ``overhead + n * per_sample
    + n**2 * squared`` seconds for a step of ``n`` samples."""

    def __init__(self, overhead: float, per_sample: float, squared: float = 0.0) -> None:
        self.overhead, self.per_sample, self.squared = overhead, per_sample, squared
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def step(self, batch: torch.Tensor) -> None:
        n = batch.shape[0]
        self.now += self.overhead + self.per_sample * n + self.squared * n * n

    def samples_per_s(self, n: int) -> float:
        return n / (self.overhead + self.per_sample * n + self.squared * n * n)


@pytest.mark.parametrize(
    "clock, timed, choice",
    [
        # speed n / (n + 0.25) rises toward a plateau: 16, 32 and 64 are within 2% of the
        # best (64), 8 is not and ends the timing; the smallest of the equally fast wins
        (StepClock(0.25, 1.0), [64, 32, 16, 8], 16),
        # a step slows down beyond 16 (n**2 term): 16 is fastest, 32 and 8 within 2% of it,
        # 4 is not; the choice is 8, smaller than the fastest
        (StepClock(0.25, 1.0, 1e-3), [64, 32, 16, 8, 4], 8),
    ],
)
def test_plateau_rule_on_an_injected_clock(clock: StepClock, timed: list[int], choice: int) -> None:
    law = AffineLaw(base=0, per_sample=1, available=64)  # every size up to 64 fits

    def step(batch: torch.Tensor) -> None:
        law.step(batch)
        clock.step(batch)

    search = _search(law, high=64, step_fn=step, clock=clock)
    result = search.result(64, "throughput", None)
    speeds = {t.micro_batch_size: t.samples_per_s for t in result.trials if t.samples_per_s}
    assert list(speeds) == timed
    for n, speed in speeds.items():  # each timed size measured exactly on the injected clock
        assert speed == pytest.approx(clock.samples_per_s(n), rel=1e-9)
    best = max(speeds.values())
    within = [n for n, speed in speeds.items() if speed >= (1 - PLATEAU) * best]
    assert result.micro_batch_size == choice == min(within)
    assert speeds[timed[-1]] < (1 - PLATEAU) * best  # timing stopped at the first size below


def test_trial_cap_is_said_and_a_high_start_is_not_blamed_on_size_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    law = AffineLaw(base=6 * GIB, per_sample=GIB // 3, available=20 * GIB)
    monkeypatch.setattr("batchfit.search.MemoryWatch", LawWatch(law))
    run: dict[str, Any] = {"device": "cpu", "memory_budget": law.available, "choose": "max"}

    def zeros(n: int) -> torch.Tensor:
        return torch.zeros(n, 1)

    capped = find_batch_size(law.step, zeros, start=1, max_trials=2, **run)
    assert any("max_trials=2" in note for note in capped.notes)
    assert capped.micro_batch_size < law.limit  # it stopped early, and says so
    # a start far above the limit (42): four halvings stay above it, none fits
    with pytest.raises(NoFitError, match=r"no size fitted .* smallest tried"):
        find_batch_size(law.step, zeros, start=10**6, max_trials=4, **run)


def test_stand_ins_are_named() -> None:
    from batchfit.search.probe import stand_ins
    from batchfit.spec import TrainingSetup

    assert stand_ins(TrainingSetup()) == []
    assert (
        "4-bit layers are emulated" in stand_ins(TrainingSetup(method="qlora", precision="bf16"))[0]
    )
