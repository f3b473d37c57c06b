"""PeakMemoryCallback: the step's peak and samples/s in the Trainer's logs, and a CUDA run
with a plan recorded for `batchfit calibration` (issue #14, parts 3 and 4)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("transformers")

from batchfit import calibration
from batchfit.hardware import get_gpu
from batchfit.integrations.hf import PeakMemoryCallback, StepMemory
from batchfit.models import resolve_model
from batchfit.plan import make_plan
from batchfit.spec import TrainingSetup


def test_logs_carry_the_latest_steps_peak_and_speed() -> None:
    callback = PeakMemoryCallback(expected_peak_bytes=2**30)
    callback.history.append(StepMemory(3, 3 * 2**29, 0.5, 64.0))
    logs: dict[str, float] = {"loss": 1.0}
    anything: Any = SimpleNamespace()
    callback.on_log(anything, anything, anything, logs=logs)
    assert logs == {"loss": 1.0, "peak_memory_gib": 1.5, "samples_per_s": 64.0}


def test_a_cuda_run_with_a_plan_becomes_a_calibration_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BATCHFIT_DATA_DIR", str(tmp_path))
    plan = make_plan(
        resolve_model("gpt2"),
        get_gpu("t4"),
        TrainingSetup(),
        seq_len=256,
        global_batch=16,
        engine="analytic",
    )
    callback = PeakMemoryCallback(plan)
    anything: Any = SimpleNamespace()
    callback.on_train_end(anything, anything, anything)  # no steps: nothing
    assert calibration.load() == []
    callback._cuda = True  # what on_train_begin sets on a GPU
    callback.history += [
        StepMemory(1, plan.estimate.peak_bytes + 10, 1.0, 8.0),
        StepMemory(2, plan.estimate.peak_bytes + 99, 1.0, 8.0),
    ]
    callback.on_train_end(anything, anything, anything)
    (record,) = calibration.load()
    assert record.source == "hf-callback" and record.device == "t4"
    assert record.measured_bytes - record.estimated_bytes == 99
