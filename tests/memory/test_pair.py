"""A deep model's two dry runs side by side (``trace.pair``): the shallow one in a forked
worker gives the result one process gives, and any failure there falls back to this process
(the answer, or the error, unchanged)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from batchfit.errors import UsageError
from batchfit.hardware import get_gpu
from batchfit.memory.formulas.analytic import resolve_setup
from batchfit.memory.trace import estimate as trace_estimate
from batchfit.memory.trace import pair
from batchfit.models import resolve_model
from batchfit.spec import TrainingSetup
from tests._tiny import TINY_GPT2

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the worker is forked (Linux)")


@pytest.fixture
def workers(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The worker switched on (the suite runs with it off), and a fresh one per test."""
    monkeypatch.setenv(pair.ENV, "1")
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1})
    pair._pool, pair._broken, pair._warm = None, False, False
    yield
    if pair._pool is not None:
        pair._pool.shutdown(cancel_futures=True)
    pair._pool, pair._broken, pair._warm = None, False, False


@pytest.fixture(scope="module")
def deep(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, TrainingSetup]:
    """TINY_GPT2 at 6 layers (traced at 1 and 2) on a T4."""
    path = tmp_path_factory.mktemp("pair") / "config.json"
    path.write_text(json.dumps({**TINY_GPT2, "n_layer": 6}))
    model = resolve_model(str(path))
    return model, resolve_setup(model, TrainingSetup(), "cuda", get_gpu("t4"))


def _pair(model: Any, setup: TrainingSetup, micro: int) -> Any:
    sizes = trace_estimate._Sizes(micro, 32, "cuda", 1 << 20, 2)
    return trace_estimate._dry_runs(model, setup, sizes, (1, 2))


def _die(*_: Any) -> Any:
    os._exit(3)


def _refuse(*_: Any) -> Any:
    raise UsageError("no such shape")


def _figures(result: Any) -> tuple[Any, ...]:
    return (result.phases, result.reserved_bytes, result.top_modules)


def test_the_worker_s_pairs_equal_one_process_s(deep, workers, monkeypatch):
    model, setup = deep
    with_worker = [_pair(model, setup, micro) for micro in (1, 2)]
    assert pair._pool is not None  # the first pair ran here, the second in the worker
    monkeypatch.setenv(pair.ENV, "0")
    alone = [_pair(model, setup, micro) for micro in (1, 2)]
    assert [_figures(r) for r in with_worker] == [_figures(r) for r in alone]


def test_a_worker_that_dies_leaves_the_dry_run_to_this_process(deep, workers, monkeypatch):
    model, setup = deep
    expected = _figures(_pair(model, setup, 2))  # the first pair: here, and warm
    monkeypatch.setattr(pair, "_traced", _die)  # the fork inherits it
    assert _figures(_pair(model, setup, 2)) == expected
    assert pair._broken and not pair.wanted()  # the rest run here


def test_an_error_in_the_worker_is_raised_here_as_one_process_raises_it(deep, workers, monkeypatch):
    model, setup = deep
    _pair(model, setup, 1)
    calls: list[int] = []  # the dry runs that refused here

    def refuse(*_: Any, **kw: Any) -> Any:
        calls.append(kw["depth"])
        raise UsageError("no such shape")

    monkeypatch.setattr(pair, "_traced", _refuse)  # in the worker
    import batchfit.memory.trace.hf as hf

    deep_runs = hf.trace_once

    def shallow_fails(*args: Any, **kw: Any) -> Any:
        return refuse(**kw) if kw["depth"] == 1 else deep_runs(*args, **kw)

    monkeypatch.setattr(hf, "trace_once", shallow_fails)
    with pytest.raises(UsageError, match="no such shape"):
        _pair(model, setup, 2)
    assert calls == [1]  # the worker's refusal, then the shallow dry run's here
    assert not pair._broken  # a trace's own error says nothing about the worker
