"""Optimizers the dry run and the probe step where the real one is not at hand.

bitsandbytes (8-bit and paged AdamW) does not install on a CPU-only machine, and Lion is not in
torch: their memory behaviour is written here, state by state, as ``torch.optim.Optimizer``s.
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
