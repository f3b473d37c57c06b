"""``Accumulator(..., noise_scale=True)``: the gradient noise scale B_simple (McCandlish et al.
2018, appendix A).

Two kinds of checks: the hooks' sums equal a reference built from explicit per-micro-batch
gradients (``torch.autograd.grad``) to rounding, whatever the model (tied embeddings, reentrant
checkpointing, a GradScaler, unequal micro-batches); and on linear regression, where tr(Σ) and
|G|² are known in closed form, the estimate lands near the truth for any split.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from batchfit.train import Accumulator, cross_entropy_sum
from batchfit.train.noise import estimate_terms
from tests._tiny import linear_stack, logits_of, tiny_gpt2_lm, token_batches

LossFn = Callable[[nn.Module, int], tuple[torch.Tensor, float]]


def _reference(model: nn.Module, loss_fn: LossFn, k: int) -> float | None:
    """B_simple of one step from explicit per-micro-batch gradients of the loss sums."""
    params = [p for p in model.parameters() if p.requires_grad]
    grads, items = [], []
    for j in range(k):
        loss_sum, n = loss_fn(model, j)
        grads.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss_sum, params)]))
        items.append(float(n))
    total = sum(items)
    small = sum(float(g.double().square().sum()) for g in grads)
    big_norm = float(torch.stack(grads).double().sum(0).norm()) / total
    terms = estimate_terms(small, sum(b * b for b in items), total, big_norm)
    if terms is None or not terms[1] > 0:
        return None
    return max(0.0, terms[0] / terms[1])


def _measured(model: nn.Module, loss_fn: LossFn, k: int, **kwargs: object) -> float | None:
    acc = Accumulator(
        model,
        torch.optim.SGD(model.parameters(), lr=0.0),
        k,
        noise_scale=True,
        noise_scale_ema=0.0,
        **kwargs,  # type: ignore[arg-type]
    )
    for j in range(k):
        with acc.micro_step() as micro:
            acc.backward(*loss_fn(model, j))
    assert micro.result is not None
    return micro.result.noise_scale


def _token_loss(sizes: list[int]) -> LossFn:
    ids, labels = token_batches(1, sum(sizes), seed=3)[0]
    starts = [sum(sizes[:j]) for j in range(len(sizes))]

    def loss_fn(model: nn.Module, j: int) -> tuple[torch.Tensor, float]:
        sl = slice(starts[j], starts[j] + sizes[j])
        loss_sum, n = cross_entropy_sum(logits_of(model, ids[sl]), labels[sl])
        return loss_sum, float(n)

    return loss_fn


@pytest.mark.parametrize(
    "sizes", [[2, 2, 2, 2], [1, 5, 2], [4, 4]], ids=["equal", "unequal", "two"]
)
def test_hooks_equal_explicit_micro_batch_gradients(sizes: list[int]) -> None:
    loss_fn = _token_loss(sizes)
    expected = _reference(linear_stack(), loss_fn, len(sizes))
    assert expected is not None
    assert _measured(linear_stack(), loss_fn, len(sizes)) == pytest.approx(expected, rel=1e-4)


def test_tied_embeddings_count_the_summed_gradient() -> None:
    """GPT-2's ``wte`` is both the input embedding and the output layer: autograd adds the two
    uses before the hook, so the norm is of the sum, not a sum of norms."""
    model = tiny_gpt2_lm()
    assert model.lm_head.weight is model.transformer.wte.weight
    loss_fn = _token_loss([3, 3, 2])
    expected = _reference(tiny_gpt2_lm(), loss_fn, 3)
    assert expected is not None
    assert _measured(model, loss_fn, 3) == pytest.approx(expected, rel=1e-4)


class _SharedBlocks(nn.Module):
    """One layer applied three times under reentrant checkpointing: its hook fires per use."""

    def __init__(self, reentrant: bool = True) -> None:
        super().__init__()
        self.reentrant = reentrant
        torch.manual_seed(0)
        self.inp = nn.Linear(6, 8)
        self.shared = nn.Linear(8, 8)
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for _ in range(3):
            if self.reentrant:
                h = checkpoint(lambda t: torch.tanh(self.shared(t)), h, use_reentrant=True)
            else:  # the same function for the reference (torch.autograd.grad refuses reentrant)
                h = torch.tanh(self.shared(h))
        return self.out(h).squeeze(1)


def test_parameter_used_per_reentrant_segment_is_counted_once_per_micro_batch() -> None:
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(9, 6, generator=gen), torch.randn(9, generator=gen)
    sizes, starts = [2, 3, 4], [0, 2, 5]

    def loss_fn(model: nn.Module, j: int) -> tuple[torch.Tensor, float]:
        sl = slice(starts[j], starts[j] + sizes[j])
        return ((model(x[sl]) - y[sl]) ** 2).sum(), float(sizes[j])

    expected = _reference(_SharedBlocks(reentrant=False), loss_fn, 3)
    model = _SharedBlocks()
    acc = Accumulator(
        model, torch.optim.SGD(model.parameters(), lr=0.0), 3, noise_scale=True, noise_scale_ema=0
    )
    for _ in range(2):  # the second step: the meter knows which parameter fires per use
        for j in range(3):
            with acc.micro_step() as micro:
                acc.backward(*loss_fn(model, j))
        assert micro.result is not None
        assert micro.result.noise_scale == pytest.approx(expected, rel=1e-4)


def test_grad_scaler_unscales_before_the_norms() -> None:
    loss_fn = _token_loss([2, 3, 3])
    expected = _reference(linear_stack(), loss_fn, 3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    assert _measured(linear_stack(), loss_fn, 3, scaler=scaler) == pytest.approx(expected, rel=1e-4)


def test_none_when_undefined() -> None:
    loss_fn = _token_loss([4, 4])
    # one micro-step on one rank: no small/big pair
    assert _measured(linear_stack(), loss_fn, 1) is None
    # two micro-steps, one of them padding only (0 items): still one small batch
    ids, labels = token_batches(1, 4, seed=3)[0]
    model = linear_stack()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.0), 2, noise_scale=True)
    for masked in (False, True):
        with acc.micro_step() as micro:
            target = labels.masked_fill(torch.tensor(masked), -100)
            acc.backward(*cross_entropy_sum(logits_of(model, ids), target))
    assert micro.result is not None and micro.result.noise_scale is None
    # not asked for
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.0), 2)
    for j in range(2):
        with acc.micro_step() as micro:
            acc.backward(*loss_fn(model, j))
    assert micro.result is not None and micro.result.noise_scale is None
    assert acc.noise_scale is None


def test_discarded_micro_steps_leave_nothing_behind() -> None:
    loss_fn = _token_loss([3, 3])
    expected = _reference(linear_stack(), loss_fn, 2)
    model = linear_stack()
    acc = Accumulator(
        model, torch.optim.SGD(model.parameters(), lr=0.0), 2, noise_scale=True, noise_scale_ema=0
    )
    with pytest.raises(KeyError), acc.micro_step():
        acc.backward(*loss_fn(model, 0))
        raise KeyError("a failing micro-step after its backward")
    for j in range(2):
        with acc.micro_step() as micro:
            acc.backward(*loss_fn(model, j))
    assert micro.result is not None
    assert micro.result.noise_scale == pytest.approx(expected, rel=1e-4)


def test_bad_ema() -> None:
    model = linear_stack()
    with pytest.raises(ValueError, match="noise_scale_ema"):
        Accumulator(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            noise_scale=True,
            noise_scale_ema=1.0,
        )


# Linear regression y = x·w* + ε, x ~ N(0, diag(h)), ε ~ N(0, σ²), loss ½(x·w − y)² per
# sample, at a fixed w = w* + δ (lr 0). Per-sample gradient x(x·δ − ε): mean G = Hδ and, by
# Isserlis' theorem, E[(x·δ)² x xᵀ] = (δᵀHδ) H + 2 Hδδᵀ H, so
# Σ = (δᵀHδ + σ²) H + Hδ(Hδ)ᵀ and tr(Σ) = (δᵀHδ + σ²) tr(H) + |Hδ|²
# (benchmarks/noise_scale.py derives it in full).
DIM, SIGMA = 32, 1.0
_GEN = torch.Generator().manual_seed(0)
H = torch.linspace(0.5, 2.0, DIM)
W_STAR = torch.randn(DIM, generator=_GEN)
W0 = W_STAR + 0.3 * torch.randn(DIM, generator=_GEN)


def _truth() -> float:
    delta = W0 - W_STAR
    hd = H * delta
    trace = (float((delta * hd).sum()) + SIGMA**2) * float(H.sum()) + float((hd * hd).sum())
    return trace / float((hd * hd).sum())


def _regression(micro: int, k: int, steps: int, seed: int = 0) -> float | None:
    gen = torch.Generator().manual_seed(seed)
    model = nn.Linear(DIM, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(W0[None])
    acc = Accumulator(
        model,
        torch.optim.SGD(model.parameters(), lr=0.0),
        k,
        noise_scale=True,
        noise_scale_ema=0.998,
    )
    for _ in range(steps):
        for _ in range(k):
            x = torch.randn(micro, DIM, generator=gen) * H.sqrt()
            y = x @ W_STAR + SIGMA * torch.randn(micro, generator=gen)
            with acc.micro_step():
                acc.backward(0.5 * ((model(x).squeeze(1) - y) ** 2).sum(), micro)
    return acc.noise_scale


@pytest.mark.parametrize(("micro", "k"), [(1, 8), (2, 4), (4, 2), (16, 4)])
def test_linear_regression_matches_the_closed_form(micro: int, k: int) -> None:
    truth = _truth()
    assert 20 < truth < 40  # global batches of 8 and 64 straddle it
    measured = _regression(micro, k, steps=1500)
    assert measured is not None
    assert measured == pytest.approx(truth, rel=0.15), (measured, truth)


def test_estimate_terms_are_the_appendix_formulas_for_equal_batches() -> None:
    # McCandlish et al. appendix A with B_small = 4, B_big = 16.
    g_small_sq, g_big_sq, b, big = 3.0, 1.5, 4.0, 16.0
    trace, grad_sq = estimate_terms(4 * b * b * g_small_sq, 4 * b * b, big, math.sqrt(g_big_sq))
    assert grad_sq == pytest.approx((big * g_big_sq - b * g_small_sq) / (big - b))
    assert trace == pytest.approx((g_small_sq - g_big_sq) / (1 / b - 1 / big))
