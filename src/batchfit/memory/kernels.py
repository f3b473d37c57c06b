"""Per-device kernel memory: make a CPU dry run allocate what CUDA's kernels allocate.

On CUDA, ``scaled_dot_product_attention`` runs the flash or memory-efficient kernel whenever the
inputs allow it (16-bit for flash, any float for memory-efficient; dropout, causal masks and GQA
included): forward keeps the output and an fp32 log-sum-exp per head and query, never the
``s x s`` scores. On CPU tensors the same call takes the math path when dropout is on (measured:
``_safe_softmax`` + ``bernoulli_``), storing the scores. So a CUDA estimate swaps in
:class:`FlashAttentionMemory`, which allocates and saves exactly what the CUDA kernels do:
forward: output (like q) + lse (fp32, b x heads x s); backward: dq, dk, dv plus flash-attention
v2's fp32 ``dq_accum`` (like q) and ``softmax_d`` (fp32, b x heads x s) workspaces
(aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F


class FlashAttentionMemory(torch.autograd.Function):
    """Memory behaviour of CUDA flash attention; values are not computed (dry runs only)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q, k, v, _out, _lse = ctx.saved_tensors
        dq_accum = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        softmax_d = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        del dq_accum, softmax_d
        return dq, dk, dv


def _cuda_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    result: torch.Tensor = FlashAttentionMemory.apply(query, key, value)
    return result


@contextlib.contextmanager
def cuda_kernels() -> Iterator[None]:
    """Within the block, SDPA allocates as CUDA's flash / memory-efficient kernels do."""
    original = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = _cuda_sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original
