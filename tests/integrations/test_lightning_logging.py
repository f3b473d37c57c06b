"""Lightning's PeakMemoryCallback in a real (tiny, CPU) fit: each optimizer step's peak and
samples/s reach the configured logger (a CSV file here), a drift above the plan is warned, a
plan from another model is refused, and a CPU run leaves no calibration record."""

from __future__ import annotations

import csv
import json
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("lightning")
pytest.importorskip("transformers")

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

from batchfit import calibration
from batchfit.hardware import get_gpu
from batchfit.integrations.lightning import PeakMemoryCallback, StepMemory
from batchfit.models import resolve_model
from batchfit.plan import make_plan
from batchfit.spec import TrainingSetup
from tests._tiny import TINY_GPT2, example_gpt2

# the tiny GPT-2 of examples/train_tiny_gpt2.py
CONFIG = TINY_GPT2
SEQ, MICRO, ACCUM, STEPS = 32, 4, 2, 3


class TinyGpt2(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = example_gpt2()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        return self.net(input_ids=ids, labels=ids).loss  # type: ignore[no-any-return]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader[Any]:
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, CONFIG["vocab_size"], (MICRO * ACCUM * STEPS, SEQ), generator=gen)
        return DataLoader(TensorDataset(ids), batch_size=MICRO)


def _fit(callback: PeakMemoryCallback, tmp_path: Path) -> pl.Trainer:
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        accumulate_grad_batches=ACCUM,
        log_every_n_steps=1,
        logger=CSVLogger(tmp_path, name="run"),
        callbacks=[callback],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(TinyGpt2())
    return trainer


def _plan(config: dict[str, Any], tmp_path: Path) -> Any:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return make_plan(
        resolve_model(str(path)),
        get_gpu("t4"),
        TrainingSetup(),
        seq_len=SEQ,
        global_batch=MICRO * ACCUM,
        micro_batch_size=MICRO,
        engine="analytic",
    )


@pytest.mark.slow
def test_each_steps_peak_and_speed_reach_the_csv_logger(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("BATCHFIT_DATA_DIR", str(tmp_path / "data"))
    plan = _plan(CONFIG, tmp_path)
    # a plan whose figure any real step passes: the drift warning must fire
    callback = PeakMemoryCallback(plan, tolerance=0.0)
    callback.expected_peak_bytes = 1
    with caplog.at_level(logging.WARNING, logger="batchfit.integrations.lightning"):
        trainer = _fit(callback, tmp_path)

    assert [r.step for r in callback.history] == [1, 2, 3]  # one per optimizer step
    assert all(r.peak_bytes > 0 and r.reserved_bytes is None for r in callback.history)
    assert "drifted from its plan" in caplog.text and callback.drifted_steps == [1, 2, 3]
    assert trainer.logger is not None and trainer.logger.log_dir is not None
    with open(Path(trainer.logger.log_dir) / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("peak_memory_gib")]
    assert len(rows) == STEPS
    for row, measured in zip(rows, callback.history, strict=True):
        assert float(row["peak_memory_gib"]) == pytest.approx(measured.peak_bytes / 2**30, abs=1e-4)
        assert measured.samples_per_s is not None
        assert float(row["samples_per_s"]) == pytest.approx(measured.samples_per_s, rel=1e-3)
        assert 0 < measured.samples_per_s == pytest.approx(MICRO * ACCUM / measured.seconds)
    assert calibration.load() == []  # a CPU peak is RSS: not comparable, not recorded


@pytest.mark.slow
def test_a_plan_for_another_model_is_refused_naming_both(tmp_path: Path) -> None:
    other = _plan({**CONFIG, "n_embd": 128}, tmp_path)
    with pytest.raises(ValueError, match=r"the plan is for .*config\.json \(.*\) but the") as e:
        _fit(PeakMemoryCallback(other), tmp_path)
    assert "\n" not in str(e.value) and "TinyGpt2" in str(e.value)
    _fit(PeakMemoryCallback(other, check_model=False), tmp_path)  # the user's word is taken


def test_a_cuda_run_with_a_plan_becomes_one_calibration_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BATCHFIT_DATA_DIR", str(tmp_path))
    plan = _plan(CONFIG, tmp_path)
    callback = PeakMemoryCallback(plan)
    peak = plan.estimate.peak_bytes
    callback._cuda = True  # what on_train_start sets on a GPU
    callback.history += [
        StepMemory(1, peak + 10, 1.0, 8.0, peak + 50),
        StepMemory(2, peak + 99, 1.0, 8.0, peak + 80),
    ]
    anything: Any = SimpleNamespace()
    callback.on_train_end(SimpleNamespace(is_global_zero=False), anything)  # rank 1: nothing
    assert calibration.load() == []
    callback.on_train_end(SimpleNamespace(is_global_zero=True), anything)
    (record,) = calibration.load()
    assert record.source == "lightning-callback" and record.device == "t4"
    assert record.measured_bytes - record.estimated_bytes == 99
    assert record.reserved_bytes == peak + 80
