"""An own nn.Module gets the full plan: micro-batch, accumulation, LR, ladder."""

from __future__ import annotations

import pytest
import torch

from batchfit.errors import UsageError
from batchfit.hardware import get_gpu
from batchfit.memory.estimate import estimate
from batchfit.plan import make_plan
from batchfit.spec import TrainingSetup

pytestmark = pytest.mark.slow


def small_cnn() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 64, 3, padding=1),
        torch.nn.BatchNorm2d(64),
        torch.nn.ReLU(),
        torch.nn.Conv2d(64, 64, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(64, 10),
    )


def images(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 3, 512, 512), torch.randint(0, 10, (n,))


def step_loss(out: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(out, batch[1])


class _ImagesOnly(torch.nn.Module):
    """The CNN called with (images, labels): it looks at the images."""

    def __init__(self) -> None:
        super().__init__()
        self.net = small_cnn()

    def forward(self, x: torch.Tensor, _labels: torch.Tensor) -> torch.Tensor:
        return self.net(x)  # type: ignore[no-any-return]


def test_an_own_cnn_gets_accumulation_lr_and_a_micro_batch_that_fits():
    t4 = get_gpu("t4")
    plan = make_plan(
        _ImagesOnly,
        t4,
        TrainingSetup(precision="fp32", optimizer="sgd-momentum"),
        batch_fn=images,
        loss_fn=step_loss,
        global_batch=512,
        base_lr=0.1,
        base_batch=64,
    )
    assert plan.micro_batch_size * plan.grad_accum_steps == 512
    assert 1 <= plan.micro_batch_size < 512 and plan.grad_accum_steps > 1
    assert plan.learning_rate == pytest.approx(0.8)  # linear rule for SGD: 0.1 x 512 / 64
    assert plan.model == "_ImagesOnly" and plan.estimate.engine == "trace"

    def total(n: int) -> int:
        return estimate(
            _ImagesOnly,
            plan.setup,
            batch_fn=lambda: images(n),
            loss_fn=step_loss,
            gpu=t4,
            grad_accum_steps=2,
        ).device_total_bytes

    assert total(plan.micro_batch_size) == plan.estimate.device_total_bytes
    assert plan.headroom_bytes >= plan.headroom_wanted_bytes
    if plan.max_micro_batch == plan.micro_batch_size:  # the largest: one more does not fit
        assert t4.memory_bytes - total(plan.micro_batch_size + 1) < plan.headroom_wanted_bytes
    if plan.micro_batch_size < 16:
        assert any("BatchNorm" in w for w in plan.warnings)


def test_an_own_model_that_does_not_fit_climbs_the_ladder_it_can_take():
    # a big MLP: too large for a T4 in fp32 AdamW; the module cannot be checkpointed or wrapped
    # with LoRA by batchfit, so the plan takes what it can (8-bit states, pure bf16)
    def big_mlp() -> torch.nn.Module:
        return torch.nn.Sequential(*[torch.nn.Linear(8192, 8192) for _ in range(12)])

    plan = make_plan(
        big_mlp,
        get_gpu("t4"),
        TrainingSetup(precision="fp32"),
        batch_fn=lambda n: torch.randn(n, 8192),
        loss_fn=lambda out, batch: out.square().mean(),
        global_batch=64,
    )
    names = [t.name for t in plan.techniques]
    assert "gradient-checkpointing" not in names and "lora" not in names
    assert plan.techniques and plan.headroom_bytes > 0


def test_own_model_arguments_are_checked():
    with pytest.raises(UsageError, match="batch_fn"):
        make_plan(small_cnn, get_gpu("t4"), TrainingSetup(), global_batch=8)
    with pytest.raises(UsageError, match="engine='trace'"):
        make_plan(
            small_cnn,
            get_gpu("t4"),
            TrainingSetup(),
            global_batch=8,
            batch_fn=images,
            engine="analytic",
        )
    with pytest.raises(UsageError, match="needs seq_len"):
        make_plan(small_cnn, get_gpu("t4"), TrainingSetup(), global_batch_tokens=8, batch_fn=images)


def test_a_bf16_gpu_plans_an_own_module_with_16_bit_inputs_for_pure_bf16():
    # the pure-bf16 rung builds the module in bf16: its inputs are cast as a bf16 run casts them
    plan = make_plan(
        _ImagesOnly,
        get_gpu("a100-80gb"),
        TrainingSetup(optimizer="sgd-momentum"),
        batch_fn=images,
        loss_fn=step_loss,
        global_batch=512,
    )
    assert plan.micro_batch_size * plan.grad_accum_steps == 512
    assert any(t.name == "pure-bf16" for a in plan.alternatives for t in a.techniques)


def test_a_huge_global_batch_traces_two_micro_steps_not_all_of_them():
    calls: list[int] = []

    def batch(n: int) -> torch.Tensor:
        calls.append(n)
        return torch.randn(n, 256)

    plan = make_plan(
        lambda: torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.Linear(1024, 256)),
        get_gpu("t4"),
        TrainingSetup(),
        batch_fn=batch,
        loss_fn=lambda out, b: out.square().mean(),
        global_batch=100_003,  # prime: micro-batch 1 x 100,003 or the whole batch at once
    )
    assert plan.micro_batch_size * plan.grad_accum_steps == 100_003
    assert len(calls) < 200  # a few micro-steps per dry run, not 100,003


def test_a_batch_fn_without_the_sample_count_is_one_line():
    with pytest.raises(UsageError, match="batch_fn must take the number of samples"):
        make_plan(
            small_cnn,
            get_gpu("t4"),
            TrainingSetup(),
            global_batch=8,
            batch_fn=lambda: images(2),  # type: ignore[arg-type, misc]
        )


def test_the_plan_carries_its_memory_figures():
    plan = make_plan(
        _ImagesOnly,
        get_gpu("t4"),
        TrainingSetup(precision="fp32", optimizer="sgd-momentum"),
        batch_fn=images,
        loss_fn=step_loss,
        global_batch=64,
    )
    data = plan.to_json()
    assert plan.device_total_bytes == data["device_total_bytes"] == plan.estimate.device_total_bytes
    assert plan.peak_bytes == data["peak_bytes"] and plan.fits is data["fits"] is True
