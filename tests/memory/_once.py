"""Each dry run made once for a test file, where its tests trace the same setups and sizes."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

import pytest

from batchfit import _cache
from batchfit.memory.trace import estimate as trace_estimate
from batchfit.memory.trace import sized


@contextlib.contextmanager
def dry_runs_once() -> Iterator[None]:
    """Within it, each dry run (model, setup, sizes, depths) is made once: a dry run's result
    depends on nothing else. Every call still goes through ``traced_result`` (its histories,
    what it reads from them, its replay of the allocator)."""
    made: dict[str, Any] = {}
    dry_runs = trace_estimate._dry_runs

    def once(model: Any, setup: Any, sizes: Any, depths: Any) -> Any:
        key = json.dumps(
            [model.name, model.config, model.task, repr(setup), repr(sizes), depths],
            sort_keys=True,
        )
        if key not in made:
            made[key] = dry_runs(model, setup, sizes, depths)
        return made[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(trace_estimate, "_dry_runs", once)
        yield


@contextlib.contextmanager
def fresh_histories() -> Iterator[None]:
    """No kept histories before or after, and no disk cache within (every size is read from
    histories or traced, never loaded)."""
    sized.forget()
    with _cache.disabled():
        yield
    sized.forget()


# Imported into a test file, these apply to its tests: a file whose tests trace the same
# setups and sizes, and read them from each test's own histories.
@pytest.fixture(scope="module", autouse=True)
def each_dry_run_once() -> Iterator[None]:
    with dry_runs_once():
        yield


@pytest.fixture(autouse=True)
def histories_per_test() -> Iterator[None]:
    with fresh_histories():
        yield
