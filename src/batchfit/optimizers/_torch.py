"""Optimizers the dry run and the probe step where the real one is not at hand.

bitsandbytes (8-bit and paged AdamW) does not install on a CPU-only machine, and Lion, Adan and
SophiaG are not in torch: their memory behaviour is written here, state by state, as
``torch.optim.Optimizer``s.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from batchfit.optimizers.base import BNB_BLOCK, BNB_MIN_8BIT_SIZE


class EmulatedAdamW8bit(torch.optim.Optimizer):
    """Allocates what bitsandbytes' AdamW8bit allocates; its fused kernel makes no temporaries."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    n = p.numel()
                    if n >= BNB_MIN_8BIT_SIZE:
                        blocks = math.ceil(n / BNB_BLOCK)
                        state["state1"] = torch.zeros_like(p, dtype=torch.uint8)
                        state["state2"] = torch.zeros_like(p, dtype=torch.uint8)
                        state["absmax1"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
                        state["absmax2"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
                    else:
                        state["state1"] = torch.zeros_like(p, dtype=torch.float32)
                        state["state2"] = torch.zeros_like(p, dtype=torch.float32)
                p.add_(p.grad, alpha=-group["lr"])  # stands in for the in-place fused kernel


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023) as lion-pytorch writes it: one momentum, one update at a time."""

    def __init__(
        self, params: Iterable[Any], lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99)
    ) -> None:
        super().__init__(params, {"lr": lr, "betas": betas})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                exp_avg = state["exp_avg"]
                update = exp_avg.clone().mul_(beta1).add_(p.grad, alpha=1 - beta1).sign_()
                p.add_(update, alpha=-group["lr"])
                exp_avg.mul_(beta2).add_(p.grad, alpha=1 - beta2)


class Adan(torch.optim.Optimizer):
    """Adan (Xie et al. 2022) as sail-sg/Adan's adan.py writes it (``max_grad_norm=0``,
    ``no_prox=False``): three moments and the negated previous gradient per parameter, the
    multi-tensor step (``foreach=True``, its default) or the per-parameter loop."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float, float] = (0.98, 0.92, 0.99),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        foreach: bool = True,
    ) -> None:
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "foreach": foreach,
        }
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            beta1, beta2, beta3 = group["betas"]
            group["step"] = group.get("step", 0) + 1
            params: list[torch.Tensor] = []
            grads: list[torch.Tensor] = []
            exp_avgs: list[torch.Tensor] = []
            exp_avg_sqs: list[torch.Tensor] = []
            exp_avg_diffs: list[torch.Tensor] = []
            neg_pre_grads: list[torch.Tensor] = []
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                    state["exp_avg_diff"] = torch.zeros_like(p)
                if "neg_pre_grad" not in state or group["step"] == 1:
                    # clip_global_grad_norm is 1.0 without max_grad_norm
                    state["neg_pre_grad"] = p.grad.clone().mul_(-1.0)
                params.append(p)
                grads.append(p.grad)
                exp_avgs.append(state["exp_avg"])
                exp_avg_sqs.append(state["exp_avg_sq"])
                exp_avg_diffs.append(state["exp_avg_diff"])
                neg_pre_grads.append(state["neg_pre_grad"])
            if not params:
                continue
            step = group["step"]
            lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
            bias3_sqrt = math.sqrt(1.0 - beta3**step)
            step_size = lr / (1.0 - beta1**step)
            step_size_diff = lr * beta2 / (1.0 - beta2**step)
            if group["foreach"]:  # _multi_tensor_adan
                torch._foreach_mul_(grads, 1.0)
                torch._foreach_add_(neg_pre_grads, grads)
                torch._foreach_mul_(exp_avgs, beta1)
                torch._foreach_add_(exp_avgs, grads, alpha=1 - beta1)
                torch._foreach_mul_(exp_avg_diffs, beta2)
                torch._foreach_add_(exp_avg_diffs, neg_pre_grads, alpha=1 - beta2)
                torch._foreach_mul_(neg_pre_grads, beta2)
                torch._foreach_add_(neg_pre_grads, grads)
                torch._foreach_mul_(exp_avg_sqs, beta3)
                torch._foreach_addcmul_(exp_avg_sqs, neg_pre_grads, neg_pre_grads, value=1 - beta3)
                denoms = torch._foreach_sqrt(exp_avg_sqs)  # every parameter's at once
                torch._foreach_div_(denoms, bias3_sqrt)
                torch._foreach_add_(denoms, eps)
                torch._foreach_addcdiv_(params, exp_avgs, denoms, value=-step_size)
                torch._foreach_addcdiv_(params, exp_avg_diffs, denoms, value=-step_size_diff)
                torch._foreach_div_(params, 1 + lr * decay)
                torch._foreach_zero_(neg_pre_grads)
                torch._foreach_add_(neg_pre_grads, grads, alpha=-1.0)
                continue
            for i, p in enumerate(params):  # _single_tensor_adan
                grad, neg = grads[i], neg_pre_grads[i]
                grad.mul_(1.0)
                neg.add_(grad)
                exp_avgs[i].mul_(beta1).add_(grad, alpha=1 - beta1)
                exp_avg_diffs[i].mul_(beta2).add_(neg, alpha=1 - beta2)
                neg.mul_(beta2).add_(grad)
                exp_avg_sqs[i].mul_(beta3).addcmul_(neg, neg, value=1 - beta3)
                denom = (exp_avg_sqs[i].sqrt() / bias3_sqrt).add_(eps)
                p.addcdiv_(exp_avgs[i], denom, value=-step_size)
                p.addcdiv_(exp_avg_diffs[i], denom, value=-step_size_diff)
                p.div_(1 + lr * decay)
                neg.zero_().add_(grad, alpha=-1.0)


