"""The gradient noise scale B_simple = tr(Σ) / |G|², measured inside ``Accumulator``.

McCandlish et al. 2018, "An Empirical Model of Large-Batch Training", appendix A: the mean
gradient of a batch of B independent items has E|G_B|² = |G|² + tr(Σ)/B, where G is the true
gradient and Σ the covariance of one item's gradient. A step that sees the gradient of each
micro-batch (small batches) and of their sum (the big batch) can solve the two equations for
|G|² and tr(Σ) without bias. ``Accumulator`` has both for free: a hook on each parameter sees
the gradient of one micro-batch before it is added into ``.grad``, and the step computes the
global gradient norm anyway (for clipping and ``StepResult.grad_norm``).

Unequal micro-batches (the appendix assumes equal ones). Let micro-batch m (on any rank) hold
b_m items and g_m be the gradient of its loss *sum* (what the hook sees, up to a GradScaler's
scale), B = Σ b_m and g = Σ g_m = B·G_big. For independent items E|g_m|² = b_m²|G|² + b_m tr(Σ)
and E|g|² = B²|G|² + B tr(Σ). With P = Σ b_m² and S = Σ |g_m|²:

    |G|²   ≈ (|g|² − S) / (B² − P)            (= 2 Σ_{m<n} g_m·g_n / Σ_{m≠n} b_m b_n)
    tr(Σ)  ≈ B (S − P |G_big|²) / (B² − P)

both unbiased for any split. They are the appendix's estimators with B_small = P/B (the
item-weighted mean micro-batch size) and |G_small|² = S/P (each micro-batch's |G_m|² weighted
by b_m²): for equal micro-batches of b items, B_small = b and |G_small|² is the plain mean, so
the formulas reduce to the appendix's exactly. The weighting is unbiased, not minimum-variance.
A micro-batch with 0 items (padding that keeps ranks in step) adds nothing. With a single
micro-batch holding items (one micro-step on one rank), B² = P and nothing can be estimated.

Units: B, b_m are ``num_items`` (tokens, samples or weight sums: what the caller counts), so
B_simple is in that unit. Per-step estimates are noisy (either may be negative): the two are
smoothed separately by an exponential moving average (factor ``ema``, 0.95 by default: about
the last 20 steps) and B_simple is their ratio (the appendix's advice: average numerator and
denominator separately, not the ratio).
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from batchfit.train import _fsdp

logger = logging.getLogger(__name__)

# About the last 1 / (1 - 0.95) = 20 optimizer steps.
DEFAULT_EMA = 0.95


def estimate_terms(
    small_sq_sum: float, items_sq_sum: float, items: float, big_norm: float
) -> tuple[float, float] | None:
    """Unbiased (tr(Σ), |G|²) of one step, or None when the split gives no small/big pair.

    Args:
        small_sq_sum: S = Σ_m |g_m|²: squared norms of the micro-batches' loss-sum gradients.
        items_sq_sum: P = Σ_m b_m².
        items: B = Σ_m b_m, the global batch's items.
        big_norm: |G_big|, the norm of the global batch's mean gradient.

    Example:
        >>> # two micro-batches of 1 item: gradients 1 and 3 -> mean 2, tr(Σ) = (1-3)²/2
        >>> estimate_terms(1.0 + 9.0, 2.0, 2.0, 2.0)
        (2.0, 3.0)
    """
    spread = items * items - items_sq_sum  # Σ_{m≠n} b_m b_n
    if not spread > 1e-9 * items * items:
        return None
    big_sum_sq = (items * big_norm) ** 2  # |g|², the global loss-sum gradient
    grad_sq = (big_sum_sq - small_sq_sum) / spread  # McCandlish et al. 2018, eq. A.2
    trace = items * (small_sq_sum - items_sq_sum * big_norm**2) / spread  # eq. A.3
    return trace, grad_sq


class NoiseScaleMeter:
    """Squared norms of each micro-batch's gradient, from hooks; B_simple from a step's sums.

    Hooks go on the parameters the optimizer steps (under FSDP2 on their unsharded
    counterparts, where each micro-step's local gradient arrives before any reduce-scatter;
    under DDP the hook runs before DDP's reducer sees the gradient). Each hook adds one fp32
    ``vector_norm`` of the incoming gradient to a list; the micro-step's end sums their
    squares into one fp32 tensor on the device: no copy of a gradient and no host sync until
    the step's all-reduce, which already runs.

    A parameter used twice in one forward (tied embeddings) fires its hook once, with the
    summed gradient, since autograd adds the two contributions before accumulating. Reentrant
    activation checkpointing (``use_reentrant=True``) instead runs a separate backward per
    checkpointed segment, so a parameter shared by segments fires once per use. |a+b|² needs
    the cross term 2a·b: when the parameter had no gradient before the micro-step, the earlier
    uses' sum is ``param.grad`` itself; otherwise the meter keeps references to this
    micro-step's incoming gradients of such parameters (found in an earlier micro-step) until
    the micro-step ends. A parameter first found firing twice when neither holds voids that
    step's estimate (logged); later micro-steps are exact.
    """

    def __init__(
        self, model: torch.nn.Module, params: Iterable[torch.nn.Parameter], ema: float
    ) -> None:
        if not 0 <= ema < 1:
            raise ValueError(
                f"noise_scale_ema must be in [0, 1), got {ema!r}: the weight of the past in "
                f"the running average (default {DEFAULT_EMA})"
            )
        self.ema = ema
        self._handles: list[RemovableHandle] = []
        self._params: list[torch.nn.Parameter] = []
        self._active = False
        self._norms: list[torch.Tensor] = []
        self._cross: list[torch.Tensor] = []
        self._fired: dict[int, bool] = {}  # slot -> had no .grad before this micro-step
        self._held: dict[int, list[torch.Tensor]] = {}  # reused slots' incoming gradients
        self._reused: set[int] = set()  # slots that fire more than once per backward
        self._exact = True
        self._sq_sum: torch.Tensor | None = None
        self._items_sq_float = 0.0
        self._items_sq: list[torch.Tensor] = []
        self._trace_avg = 0.0
        self._grad_sq_avg = 0.0
        self._updates = 0
        tracked = [p for p in params if p.requires_grad]
        fsdp = _fsdp.root_of(model)
        if fsdp is None:
            for p in tracked:
                self._hook(p)
        else:
            self._hook_fsdp(fsdp, {id(p) for p in tracked})

    def _hook(self, param: torch.nn.Parameter) -> None:
        slot = len(self._params)
        self._params.append(param)
        hook = functools.partial(self._on_grad, slot)
        self._handles.append(param.register_hook(hook))  # type: ignore[no-untyped-call]

    def _hook_fsdp(self, root: Any, tracked: set[int]) -> None:
        """FSDP2 creates each unsharded parameter at its first all-gather and keeps it: hook it
        after the module's own pre-forward (which all-gathers) has run once."""
        hooked: set[int] = set()
        handles: dict[int, RemovableHandle] = {}

        def pre_forward(module: torch.nn.Module, args: Any) -> None:
            pending = False
            for sharded, unsharded in _fsdp.unsharded_params(module):
                if id(sharded) not in tracked or id(sharded) in hooked:
                    continue
                if unsharded is None:
                    pending = True
                    continue
                hooked.add(id(sharded))
                self._hook(unsharded)
            if not pending:
                handles.pop(id(module)).remove()

        for module in _fsdp.modules_of(root):
            handles[id(module)] = module.register_forward_pre_hook(pre_forward)
            self._handles.append(handles[id(module)])

    def close(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    @property
    def value(self) -> float | None:
        """The smoothed B_simple; None before a step could estimate it, or while the smoothed
        |G|² is not positive (the noise hides the mean gradient: B_simple is unknown)."""
        if not self._updates or not self._grad_sq_avg > 0:
            return None
        return max(0.0, self._trace_avg / self._grad_sq_avg)

    def counting(self) -> _Counting:
        """Context for one micro-step's backward: hooks count only inside it."""
        return _Counting(self)

    def end_micro_step(self, items: float | torch.Tensor) -> None:
        """Fold the micro-step's squared norms into the step's sum; count its b²."""
        terms = [_sum_squares(self._norms), *self._cross]
        micro = terms[0]
        for term in terms[1:]:
            micro = micro + term.to(micro.device)
        self._sq_sum = micro if self._sq_sum is None else self._sq_sum + micro
        self._norms, self._cross, self._fired, self._held = [], [], {}, {}
        if isinstance(items, torch.Tensor):
            self._items_sq.append(items)
        else:
            self._items_sq_float += items * items

    def local_sums(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """[S, P] of this rank's micro-steps, to sum over the ranks with the step's counts."""
        sq = torch.zeros((), device=device, dtype=dtype)
        if self._sq_sum is not None:
            sq = self._sq_sum.to(device=device, dtype=dtype)
        p = torch.tensor(self._items_sq_float, device=device, dtype=dtype)
        if self._items_sq:
            counts = torch.cat(
                [c.reshape(1).to(device=device, dtype=dtype) for c in self._items_sq]
            )
            p = p + (counts * counts).sum()
        return torch.stack([sq, p])

    def update(
        self, small_sq_sum: float, items_sq_sum: float, items: float, big_norm: float
    ) -> float | None:
        """Fold one step's (summed over ranks, unscaled) sums into the averages; B_simple."""
        exact = self._exact
        self._exact = True
        if not exact or not (math.isfinite(small_sq_sum) and math.isfinite(big_norm)):
            return self.value
        terms = estimate_terms(small_sq_sum, items_sq_sum, items, big_norm)
        if terms is None:
            return self.value
        trace, grad_sq = terms
        self._trace_avg = self.ema * self._trace_avg + (1 - self.ema) * trace
        self._grad_sq_avg = self.ema * self._grad_sq_avg + (1 - self.ema) * grad_sq
        self._updates += 1
        return self.value

    def reset_step(self) -> None:
        """Drop the current step's sums (a finished or abandoned global step)."""
        self._norms, self._cross, self._fired, self._held = [], [], {}, {}
        self._sq_sum = None
        self._items_sq_float = 0.0
        self._items_sq = []

    def _on_grad(self, slot: int, grad: torch.Tensor) -> None:
        if not self._active:
            return
        self._norms.append(torch.linalg.vector_norm(grad, dtype=torch.float32))
        if slot in self._fired:
            self._fired_again(slot, grad)
            return
        was_none = self._params[slot].grad is None
        self._fired[slot] = was_none
        if slot in self._reused and not was_none:
            self._held.setdefault(slot, []).append(grad)

    def _fired_again(self, slot: int, grad: torch.Tensor) -> None:
        """A second use in this backward (reentrant checkpointing): add 2 (earlier uses)·grad."""
        flat = grad.reshape(-1).float()
        earlier_sum = self._params[slot].grad
        if self._fired[slot] and earlier_sum is not None:
            self._cross.append(2 * torch.dot(earlier_sum.reshape(-1).float(), flat))
        elif slot in self._reused:
            held = self._held.setdefault(slot, [])
            for earlier in held:
                self._cross.append(2 * torch.dot(earlier.reshape(-1).float(), flat))
            held.append(grad)
        else:
            self._exact = False
            logger.info(
                "a parameter's gradient hook fired twice in one backward (reentrant "
                "checkpointing?): this step's noise scale is skipped, later ones are exact"
            )
        self._reused.add(slot)


class _Counting:
    def __init__(self, meter: NoiseScaleMeter) -> None:
        self._meter = meter

    def __enter__(self) -> None:
        self._meter._active = True

    def __exit__(self, *exc: object) -> None:
        self._meter._active = False


def _sum_squares(norms: list[torch.Tensor]) -> torch.Tensor:
    """Σ norm², in fp32, on the first norm's device (one stack per device)."""
    if not norms:
        return torch.zeros((), dtype=torch.float32)
    device = norms[0].device
    if all(n.device == device for n in norms):
        return torch.stack(norms).square().sum()
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for n in norms:
        by_device.setdefault(n.device, []).append(n)
    total = torch.zeros((), dtype=torch.float32, device=device)
    for same in by_device.values():
        total = total + torch.stack(same).square().sum().to(device)
    return total
