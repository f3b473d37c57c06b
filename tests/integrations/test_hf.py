"""The Transformers integration in a real (tiny GPT-2, CPU) ``Trainer`` run."""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import pytest
import torch
from transformers import Trainer, TrainingArguments

from batchfit.export import export
from batchfit.hardware import get_gpu
from batchfit.integrations.hf import PeakMemoryCallback, training_arguments
from batchfit.models import resolve_model
from batchfit.plan import make_plan
from batchfit.spec import TrainingSetup
from tests._tiny import MAX_LEN, VOCAB, tiny_gpt2_lm

# The planner's logic, on the fast analytic engine (the trace engine's plans: test_fit.py,
# test_plan_estimate_agree.py).
make_plan_analytic = functools.partial(make_plan, engine="analytic")

pytestmark = pytest.mark.slow


def _train(tmp_path: Path, callback: PeakMemoryCallback, steps: int = 3) -> None:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (16, MAX_LEN), generator=gen)
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=steps,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
    )
    Trainer(model=tiny_gpt2_lm(), args=args, train_dataset=data, callbacks=[callback]).train()


def test_logs_peak_and_throughput_per_step(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    callback = PeakMemoryCallback()
    with caplog.at_level(logging.INFO, logger="batchfit.integrations.hf"):
        _train(tmp_path, callback)
    assert [r.step for r in callback.history] == [1, 2, 3]
    assert all(r.peak_bytes > 0 and r.samples_per_s > 0 for r in callback.history)
    assert caplog.text.count("samples/s") == 3
    assert "drifted" not in caplog.text


def test_warns_when_the_peak_drifts_past_the_plan(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    callback = PeakMemoryCallback(expected_peak_bytes=1024)
    with caplog.at_level(logging.WARNING, logger="batchfit.integrations.hf"):
        _train(tmp_path, callback)
    assert callback.drifted_steps == [1, 2, 3]
    assert "over the planned" in caplog.text
    quiet = PeakMemoryCallback(expected_peak_bytes=2**40)
    _train(tmp_path, quiet, steps=1)
    assert quiet.drifted_steps == []


def test_plan_to_training_arguments() -> None:
    plan = make_plan_analytic(
        resolve_model("gpt2"),
        get_gpu("rtx-3060"),
        TrainingSetup(),
        seq_len=256,
        global_batch=64,
        micro_batch_size=16,
    )
    args = training_arguments(plan, output_dir="out", use_cpu=True)
    exported = export(plan, "hf")["training_arguments"]
    assert args.per_device_train_batch_size == exported["per_device_train_batch_size"] == 16
    assert args.gradient_accumulation_steps == exported["gradient_accumulation_steps"] == 4
    assert args.bf16 is exported["bf16"]
    assert PeakMemoryCallback(plan).expected_peak_bytes == plan.estimate.peak_bytes


def test_plan_or_expected_not_both() -> None:
    plan = make_plan_analytic(
        resolve_model("gpt2"), get_gpu("rtx-3060"), TrainingSetup(), seq_len=256, global_batch=8
    )
    with pytest.raises(ValueError, match="not both"):
        PeakMemoryCallback(plan, expected_peak_bytes=1)


def test_cpu_peak_off_linux_is_not_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    from batchfit._memwatch import status_bytes
    from batchfit.integrations import _stepwatch

    assert _stepwatch._status_bytes("VmRSS") > 0  # the shared reader, on Linux
    with pytest.raises(OSError, match="NoSuchField"):
        status_bytes("NoSuchField")  # one failure behaviour: raise, naming the field
    monkeypatch.setattr(_stepwatch, "PROC_STATUS", "/nonexistent/status")
    assert _stepwatch._status_bytes("VmRSS") == 0  # the callbacks' choice without procfs
