"""``MicroBatchCallback`` in a real (tiny, CPU) Lightning fit: the micro-batch changes, the
global batch and the trained parameters do not."""

from __future__ import annotations

import copy
import logging
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from batchfit.export import export
from batchfit.hardware import get_gpu
from batchfit.integrations.lightning import MicroBatchCallback, trainer_kwargs
from batchfit.models import resolve_model
from batchfit.plan import make_plan
from batchfit.spec import TrainingSetup

pytestmark = pytest.mark.slow

GLOBAL, STEPS = 8, 3


def _data() -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    n = GLOBAL * STEPS
    return TensorDataset(torch.randn(n, 5, generator=gen), torch.randn(n, generator=gen))


class Regression(pl.LightningModule):
    def __init__(self, batch_size: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 1))
        self.batch_size = batch_size
        self.seen: list[int] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.seen.append(len(x))
        return ((self.net(x).squeeze(1) - y) ** 2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_data(), batch_size=self.batch_size, shuffle=False)


def _fit(module: Regression, callback: MicroBatchCallback, **kwargs: Any) -> pl.Trainer:
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
        **kwargs,
    )
    trainer.fit(module)
    return trainer


def _full_batch_reference() -> nn.Module:
    net = copy.deepcopy(Regression(GLOBAL).net)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for x, y in DataLoader(_data(), batch_size=GLOBAL):
        ((net(x).squeeze(1) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    return net


def test_fixed_micro_batch_keeps_the_global_batch(caplog: pytest.LogCaptureFixture) -> None:
    module = Regression(batch_size=GLOBAL)  # configured as 8 x 1
    callback = MicroBatchCallback(2)
    with caplog.at_level(logging.INFO, logger="batchfit.integrations.lightning"):
        trainer = _fit(module, callback)
    assert callback.chosen == (2, 4)
    assert trainer.accumulate_grad_batches == 4 and module.batch_size == 2
    assert module.seen == [2] * (GLOBAL * STEPS // 2)
    assert trainer.global_step == STEPS
    assert "global batch 8" in caplog.text
    for a, b in zip(module.net.parameters(), _full_batch_reference().parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_finder_result_is_lowered_to_a_divisor() -> None:
    calls: list[tuple[Any, Any]] = []

    def finder(trainer: pl.Trainer, module: pl.LightningModule) -> int:
        calls.append((trainer, module))
        return 3  # does not divide 8

    module = Regression(batch_size=4)
    callback = MicroBatchCallback(finder)
    trainer = _fit(module, callback, accumulate_grad_batches=2)  # configured as 4 x 2
    assert len(calls) == 1 and calls[0][1] is module
    assert callback.chosen == (2, 4) and trainer.global_step == STEPS
    assert set(module.seen) == {2}


def test_from_plan_and_trainer_kwargs() -> None:
    plan = make_plan(
        resolve_model("gpt2"),
        get_gpu("rtx-3060"),
        TrainingSetup(),
        seq_len=256,
        global_batch=GLOBAL,
        micro_batch_size=4,
        engine="analytic",  # the kwargs and the callback are tested, not the engine
    )
    kwargs = trainer_kwargs(plan, accelerator="cpu")
    assert kwargs == {**export(plan, "lightning")["trainer"], "accelerator": "cpu"}
    pl.Trainer(**{**kwargs, "precision": "32-true", "logger": False})  # the real parser
    module = Regression(batch_size=1)
    callback = MicroBatchCallback.from_plan(plan)
    trainer = _fit(module, callback)
    assert callback.chosen == (4, 2) and trainer.global_step == STEPS


def test_bad_finder_result() -> None:
    with pytest.raises(ValueError, match="finder returned 0"):
        _fit(Regression(batch_size=4), MicroBatchCallback(lambda trainer, module: 0))


def test_missing_batch_attribute() -> None:
    with pytest.raises(ValueError, match="no 'bs' attribute"):
        _fit(Regression(batch_size=4), MicroBatchCallback(2, batch_arg_name="bs"))
