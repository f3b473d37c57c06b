"""``batchfit.train.retry``: one OOM retry rule for ``MicroBatcher``, ``DeepSpeedMicroBatcher``
and Lightning's ``MicroBatchCallback``.

The plain loop and the DeepSpeed integration, given the same step that runs out of memory
above a size, try the same sizes in the same order: the ones the rule predicts.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from torch import nn

from batchfit.integrations.deepspeed import DeepSpeedMicroBatcher
from batchfit.train import Accumulator, MicroBatcher
from batchfit.train.retry import micro_batch_at_most, smaller_micro_batch

pytestmark = pytest.mark.usefixtures("frozen_gc")

# (samples per rank, first micro-batch, largest size that fits)
CASES = [(32, 16, 8), (45, 45, 8), (36, 36, 4), (24, 24, 2), (30, 10, 4), (12, 12, 1)]


def _predicted(n: int, start: int, fits: int, floor: int = 1) -> list[int]:
    sizes = [start]
    while sizes[-1] > fits:
        smaller = smaller_micro_batch(sizes[-1], n, floor)
        assert smaller is not None
        sizes.append(smaller)
    return sizes


def _oom_above(fits: int, tried: list[int]) -> Any:
    def check(size: int) -> None:
        if not tried or tried[-1] != size:
            tried.append(size)  # the first micro-step of an attempt: its size
        if size > fits:
            raise torch.OutOfMemoryError(f"CUDA out of memory at {size} (simulated)")

    return check


def _plain_loop_sizes(n: int, start: int, fits: int, floor: int = 1) -> list[int]:
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    batcher = MicroBatcher(
        Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1)),
        start,
        min_micro_batch_size=floor,
    )
    tried: list[int] = []
    check = _oom_above(fits, tried)

    def step_fn(x: torch.Tensor) -> tuple[torch.Tensor, int]:
        check(len(x))
        return model(x).sum(), len(x)

    result = batcher.run(torch.randn(n, 3), step_fn)
    assert result.micro_batch_size == tried[-1]
    assert result.ooms == len(tried) - 1 == batcher.num_ooms
    return tried


class _Engine:
    """What ``DeepSpeedMicroBatcher`` reads and calls on a ``DeepSpeedEngine``, on one rank."""

    dp_world_size = 1

    def __init__(self, micro: int, per_rank: int) -> None:
        torch.manual_seed(0)
        self.module = nn.Linear(3, 1)
        self.optimizer = torch.optim.SGD(self.module.parameters(), lr=0.1)
        self.micro, self.batch = micro, per_rank
        self.steps = 0

    def zero_optimization_stage(self) -> int:
        return 0

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.micro

    def gradient_accumulation_steps(self) -> int:
        return self.batch // self.micro

    def train_batch_size(self) -> int:
        return self.batch

    def set_train_micro_batch_size(self, micro: int) -> None:
        self.micro = micro

    def set_train_batch_size(self, batch: int) -> None:
        assert batch % self.micro == 0, "DeepSpeed refuses a micro-batch that does not divide"
        self.batch = batch

    def set_gradient_accumulation_boundary(self, boundary: bool | None) -> None:
        pass

    def backward(self, loss: torch.Tensor) -> None:
        (loss / self.gradient_accumulation_steps()).backward()

    def allreduce_gradients(self) -> None:
        pass

    def step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.steps += 1

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()


def _deepspeed_sizes(n: int, start: int, fits: int, floor: int = 1) -> list[int]:
    engine = _Engine(start, n)
    batcher = DeepSpeedMicroBatcher(engine, min_micro_batch_size=floor)
    tried: list[int] = []
    check = _oom_above(fits, tried)

    def step_fn(x: torch.Tensor) -> torch.Tensor:
        check(len(x))
        return engine.module(x).mean()

    result = batcher.run(torch.randn(n, 3), step_fn)
    assert (result.micro_batch_size, result.grad_accum_steps) == (tried[-1], n // tried[-1])
    assert result.ooms == len(tried) - 1 == batcher.num_ooms
    assert (engine.micro, engine.batch, engine.steps) == (tried[-1], n, 1)
    return tried


@pytest.mark.parametrize(("n", "start", "fits"), CASES)
def test_plain_loop_and_deepspeed_take_the_same_sizes(n: int, start: int, fits: int) -> None:
    expected = _predicted(n, start, fits)
    assert _plain_loop_sizes(n, start, fits) == expected
    assert _deepspeed_sizes(n, start, fits) == expected
    assert all(n % size == 0 for size in expected)  # every size keeps n = micro x accumulation


def test_halving_rounds_down_to_a_divisor() -> None:
    """45 samples: 22 does not divide them, so 45 -> 15 -> 5 (halving alone: 45, 22, 11, 5)."""
    assert _plain_loop_sizes(45, 45, 8) == _deepspeed_sizes(45, 45, 8) == [45, 15, 5]


def test_the_floor_is_tried_before_giving_up() -> None:
    """Floor 5, 12 samples: half of 8 is 4, below the floor, so the next try is 6."""
    assert _plain_loop_sizes(12, 12, 6, floor=5) == _deepspeed_sizes(12, 12, 6, floor=5)
    assert _plain_loop_sizes(12, 12, 6, floor=5) == [12, 6]
    assert smaller_micro_batch(8, 12, floor=5) == 6


@pytest.mark.parametrize("loop", ["plain", "deepspeed"])
def test_one_message_when_nothing_smaller_is_left(loop: str) -> None:
    sizes = _plain_loop_sizes if loop == "plain" else _deepspeed_sizes
    with pytest.raises(torch.OutOfMemoryError) as raised:
        sizes(8, 8, 0)
    assert "out of memory at micro-batch 1, the smallest allowed" in str(raised.value)
    assert "turn on gradient checkpointing" in str(raised.value)
    with pytest.raises(torch.OutOfMemoryError, match="no smaller micro-batch of at least 3"):
        sizes(8, 4, 0, 3)


def test_growth_goes_back_to_a_divisor(caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    batcher = MicroBatcher(
        Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1)), 12, grow_after_steps=1
    )
    failed: list[int] = []

    def step_fn(x: torch.Tensor) -> tuple[torch.Tensor, int]:
        if len(x) == 12 and not failed:
            failed.append(12)
            raise torch.OutOfMemoryError("simulated")
        return model(x).sum(), len(x)

    with caplog.at_level(logging.INFO, logger="batchfit.train.recover"):
        sizes = [batcher.run(torch.randn(12, 3), step_fn).micro_batch_size for _ in range(3)]
    assert sizes == [6, 6, 12]
    assert "trying 12" in caplog.text


@pytest.mark.slow
def test_lightning_sizes_by_the_same_divisor_rule() -> None:
    pl = pytest.importorskip("lightning.pytorch")
    from torch.utils.data import DataLoader, TensorDataset

    from batchfit.integrations.lightning import MicroBatchCallback

    class Module(pl.LightningModule):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(3, 1)
            self.batch_size = 12

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.net(batch[0]).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self) -> DataLoader[Any]:
            return DataLoader(TensorDataset(torch.randn(12, 3)), batch_size=self.batch_size)

    callback = MicroBatchCallback(5, global_batch_size=12)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
    )
    trainer.fit(Module())
    assert callback.chosen == (micro_batch_at_most(12, 5), 3) == (4, 3)
