"""``Accumulator``: any micro-batching of a global batch gives the full-batch step.

Exactness is checked on parameters after several optimizer steps, against a hand-written
full-batch step with PyTorch's own mean losses. AdamW runs with ``lr=1e-3, eps=1e-6``: Adam
divides each gradient by its own magnitude, so a gradient that is mathematically zero (GPT-2's
key bias: softmax ignores a constant per query) is pure rounding noise that ``eps=1e-8`` turns
into a whole step, and two correct summation orders then disagree by ``lr``. Because Adam also
hides a uniform scale error, SGD runs too, and the reported gradient norm is compared.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from batchfit.train import Accumulator, class_weights, cross_entropy_sum
from tests._tiny import (
    VOCAB,
    accumulated_steps,
    full_batch_steps,
    linear_stack,
    logits_of,
    tiny_gpt2_lm,
    token_batches,
)

BATCHES = token_batches(3, 8)
WEIGHTS = class_weights(
    torch.cat([labels for _, labels in BATCHES]), VOCAB, scheme="effective_number"
)
MODELS = {"linear-stack": linear_stack, "gpt2-2layer": tiny_gpt2_lm}


def adamw(params: Iterator[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-6)


def sgd(params: Iterator[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.5)


def assert_same_params(a: nn.Module, b: nn.Module, atol: float = 1e-5) -> None:
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, atol=atol, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("micro_batch_size", [8, 4, 2, 1])
@pytest.mark.parametrize("weighted", [False, True], ids=["token-mean", "class-weighted"])
@pytest.mark.parametrize("model_name", list(MODELS))
def test_micro_batching_equals_full_batch_step(
    model_name: str, weighted: bool, micro_batch_size: int
) -> None:
    make = MODELS[model_name]
    weights = WEIGHTS if weighted else None
    ref, acc_model = make(), make()
    ref_losses = full_batch_steps(ref, BATCHES, weights, make_opt=adamw)
    losses = accumulated_steps(acc_model, BATCHES, micro_batch_size, weights, make_opt=adamw)
    assert_same_params(ref, acc_model)
    assert losses == pytest.approx(ref_losses, rel=1e-6)


@pytest.mark.parametrize("micro_batch_size", [4, 1])
def test_sgd_exposes_scale_errors(micro_batch_size: int) -> None:
    ref, acc_model = linear_stack(), linear_stack()
    full_batch_steps(ref, BATCHES, WEIGHTS, make_opt=sgd)
    accumulated_steps(acc_model, BATCHES, micro_batch_size, WEIGHTS, make_opt=sgd)
    assert_same_params(ref, acc_model, atol=1e-6)


def test_per_micro_batch_mean_is_not_exact() -> None:
    """Negative control: the naive loop (mean per micro-batch / k) fails the same comparison."""
    ref, naive = linear_stack(), linear_stack()
    full_batch_steps(ref, BATCHES, make_opt=adamw)
    opt = adamw(naive.parameters())
    for ids, labels in BATCHES:
        for start in range(0, 8, 2):
            logits = logits_of(naive, ids[start : start + 2])
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), labels[start : start + 2].reshape(-1))
            (loss / 4).backward()
        opt.step()
        opt.zero_grad()
    diff = max(
        (a - b).abs().max().item()
        for a, b in zip(ref.parameters(), naive.parameters(), strict=True)
    )
    assert diff > 1e-4


def _one_step(model: nn.Module, acc: Accumulator, micro_batch_size: int, batch_index: int = 0):
    ids, labels = BATCHES[batch_index]
    for start in range(0, 8, micro_batch_size):
        with acc.micro_step() as micro:
            sl = slice(start, start + micro_batch_size)
            acc.backward(*cross_entropy_sum(logits_of(model, ids[sl]), labels[sl]))
    assert micro.result is not None
    return micro.result


def test_clipping_and_reported_norm_match_torch() -> None:
    ref, model = linear_stack(), linear_stack()
    ids, labels = BATCHES[0]
    loss = F.cross_entropy(logits_of(ref, ids).reshape(-1, VOCAB), labels.reshape(-1))
    loss.backward()
    norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05))
    torch.optim.SGD(ref.parameters(), lr=0.5).step()

    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.5), 4, max_grad_norm=0.05)
    result = _one_step(model, acc, 2)
    assert norm > 0.05  # the clip really clipped
    assert result.grad_norm == pytest.approx(norm, rel=1e-5)
    assert result.loss == pytest.approx(float(loss), rel=1e-6)
    assert result.num_items == float((labels != -100).sum())
    assert_same_params(ref, model, atol=1e-6)


def test_item_count_types_agree() -> None:
    """int, float and 0-dim tensor counts give the same step."""
    results = []
    for convert in (int, float, torch.tensor):
        model = linear_stack()
        acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.5), 2)
        ids, labels = BATCHES[0]
        for sl in (slice(0, 4), slice(4, 8)):
            with acc.micro_step() as micro:
                loss_sum, n = cross_entropy_sum(logits_of(model, ids[sl]), labels[sl])
                acc.backward(loss_sum, num_items=convert(int(n)))
        results.append((micro.result, [p.detach().clone() for p in model.parameters()]))
    for result, params in results[1:]:
        assert result == results[0][0]
        for a, b in zip(params, results[0][1], strict=True):
            torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_grad_scaler_keeps_scale_and_unscales_once() -> None:
    ref, model = linear_stack(), linear_stack()
    full_batch_steps(ref, BATCHES[:2], make_opt=sgd)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
    acc = Accumulator(model, sgd(model.parameters()), 4, scaler=scaler)
    unscales = []
    original = scaler.unscale_
    scaler.unscale_ = lambda opt: (unscales.append(scaler.get_scale()), original(opt))[1]
    scales = []
    for batch_index in range(2):
        ids, labels = BATCHES[batch_index]
        for start in range(0, 8, 2):
            with acc.micro_step() as micro:
                scales.append(scaler.get_scale())
                sl = slice(start, start + 2)
                acc.backward(*cross_entropy_sum(logits_of(model, ids[sl]), labels[sl]))
        assert micro.result is not None and not micro.result.skipped
    # fixed within a step, grown (growth_interval=1) between steps; one unscale_ per step
    assert scales == [2.0**10] * 4 + [2.0**11] * 4
    assert unscales == [2.0**10, 2.0**11]
    assert_same_params(ref, model, atol=1e-6)


def test_overflow_skips_step_and_scheduler() -> None:
    model = linear_stack()
    opt = sgd(model.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    acc = Accumulator(model, opt, 2, scaler=scaler, scheduler=scheduler)
    before = [p.detach().clone() for p in model.parameters()]
    ids, labels = BATCHES[0]
    for sl, poison in ((slice(0, 4), False), (slice(4, 8), True)):
        with acc.micro_step() as micro:
            loss_sum, n = cross_entropy_sum(logits_of(model, ids[sl]), labels[sl])
            acc.backward(loss_sum * (float("inf") if poison else 1.0), n)
    assert micro.result is not None and micro.result.skipped
    assert scheduler.last_epoch == 0 and opt.param_groups[0]["lr"] == 0.5
    assert scaler.get_scale() == 2.0**9
    for a, b in zip(model.parameters(), before, strict=True):
        torch.testing.assert_close(a.detach(), b, atol=0, rtol=0)
    assert all(p.grad is None for p in model.parameters())
    result = _one_step(model, acc, 4)
    assert not result.skipped and scheduler.last_epoch == 1
    assert result.learning_rate == 0.5 and opt.param_groups[0]["lr"] == 0.25


def test_finish_ends_a_short_global_step_exactly() -> None:
    """An epoch tail: 2 of 4 declared micro-steps, then ``finish()``; then a changed count."""
    ref, model = linear_stack(), linear_stack()
    ids, labels = BATCHES[0]
    half = (ids[:4], labels[:4])
    full_batch_steps(ref, [half, BATCHES[1]], make_opt=sgd)
    acc = Accumulator(model, sgd(model.parameters()), 4)
    for sl in (slice(0, 2), slice(2, 4)):
        with acc.micro_step() as micro:
            acc.backward(*cross_entropy_sum(logits_of(model, ids[sl]), labels[sl]))
    assert micro.result is None
    assert acc.finish().micro_steps == 2
    acc.grad_accum_steps = 2
    assert _one_step(model, acc, 4, batch_index=1).micro_steps == 2
    assert_same_params(ref, model, atol=1e-6)


def test_exception_in_a_micro_step_drops_the_partial_step() -> None:
    ref, model = linear_stack(), linear_stack()
    full_batch_steps(ref, BATCHES[:1], make_opt=sgd)
    acc = Accumulator(model, sgd(model.parameters()), 4)
    ids, labels = BATCHES[1]
    with pytest.raises(KeyError):
        for sl in (slice(0, 2), slice(2, 4)):
            with acc.micro_step():
                acc.backward(*cross_entropy_sum(logits_of(model, ids[sl]), labels[sl]))
                if sl.start == 2:
                    raise KeyError("a data error after backward")
    assert acc.micro_steps_done == 0
    assert all(p.grad is None for p in model.parameters())
    _one_step(model, acc, 2)
    assert_same_params(ref, model, atol=1e-6)


def _acc(k: int = 2) -> tuple[nn.Module, Accumulator]:
    model = nn.Linear(3, 2)
    return model, Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), k)


def _loss(model: nn.Module) -> torch.Tensor:
    return model(torch.ones(2, 3)).sum()


@pytest.mark.parametrize("k", [0, -1, 1.5, True, "2"])
def test_bad_grad_accum_steps(k: object) -> None:
    model = nn.Linear(3, 2)
    with pytest.raises(ValueError, match="grad_accum_steps must be a positive integer"):
        Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), k)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("num_items", "match"),
    [
        (-1, "finite count >= 0"),
        (float("nan"), "finite count >= 0"),
        ("3", "int, float or one-element tensor"),
        (True, "int, float or one-element tensor"),
        (torch.ones(2), "one count"),
    ],
)
def test_bad_num_items(num_items: object, match: str) -> None:
    model, acc = _acc()
    with pytest.raises(ValueError, match=match), acc.micro_step():
        acc.backward(_loss(model), num_items)  # type: ignore[arg-type]


def test_negative_tensor_count_fails_at_the_step() -> None:
    model, acc = _acc(1)
    with pytest.raises(ValueError, match="negative or not finite"), acc.micro_step():
        acc.backward(_loss(model), torch.tensor(-2))
    assert all(p.grad is None for p in model.parameters())


def test_no_items_in_the_whole_global_batch() -> None:
    model, acc = _acc(2)
    with acc.micro_step():  # a micro-batch of padding is fine on its own
        acc.backward(_loss(model) * 0, 0)
    with pytest.raises(ValueError, match="no items"), acc.micro_step():
        acc.backward(_loss(model) * 0, torch.tensor(0))


def test_backward_outside_micro_step() -> None:
    model, acc = _acc()
    with pytest.raises(RuntimeError, match=r"outside `with acc\.micro_step"):
        acc.backward(_loss(model), 2)


def test_more_backward_calls_than_micro_steps() -> None:
    model, acc = _acc()
    with (
        pytest.raises(RuntimeError, match="more backward calls than micro-steps"),
        acc.micro_step(),
    ):
        acc.backward(_loss(model), 2)
        acc.backward(_loss(model), 2)
    assert acc.micro_steps_done == 0


def test_nested_micro_steps() -> None:
    _, acc = _acc()
    with pytest.raises(RuntimeError, match="do not nest"), acc.micro_step(), acc.micro_step():
        pass


def test_deferred_does_not_nest_or_start_inside_a_micro_step() -> None:
    _, acc = _acc()
    with pytest.raises(RuntimeError, match="inside deferred"), acc.deferred(), acc.deferred():
        pass
    with pytest.raises(RuntimeError, match="micro_step"), acc.micro_step(), acc.deferred():
        pass


def test_deferred_last_micro_step_waits_for_finish() -> None:
    model, acc = _acc(2)
    with acc.deferred():
        for _ in range(2):
            with acc.micro_step() as micro:
                acc.backward(_loss(model), 2)
        assert micro.result is None and acc.steps == 0
        result = acc.finish()
    assert (result.micro_steps, result.num_items, acc.steps) == (2, 4.0, 1)
    assert acc.ddp is None


def test_micro_step_without_backward() -> None:
    _, acc = _acc()
    with pytest.raises(RuntimeError, match=r"without acc\.backward"), acc.micro_step():
        pass


def test_change_accumulation_mid_step() -> None:
    model, acc = _acc(3)
    with acc.micro_step():
        acc.backward(_loss(model), 2)
    with pytest.raises(RuntimeError, match="middle of a global step"):
        acc.grad_accum_steps = 2


def test_loss_must_be_a_sum() -> None:
    model, acc = _acc()
    with pytest.raises(ValueError, match="reduction='sum'"), acc.micro_step():
        acc.backward(model(torch.ones(2, 3)), 2)


def test_bad_max_grad_norm() -> None:
    model = nn.Linear(3, 2)
    with pytest.raises(ValueError, match="max_grad_norm must be positive"):
        Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), max_grad_norm=0.0)


def test_batchnorm_is_warned(caplog: pytest.LogCaptureFixture) -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    with caplog.at_level(logging.WARNING, logger="batchfit.train.accumulate"):
        Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), 4)
    assert "BatchNorm" in caplog.text
