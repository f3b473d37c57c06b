"""PeakMemoryCallback: the step's peak and samples/s in the Trainer's logs, and a CUDA run
with a plan recorded for `batchfit calibration`."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("transformers")

import torch

from batchfit import calibration
from batchfit.hardware import get_gpu
from batchfit.integrations.hf import PeakMemoryCallback, StepMemory
from batchfit.models import resolve_model
from batchfit.plan import make_plan
from batchfit.spec import TrainingSetup
from tests._tiny import example_gpt2


def test_logs_carry_the_latest_steps_peak_and_speed() -> None:
    callback = PeakMemoryCallback(expected_peak_bytes=2**30)
    callback.history.append(StepMemory(3, 3 * 2**29, 0.5, 64.0))
    logs: dict[str, float] = {"loss": 1.0}
    anything: Any = SimpleNamespace()
    # the Trainer appends its copy of the logs to log_history before calling back
    state: Any = SimpleNamespace(global_step=3, log_history=[{**logs, "step": 3}])
    callback.on_log(anything, state, anything, logs=logs)
    assert logs == {"loss": 1.0, "peak_memory_gib": 1.5, "samples_per_s": 64.0}
    assert state.log_history == [{**logs, "step": 3}]


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
    state: Any = SimpleNamespace(is_world_process_zero=True)
    callback.on_train_end(anything, state, anything)  # no steps: nothing
    assert calibration.load() == []
    callback._cuda = True  # what on_train_begin sets on a GPU
    callback.history += [
        StepMemory(1, plan.estimate.peak_bytes + 10, 9.0, 8.0),  # warm-up: not timed
        StepMemory(2, plan.estimate.peak_bytes + 99, 5.0, 8.0),
        StepMemory(3, plan.estimate.peak_bytes, 1.25, 8.0),
        StepMemory(4, plan.estimate.peak_bytes, 1.75, 8.0),
        StepMemory(5, plan.estimate.peak_bytes, 1.5, 8.0),
    ]
    callback.on_train_end(anything, SimpleNamespace(is_world_process_zero=False), anything)
    assert calibration.load() == []  # another rank's callback: rank 0 records the run
    callback.on_train_end(anything, state, anything)
    (record,) = calibration.load()
    assert record.source == "hf-callback" and record.device == "t4"
    assert record.measured_bytes - record.estimated_bytes == 99
    # its step time beside the plan's: the median after the warm-up steps
    assert record.measured_seconds == 1.5
    assert record.estimated_seconds == pytest.approx(plan.step_seconds)


def _trainer(model: Any, callback: PeakMemoryCallback, tmp_path: Path) -> Any:
    from transformers import Trainer, TrainingArguments

    ids = torch.randint(0, 96, (8, 16), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=2,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
    )
    return Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])


@pytest.mark.slow
def test_a_real_trainer_logs_each_step_and_refuses_another_models_plan(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    model = example_gpt2()
    model.config.to_json_file(config)
    plan = make_plan(
        resolve_model(str(config)),
        get_gpu("t4"),
        TrainingSetup(),
        seq_len=16,
        global_batch=4,
        micro_batch_size=2,
        engine="analytic",
    )
    callback = PeakMemoryCallback(plan)
    trainer = _trainer(model, callback, tmp_path)
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]  # the per-step entries
    assert [h["step"] for h in logged] == [1, 2]
    assert [h["peak_memory_gib"] for h in logged] == [
        round(r.peak_bytes / 2**30, 4) for r in callback.history
    ]
    assert all(h["peak_memory_gib"] > 0 and h["samples_per_s"] > 0 for h in logged)

    with pytest.raises(ValueError, match=r"the plan is for .*config\.json \(110.3K parameters\)"):
        _trainer(example_gpt2(n_embd=128), PeakMemoryCallback(plan), tmp_path)
