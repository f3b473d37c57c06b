"""Optimizers for the dry run: torch's own, HF Adafactor, and emulations of missing ones.

bitsandbytes (8-bit and paged AdamW) does not install on a CPU-only machine, and Lion is not in
torch: their memory behaviour is emulated here, state by state.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

# bitsandbytes Optimizer8bit: blockwise uint8 states, fp32 absmax per 256 elements; tensors under
# min_8bit_size = 4096 elements keep fp32 states (bnb/optim/optimizer.py, init_state).
_BNB_BLOCK = 256
_BNB_MIN_8BIT_SIZE = 4096


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
                    if n >= _BNB_MIN_8BIT_SIZE:
                        blocks = math.ceil(n / _BNB_BLOCK)
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


def make_optimizer(
    name: str, params: list[torch.nn.Parameter], impl: str, emulate_cuda: bool
) -> torch.optim.Optimizer:
    """The optimizer a user would create for ``--optimizer name --optimizer-impl impl``."""
    kwargs: dict[str, Any] = {}
    if name in ("sgd", "sgd-momentum", "adam", "adamw"):
        if impl == "auto":
            # torch picks foreach for CUDA tensors and the per-parameter loop on the CPU.
            impl = "foreach" if emulate_cuda else "for-loop"
        kwargs = {"fused": True} if impl == "fused" else {"foreach": impl == "foreach"}
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-3, **kwargs)
    if name == "sgd-momentum":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9, **kwargs)
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-4, **kwargs)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-4, **kwargs)
    if name in ("adamw-8bit", "paged-adamw-8bit"):
        return EmulatedAdamW8bit(params, lr=1e-4)
    if name == "lion":
        return Lion(params, lr=1e-4)
    if name == "adafactor":
        # lazy: transformers (~1 s), only for Adafactor
        from transformers.optimization import Adafactor

        return Adafactor(  # type: ignore[no-untyped-call, unused-ignore]
            params, lr=1e-3, relative_step=False, scale_parameter=False, warmup_init=False
        )
    raise ValueError(f"unknown optimizer {name!r}")
