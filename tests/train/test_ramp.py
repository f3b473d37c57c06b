"""``MicroBatcher(..., ramp=BatchRamp...)``: the global batch changes only between optimizer
steps, each step stays the exact full-batch step, and the learning rate follows the rule."""

from __future__ import annotations

import itertools
import logging
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from batchfit.train import Accumulator, BatchRamp, MicroBatcher, StepResult, lr_scale

LR = 0.1


def _data(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 5, generator=gen), torch.randn(n, generator=gen)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1))


def _step_fn(model: nn.Module):  # type: ignore[no-untyped-def]
    def step_fn(micro: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, int]:
        x, y = micro
        return ((model(x).squeeze(1) - y) ** 2).sum(), len(y)

    return step_fn


def _run(batcher: MicroBatcher, model: nn.Module, steps: int, fail_at: int | None = None):  # type: ignore[no-untyped-def]
    """Draw ``local_batch_size`` samples per step from one stream; returns results, batches."""
    x, y = _data(400)
    taken, results, batches = 0, [], []
    step_fn = _step_fn(model)
    for step in range(steps):
        n = batcher.local_batch_size
        assert n is not None
        batch = (x[taken : taken + n], y[taken : taken + n])
        taken += n
        fn = step_fn
        if step == fail_at:
            calls = iter(range(100))

            def fn(micro, calls=calls):  # type: ignore[no-untyped-def]
                if next(calls) == 1:  # the second micro-step of the first attempt
                    raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
                return step_fn(micro)

        results.append(batcher.run(batch, fn))
        batches.append(batch)
    return results, batches


def _full_batch(batches: list[tuple[torch.Tensor, torch.Tensor]], lrs: list[float]) -> nn.Module:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for (x, y), lr in zip(batches, lrs, strict=True):
        opt.param_groups[0]["lr"] = lr
        F.mse_loss(model(x).squeeze(1), y).backward()
        opt.step()
        opt.zero_grad()
    return model


@pytest.mark.parametrize("fail_at", [None, 2], ids=["clean", "oom-at-the-boundary"])
def test_schedule_changes_the_batch_between_steps_and_the_lr_with_it(
    fail_at: int | None, caplog: pytest.LogCaptureFixture
) -> None:
    model = _model()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=LR))
    ramp = BatchRamp.schedule([(0, 8), (2, 16), (4, 32)], lr_rule="linear")
    batcher = MicroBatcher(acc, 4, ramp=ramp)
    with caplog.at_level(logging.INFO, logger="batchfit.train.recover"):
        results, batches = _run(batcher, model, 5, fail_at=fail_at)
    assert [r.num_items for r in results] == [8, 8, 16, 16, 32]
    assert [r.learning_rate for r in results] == pytest.approx([LR, LR, 2 * LR, 2 * LR, 4 * LR])
    expected_ooms = [0, 0, 1, 0, 0] if fail_at is not None else [0] * 5
    assert [r.ooms for r in results] == expected_ooms
    micro = 2 if fail_at is not None else 4
    assert [r.micro_steps for r in results][2:] == [16 // micro, 16 // micro, 32 // micro]
    assert caplog.text.count("samples from step") == 2  # two changes, each logged once
    reference = _full_batch(batches, [r.learning_rate for r in results])
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_run_refuses_a_batch_of_another_size() -> None:
    model = _model()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=LR))
    batcher = MicroBatcher(acc, 4, ramp=BatchRamp.schedule(lambda step: 8 * (step + 1)))
    x, y = _data(12)
    with pytest.raises(ValueError, match="local_batch_size"):
        batcher.run((x, y), _step_fn(model))
    assert acc.steps == 0 and all(p.grad is None for p in model.parameters())


def test_scheduler_base_rates_follow() -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** (step // 2))
    acc = Accumulator(model, opt, scheduler=scheduler)
    batcher = MicroBatcher(acc, 4, ramp=BatchRamp.schedule([(0, 8), (1, 32)]))
    results, _ = _run(batcher, model, 3)
    # LambdaLR recomputes from base_lrs each step: the sqrt factor (2) must survive it
    assert [r.learning_rate for r in results] == pytest.approx([1e-3, 2e-3, 1e-3])


# Linear regression at a fixed point (a vanishing LR), as in test_noise_scale.py: B_simple is
# about 30 samples.
DIM = 32
_GEN = torch.Generator().manual_seed(0)
H = torch.linspace(0.5, 2.0, DIM)
W_STAR = torch.randn(DIM, generator=_GEN)
W0 = W_STAR + 0.3 * torch.randn(DIM, generator=_GEN)


def test_noise_scale_ramp_grows_until_the_batch_passes_the_noise_scale() -> None:
    model = nn.Linear(DIM, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(W0[None])
    lr = 1e-12  # the estimate needs a fixed point; the rule still shows in the rate
    acc = Accumulator(model, torch.optim.Adam(model.parameters(), lr=lr), noise_scale=True)
    ramp = BatchRamp.noise_scale(4, max_global_batch=256, patience=20)
    batcher = MicroBatcher(acc, 2, ramp=ramp)
    gen = torch.Generator().manual_seed(1)

    def step_fn(micro: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, int]:
        x, y = micro
        return 0.5 * ((model(x).squeeze(1) - y) ** 2).sum(), len(y)

    results: list[StepResult] = []
    for _ in range(200):
        n = batcher.local_batch_size
        assert n is not None
        x = torch.randn(n, DIM, generator=gen) * H.sqrt()
        results.append(batcher.run((x, x @ W_STAR + torch.randn(n, generator=gen)), step_fn))
    sizes = [int(r.num_items) for r in results]
    changes = [i for i in range(1, len(sizes)) if sizes[i] != sizes[i - 1]]
    assert sizes[0] == 4 and all(b == 2 * a for a, b in itertools.pairwise(sizes) if b != a)
    assert all(b - a > 20 for a, b in itertools.pairwise([0, *changes]))  # patience between changes
    assert sizes[-1] in (32, 64)  # grown past B_simple ~ 30, not run away to the cap
    for result in results:  # the rate follows the square-root rule at every size
        assert result.learning_rate == pytest.approx(lr * math.sqrt(result.num_items / 4))


def test_lr_scale() -> None:
    assert lr_scale("sqrt", 64, 256) == 2.0
    assert lr_scale("linear", 256, 64) == 0.25
    with pytest.raises(ValueError, match="unknown LR rule"):
        lr_scale("cubic", 1, 2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="old_batch"):
        lr_scale("sqrt", 0, 2)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: BatchRamp.schedule([(1, 8)]), "rising from 0"),
        (lambda: BatchRamp.schedule([(0, 8), (0, 16)]), "rising from 0"),
        (lambda: BatchRamp.schedule([(0, 0)]), "global batch"),
        (lambda: BatchRamp.schedule(lambda step: 0), "step 0"),
        (lambda: BatchRamp.noise_scale(8, max_global_batch=4), "below start"),
        (lambda: BatchRamp.noise_scale(8, max_global_batch=64, growth=1.0), "growth"),
        (lambda: BatchRamp(8, lr_rule="cubic"), "lr_rule"),  # type: ignore[arg-type]
    ],
)
def test_bad_ramps(make, match: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=match):
        make()