class SophiaG(torch.optim.Optimizer):
    """SophiaG (Liu et al. 2023) as the reference ``sophia.py`` writes it (``capturable`` off):
    a momentum ``exp_avg`` and a diagonal Hessian estimate ``hessian`` per parameter, and a
    per-parameter loop whose update is ``sign(m) * min(|m| / (rho * bs * h + 1e-15), 1)``.

    The training loop refreshes ``hessian`` every k steps: a backward on labels sampled from the
    model's own logits, then ``update_hessian()``. ``step(bs=...)`` takes the batch in tokens
    (5120 by default), which scales the Hessian estimate in the clipping threshold.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.965, 0.99),
        rho: float = 0.04,
        weight_decay: float = 1e-1,
    ) -> None:
        defaults = {"lr": lr, "betas": betas, "rho": rho, "weight_decay": weight_decay}
        super().__init__(params, defaults)

    def _state(self, p: torch.Tensor) -> dict[str, Any]:
        state: dict[str, Any] = self.state[p]
        if not state:  # a CPU step counter, then the two buffers in the parameter's dtype
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["hessian"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def update_hessian(self) -> None:
        """Fold the squared gradients now in ``p.grad`` into the Hessian estimate, in place."""
        for group in self.param_groups:
            beta2 = group["betas"][1]
            for p in group["params"]:
                if p.grad is not None:
                    hess = self._state(p)["hessian"]
                    hess.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)

    @torch.no_grad()
    def step(self, closure: Any = None, bs: int = 5120) -> None:  # type: ignore[override]
        for group in self.param_groups:
            beta1 = group["betas"][0]
            lr, rho, decay = group["lr"], group["rho"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self._state(p)
                exp_avg, hess = state["exp_avg"], state["hessian"]
                state["step"] += 1
                p.mul_(1 - lr * decay)  # decoupled weight decay
                exp_avg.mul_(beta1).add_(p.grad, alpha=1 - beta1)
                # |m| and rho * bs * h + eps are alive at once, as in the reference's expression;
                # the clipped ratio stays bound until the next parameter's replaces it
                ratio = (exp_avg.abs() / (rho * bs * hess + 1e-15)).clamp(None, 1)
                p.addcmul_(exp_avg.sign(), ratio, value=-lr)
