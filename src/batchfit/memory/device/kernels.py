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
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

# The functions a mode intercepts; never reassigned, so user code always sees torch's own.
_ORIGINAL_SDPA = F.scaled_dot_product_attention
_ORIGINAL_DROPOUT = F.dropout


# Who counts the attention kernels' FLOPs (the dry run's tracker, while it runs): the kernels
# below allocate what flash attention allocates, so no attention operator reaches the
# dispatcher for torch's FLOP formulas to count.
FLOP_SINKS: list[Callable[[float], None]] = []


def _attention_flops(q: torch.Tensor, k: torch.Tensor, matmuls: int, causal: bool) -> None:
    """Report ``matmuls`` products of the query and key lengths over the head dimension, 2
    FLOPs a multiply-add: forward 2 (scores, then the values), backward 5 (the scores again,
    the values' and the probabilities' gradients, the query's and the key's); half of them
    under a causal mask, whose masked blocks the kernels skip."""
    if FLOP_SINKS and q.dim() >= 2:
        *lead, s_q, d = q.shape
        batch_heads = math.prod(int(n) for n in lead)
        full = 2.0 * matmuls * batch_heads * int(s_q) * int(k.shape[-2]) * int(d)
        FLOP_SINKS[-1](full / 2 if causal else full)


class FlashAttentionMemory(torch.autograd.Function):
    """Memory behaviour of CUDA flash attention; values are not computed (dry runs only)."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        bias: torch.Tensor | None = None,
        causal: bool = False,
    ) -> torch.Tensor:
        ctx.causal = causal
        out = torch.empty_like(q)
        if q.dim() == 4:
            # Both kernels run on (batch, seq, heads, dim) memory and hand back its transpose
            # (sdp_utils: ``query.transpose(1, 2)`` in, ``output.transpose(1, 2)`` out), so the
            # model's ``attn_output.transpose(1, 2).contiguous()`` copies nothing (measured,
            # H100: the output projection saves the kernel's output itself).
            b, h, s, d = q.shape
            out = torch.empty((b, s, h, d), dtype=q.dtype, device=q.device).transpose(1, 2)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        # the memory-efficient kernel keeps its attention bias for backward too
        ctx.save_for_backward(q, k, v, out, lse, bias)
        _attention_flops(q, k, 2, causal)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, _out, _lse, _bias = ctx.saved_tensors
        dq_accum = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        softmax_d = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        del dq_accum, softmax_d
        _attention_flops(q, k, 5, ctx.causal)
        return dq, dk, dv, None, None


def _attention_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The bias the memory-efficient kernel (flash takes no mask) runs with, as
    aten/src/ATen/native/transformers/attention.cpp makes it: a bool mask
    becomes an additive one in the query's dtype (``convert_boolean_attn_mask``: a new tensor
    of the mask's shape, per call), and a bias whose last dimension is not a multiple of 16 is
    padded (``preprocess_mask`` / ``pad_bias``). Measured on an H100: ModernBERT's 14
    sliding-window layers at 16 x 2048 kept a 128 MiB bf16 bias each."""
    bias = mask
    if mask.dtype == torch.bool:
        bias = torch.empty(mask.shape, dtype=dtype, device=mask.device)
    last = int(bias.shape[-1])
    if last % 16:
        padded = torch.empty((*bias.shape[:-1], -(-last // 16) * 16), dtype=bias.dtype)
        bias = padded[..., :last]
    return bias


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
    if torch.is_autocast_enabled("cpu"):
        # CUDA autocast runs SDPA in the 16-bit dtype (``lower_precision_fp`` in
        # aten/src/ATen/autocast_mode.cpp): fp32 inputs (Qwen3's q/k norms multiply a 16-bit
        # projection by an fp32 weight) are cast, and the kernel saves the 16-bit copies.
        dtype = torch.get_autocast_dtype("cpu")
        query, key, value = (
            t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t
            for t in (query, key, value)
        )
        if attn_mask is not None and attn_mask.is_floating_point():
            attn_mask = attn_mask.to(dtype)
    bias = None if attn_mask is None else _attention_bias(attn_mask, query.dtype)
    result: torch.Tensor = FlashAttentionMemory.apply(query, key, value, bias, is_causal)  # type: ignore[no-untyped-call, unused-ignore]
    return result


def _cuda_dropout(
    input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False
) -> torch.Tensor:
    """CUDA's dropout: ``native_dropout`` (aten/src/ATen/native/Dropout.cpp,
    ``is_fused_kernel_acceptable``: a CUDA input and 0 < p < 1), which saves a bool mask, one
    byte an element. The CPU's takes ``input * mask`` with a mask in the input's dtype (four
    bytes an element in fp32): measured on an H100, OPT-1.3b fp32 held 48 MiB a layer less
    than a CPU-kernel dry run."""
    if not training or not 0.0 < p < 1.0 or input.numel() == 0:
        return _ORIGINAL_DROPOUT(input, p, training, inplace)
    output: torch.Tensor = torch.native_dropout(input, p, True)[0]
    return output


# Ops CUDA autocast runs in fp32 that CPU autocast leaves in the input's 16-bit dtype
# (aten/src/ATen/autocast_mode.cpp: the CUDA `fp32` and `fp32_set_opt_dtype` lists minus the
# CPU `fp32` list). Transformer code hits pow / rsqrt / exp (GELU, norms), softmax, layer_norm
# and sum; outputs in fp32 then flow on in fp32, so the saved tensors double in size.
_CUDA_ONLY_FP32 = frozenset(
    {
        "pow",
        "__pow__",
        "__rpow__",
        "rsqrt",
        "exp",
        "expm1",
        "log",
        "log2",
        "log10",
        "log1p",
        "reciprocal",
        "acos",
        "asin",
        "cosh",
        "sinh",
        "tan",
        "erfinv",
        "softplus",
        "softmax",
        "log_softmax",
        "layer_norm",
        "group_norm",
        "sum",
        "cumsum",
        "cumprod",
        "prod",
        "logsumexp",
        "renorm",
        "cosine_similarity",
        "cdist",
        "dist",
        "norm",
    }
)


def _upcast(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.dtype in (torch.float16, torch.bfloat16):
        return value.float()
    if isinstance(value, (list, tuple)):
        return type(value)(_upcast(v) for v in value)
    return value


class _CudaEmulation(torch.overrides.TorchFunctionMode):
    """CUDA's SDPA kernels and autocast policy, as a torch-function mode above autograd.

    A mode acts only while it is entered, on this thread, and is popped when its block exits
    however it exits: nothing outside the block (the user's ``model_fn``, a notebook after an
    exception) sees a patched ``F.scaled_dot_product_attention``. Casting here (not at the
    dispatch level) records the cast in autograd, so what backward saves is the fp32 copy, as
    under CUDA autocast.
    """

    def __init__(self, *, kernels: bool, autocast_policy: bool) -> None:
        super().__init__()
        self.kernels = kernels
        self.autocast_policy = autocast_policy

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.kernels and func is _ORIGINAL_SDPA:
            return _cuda_sdpa(*args, **kwargs)
        if self.kernels and func is _ORIGINAL_DROPOUT:
            return _cuda_dropout(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if self.autocast_policy and torch.is_autocast_enabled("cpu") and name in _CUDA_ONLY_FP32:
            args = _upcast(args)
            if name in ("softmax", "log_softmax", "sum", "cumsum", "cumprod", "prod"):
                kwargs = {**kwargs, "dtype": kwargs.get("dtype") or torch.float32}
        return func(*args, **kwargs)


def cuda_kernels() -> contextlib.AbstractContextManager[Any]:
    """Within the block, SDPA allocates as CUDA's flash / memory-efficient kernels do."""
    return _CudaEmulation(kernels=True, autocast_policy=False)


def cuda_autocast_policy() -> contextlib.AbstractContextManager[Any]:
    """Within the block, CUDA's kernels, and CPU autocast also upcasts what CUDA's runs in fp32.

    Torch-function modes are not active while backward recomputes a checkpointed layer, so the
    recompute enters this (``context_fn``): it brings the SDPA kernels too, as the forward had.
    """
    return _CudaEmulation(kernels=True, autocast_policy=True)


def emulation(emulate_cuda: bool) -> contextlib.AbstractContextManager[Any]:
    """CUDA's kernels and autocast policy for a dry run that stands for a CUDA run.

    Nothing happens until the block is entered, and nothing is left when it exits.

    Example:
        >>> kernels = emulation(True)  # not entered yet: SDPA is torch's own
        >>> F.scaled_dot_product_attention is _ORIGINAL_SDPA
        True
    """
    if emulate_cuda:
        return cuda_autocast_policy()
    return contextlib.nullcontext()
