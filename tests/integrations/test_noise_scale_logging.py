"""``NoiseScaleCallback`` (Lightning and Transformers) logs ``StepResult.noise_scale`` of a
batchfit ``Accumulator`` through the framework's own logging."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from transformers import TrainerControl, TrainerState, TrainingArguments

from batchfit.integrations import hf, lightning
from batchfit.train import Accumulator

pytestmark = pytest.mark.slow

MICRO, ACCUM, STEPS = 4, 2, 3


def _data() -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    n = MICRO * ACCUM * STEPS
    x = torch.randn(n, 5, generator=gen)
    # a strong signal: far from the fit, |G|² stands well above the noise at these batches
    return TensorDataset(x, 5 * x.sum(1) + torch.randn(n, generator=gen))


class ManualRegression(pl.LightningModule):
    """Manual optimization: each training batch is one micro-step of an ``Accumulator``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization = False
        self.net = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 1))
        self.accumulator: Accumulator | None = None
        self.results: list[Any] = []

    def on_train_start(self) -> None:
        # the LightningOptimizer: its step() advances trainer.global_step
        self.accumulator = Accumulator(self, self.optimizers(), ACCUM, noise_scale=True)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        assert self.accumulator is not None
        x, y = batch
        with self.accumulator.micro_step() as micro:
            self.accumulator.backward(((self.net(x).squeeze(1) - y) ** 2).sum(), len(y))
        if micro.result is not None:
            self.results.append(micro.result)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_data(), batch_size=MICRO)


def test_lightning_logs_noise_scale_per_optimizer_step(tmp_path: Path) -> None:
    module = ManualRegression()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=CSVLogger(tmp_path, name="run"),
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[lightning.NoiseScaleCallback("accumulator")],
    )
    trainer.fit(module)
    assert trainer.global_step == STEPS
    expected = [r.noise_scale for r in module.results]
    assert len(expected) == STEPS and all(v is not None for v in expected)
    metrics = next(tmp_path.glob("run/*/metrics.csv"))
    with metrics.open() as f:
        rows = [row for row in csv.DictReader(f) if row.get("noise_scale")]
    assert [float(row["noise_scale"]) for row in rows] == pytest.approx(expected, rel=1e-6)
    assert [int(row["step"]) for row in rows] == [1, 2, 3]  # one row per optimizer step


def test_lightning_needs_an_accumulator() -> None:
    callback = lightning.NoiseScaleCallback("missing")
    with pytest.raises(ValueError, match="no Accumulator in its 'missing' attribute"):
        callback.on_train_batch_end(None, ManualRegression(), None, None, 0)  # type: ignore[arg-type]


def test_hf_adds_noise_scale_to_the_trainer_logs(tmp_path: Path) -> None:
    model = nn.Linear(5, 1)
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), 2, noise_scale=True)
    callback = hf.NoiseScaleCallback(acc)
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    state, control = TrainerState(), TrainerControl()
    x, y = _data().tensors
    for step in range(1, 3):
        for j in range(2):
            sl = slice(4 * j, 4 * j + 4)
            with acc.micro_step() as micro:
                acc.backward(((model(x[sl]).squeeze(1) - y[sl]) ** 2).sum(), 4)
        state.global_step = step
        callback.on_step_end(args, state, control)
    assert micro.result is not None and micro.result.noise_scale is not None
    state.log_history.append({"loss": 1.0, "step": 2})  # what Trainer.log records, then on_log
    logs = {"loss": 1.0}
    callback.on_log(args, state, control, logs=logs)
    assert logs["noise_scale"] == state.log_history[-1]["noise_scale"] == micro.result.noise_scale
    assert [step for step, _ in callback.history] == [1, 2]


def test_hf_logs_nothing_while_undefined(tmp_path: Path) -> None:
    model = nn.Linear(5, 1)
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), 1, noise_scale=True)
    callback = hf.NoiseScaleCallback(acc)
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    x, y = _data().tensors
    with acc.micro_step():
        acc.backward(((model(x).squeeze(1) - y) ** 2).sum(), len(y))
    logs = {"loss": 1.0}
    callback.on_step_end(args, TrainerState(), TrainerControl())
    callback.on_log(args, TrainerState(), TrainerControl(), logs=logs)
    assert "noise_scale" not in logs and callback.history == []
