"""``examples/train_tiny_gpt2.py`` runs: it plans, trains, recovers from OOMs, and learns.

The run is this test run's one run of the example (``tests/_example_run.py``), which
``batchfit monitor``'s test measures as well."""

from __future__ import annotations

import re

import pytest

from tests._example_run import ARGS, example_run


@pytest.mark.slow
def test_train_tiny_gpt2(request: pytest.FixtureRequest) -> None:
    assert ARGS == ["--steps", "6", "--oom-above", "4"]
    run = example_run(request)
    stdout, stderr = run.text("stdout"), run.text("stderr")
    assert run.exit_code == 0, stderr[-3000:]
    assert re.search(r"plan on t4: micro-batch \d+ x accumulation \d+ = global batch 32", stdout)
    assert "out of memory at micro-batch 16" in stderr
    assert "out of memory at micro-batch 8" in stderr
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", stdout).groups())
    assert last < first
    assert "OOMs recovered in all: 2" in stdout
