"""A pair of dry runs traced side by side (the shallower in a helper process) is the pair
traced in this process, byte for byte; a helper that fails, dies or hangs costs only time: the
dry run is traced here instead."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from batchfit.hardware import get_gpu
from batchfit.memory.formulas.analytic import resolve_setup
from batchfit.memory.trace import _worker
from batchfit.memory.trace import estimate as trace_estimate
from batchfit.models import resolve_model
from batchfit.spec import TrainingSetup
from tests._tiny import TINY_GPT2


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, TrainingSetup, Any]:
    path = tmp_path_factory.mktemp("helper") / "config.json"
    path.write_text(json.dumps({**TINY_GPT2, "n_layer": 4}))
    model = resolve_model(str(path))
    setup = resolve_setup(model, TrainingSetup(), "cuda", get_gpu("t4"))
    sizes = trace_estimate._Sizes(
        micro=2, seq=32, device="cuda", workspace=8 << 20, grad_accum_steps=2
    )
    return model, setup, sizes


@pytest.fixture(scope="module")
def here(pair: tuple[Any, TrainingSetup, Any]) -> Any:
    """The pair traced in this process."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        return _traced(pair, "1", monkeypatch)


@pytest.fixture
def fresh_helper(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No helper yet, none failed; the one a test starts is stopped after it."""
    monkeypatch.setattr(_worker, "_helper", [None])
    monkeypatch.setattr(_worker, "_failed", [False])
    yield
    started = _worker._helper[0]
    if started is not None:
        started.close()


def _traced(pair: tuple[Any, TrainingSetup, Any], jobs: str, monkeypatch: Any) -> Any:
    """The pair's dry runs: each moment's peak, the largest modules, each storage's events (the
    order of a burst of frees, as the collector releases a graph, differs from run to run in
    one process too), and the peak and reserve at the model's depth."""
    monkeypatch.setenv(_worker.JOBS_ENV, jobs)
    model, setup, sizes = pair
    runs = trace_estimate._dry_runs(model, setup, sizes, (1, 2))
    combined = trace_estimate._combine(model, setup, sizes, (1, 2), runs)
    assert combined is not None
    shown = [(r.phases, r.top_modules, sorted(r.events), len(r.moments.marks)) for r in runs]
    return shown, combined.phases, combined.reserved_bytes


def test_a_pair_traced_side_by_side_is_the_pair_traced_here(pair, here, fresh_helper, monkeypatch):
    assert _traced(pair, "1", monkeypatch) == here
    assert _worker._helper[0] is None  # one process: no helper started
    beside = _traced(pair, "2", monkeypatch)
    helper = _worker._helper[0]
    assert helper is not None and helper.alive  # it traced the shallower dry run
    assert beside == here
    assert _traced(pair, "2", monkeypatch) == here
    assert _worker._helper[0] is helper  # one helper serves every pair of the process
    # a request it cannot answer: no result, and the helper stays
    assert helper.submit(("not a model", None, {}))
    assert helper.result(timeout=60) is None


def test_a_helper_that_died_is_not_restarted_and_this_process_traces(
    pair, here, fresh_helper, monkeypatch
):
    class Dead:
        alive = False

        def close(self) -> None:
            pass

    _worker._helper[0] = Dead()  # type: ignore[assignment]
    assert _worker.helper() is None and _worker._failed[0]
    assert _traced(pair, "2", monkeypatch) == here


def test_a_helper_that_gives_no_answer_is_stopped(fresh_helper):
    silent = _worker.Helper([sys.executable, "-c", "import time; time.sleep(60)"])
    assert silent.submit(("model", "setup", {"micro": 1}))
    assert silent.result(timeout=0.5) is None
    assert not silent.alive


def test_the_parent_traces_what_the_helper_failed(pair, here, fresh_helper, monkeypatch):
    class Failing:
        alive = True

        def submit(self, request: tuple[Any, ...]) -> bool:
            return True

        def result(self, timeout: float) -> None:
            return None

    monkeypatch.setattr(_worker, "helper", lambda: Failing())
    assert _traced(pair, "2", monkeypatch) == here


@pytest.mark.parametrize(
    ("given", "cores", "expected"),
    [("1", 8, 1), ("2", 1, 2), ("16", 8, 2), ("", 1, 1), ("", 2, 2), ("", 8, 2), ("x", 1, 1)],
)
def test_how_many_processes_trace(given, cores, expected, monkeypatch):
    monkeypatch.setenv(_worker.JOBS_ENV, given)
    monkeypatch.setattr(
        _worker.os, "sched_getaffinity", lambda _pid: set(range(cores)), raising=False
    )
    monkeypatch.setattr(_worker.sys, "platform", "linux")
    assert _worker.jobs() == expected


def test_importing_the_helper_module_imports_no_torch():
    import subprocess

    code = "import sys, batchfit.memory.trace._worker; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_helper_module_runs_as_a_program() -> None:
    assert Path(_worker.__file__).name == "_worker.py" and _worker.__name__.endswith("._worker")
