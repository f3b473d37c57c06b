"""StepResult measures its step: seconds, peak memory, throughput."""

from __future__ import annotations

import torch

from batchfit.train import Accumulator, MicroBatcher


def test_each_step_carries_its_time_peak_and_throughput() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = Accumulator(model, opt, grad_accum_steps=2)
    for _ in range(2):
        with acc.micro_step():
            acc.backward(model(torch.randn(8, 64)).square().sum(), num_items=8)
    result = acc.last_result
    assert result is not None
    assert result.seconds > 0 and result.items_per_s == 16 / result.seconds
    assert result.peak_bytes is not None and result.peak_bytes > 0  # RSS high-water (Linux)
    assert result.reserved_bytes is None  # no caching allocator on the CPU
    assert result.samples_per_s is None  # the Accumulator does not know samples


def test_micro_batcher_knows_its_samples_per_second() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    batcher = MicroBatcher(acc, micro_batch_size=4)

    def step(x: torch.Tensor) -> tuple[torch.Tensor, int]:
        return model(x).square().sum(), x.shape[0]

    result = batcher.run(torch.randn(16, 64), step)
    assert result.samples_per_s is not None
    assert result.samples_per_s == 16 / result.seconds
