"""Work a test run does once for all its tests, pytest-xdist's workers included: the first test
that needs it makes it, the others read what it left (``once_per_run``)."""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest


def once_per_run(
    request: pytest.FixtureRequest, name: str, make: Callable[[Path], dict[str, Any]]
) -> tuple[Path, dict[str, Any]]:
    """The folder ``name`` of this test run and the outcome ``make(folder)`` returned when the
    first test that asked made it (an exception it raised kept as ``{"error": ...}``, so the
    other worker does not make it again). Under pytest-xdist each worker has a folder in the
    run's: the work lives in the run's, and the other worker waits on its lock."""
    base = request.getfixturevalue("tmp_path_factory").getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    out = root / name
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or its process ends
        outcome = out / "outcome.json"
        if not outcome.exists():
            out.mkdir(parents=True, exist_ok=True)
            try:
                done = make(out)
            except Exception as e:  # the tests say it
                done = {"error": f"{type(e).__name__}: {e}"}
            outcome.write_text(json.dumps(done))
        return out, json.loads(outcome.read_text())
