"""bitsandbytes' 4-bit linear layer (QLoRA) as its memory sees it, for dry runs and CPU steps.

What is emulated (bitsandbytes need not be installed, and its CUDA kernels cannot run here):

- storage (``Params4bit`` with ``quant_storage=uint8``, or a 16-bit dtype under FSDP as the
  FSDP-QLoRA recipes set it): the NF4 codes packed two per byte, ``(n + 1) // 2`` bytes for
  ``n`` weights; with double quantisation (``bnb_4bit_use_double_quant``,
  batchfit's export sets it) each 64-weight block's absmax is itself quantised to 8 bits, with an
  fp32 absmax per 256 blocks and a 256-entry fp32 code (``functional.quantize_4bit``,
  ``compress_statistics=True``, ``blocksize=64``; the nested blocksize is 256);
- ``MatMul4Bit`` (``autograd/_functions.py``): forward dequantises the whole weight to the
  compute dtype (a transient of ``out x in`` 16-bit values) and runs ``F.linear``; it saves the
  packed weight, not the input (the frozen weight needs no gradient); backward dequantises again
  for the input's gradient;
- ``Linear4bit.forward``: the input cast to the compute dtype, the output back to the
  input's dtype (an fp32 input, after peft's ``prepare_model_for_kbit_training``, gives an
  fp32 output; ``upcast_unquantised`` emulates that preparation);
- peft's LoRA wrapper of a 4-bit layer clones the base layer's output before adding the
  adapter's (``tuners/lora/bnb.py``: "for 4bit, we need to defensively clone here").

The values are not NF4: a dequantised weight is drawn at random in place (nothing but the weight
is allocated), so a real CPU step with these layers measures memory, not what a model learns.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

NF4_BLOCK = 64  # bitsandbytes' default 4-bit blocksize
NESTED_BLOCK = 256  # double quantisation: absmax values per fp32 absmax
# Output heads transformers' quantizer leaves in 16-bit (get_keys_to_not_convert: the last
# module of the model, besides the tied output embeddings).
HEAD_NAMES = frozenset({"lm_head", "score", "classifier", "qa_outputs"})


class _MatMul4Bit(torch.autograd.Function):
    """``x @ dequantize(W).t()``: the 16-bit weight exists only while it is used."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, packed: torch.Tensor, shape: tuple[int, int], dtype: torch.dtype
    ) -> torch.Tensor:
        weight = _dequantize(packed, shape, dtype)
        out = F.linear(x, weight.to(x.dtype))
        ctx.save_for_backward(packed)
        ctx.shape, ctx.dtype = shape, dtype
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        (packed,) = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        weight = _dequantize(packed, ctx.shape, ctx.dtype)
        return grad @ weight.to(grad.dtype), None, None, None


def _dequantize(packed: torch.Tensor, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """The layer's weight in ``dtype``: one allocation, as bitsandbytes' kernel makes it."""
    weight = torch.empty(shape, dtype=dtype, device=packed.device)
    return weight.normal_(0.0, 0.02)


class Linear4bit(torch.nn.Linear):
    """A frozen ``nn.Linear`` stored as bitsandbytes stores it for QLoRA (see the module).

    It stays an ``nn.Linear`` so peft wraps it with LoRA as it wraps bitsandbytes' layer.
    """

    def __init__(
        self, linear: torch.nn.Linear, compute_dtype: torch.dtype, storage: torch.dtype
    ) -> None:
        torch.nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        device = linear.weight.device
        n = self.in_features * self.out_features
        blocks = math.ceil(n / NF4_BLOCK)
        # the packed bytes as ``storage`` elements (bnb_4bit_quant_storage)
        elements = math.ceil((n + 1) // 2 / storage.itemsize)
        packed = torch.empty((elements, 1), dtype=storage, device=device)
        self.weight = torch.nn.Parameter(packed, requires_grad=False)
        self.bias = linear.bias
        if self.bias is not None:
            self.bias.requires_grad_(False)
        # the quantisation state: 8-bit absmax per block, fp32 absmax per 256 of them, the
        # nested 256-entry code and the 16 NF4 values
        self.register_buffer("absmax", torch.empty(blocks, dtype=torch.uint8, device=device))
        nested = math.ceil(blocks / NESTED_BLOCK)
        self.register_buffer("absmax2", torch.empty(nested, dtype=torch.float32, device=device))
        self.register_buffer("code", torch.empty(NESTED_BLOCK, dtype=torch.float32, device=device))
        self.register_buffer("nf4", torch.empty(16, dtype=torch.float32, device=device))
        self.compute_dtype = compute_dtype
        self.clones_output = False  # set where peft's LoRA wraps the layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # bitsandbytes 95f9af30 nn/modules.py:626-637: the input cast to the compute dtype, the
        # bias cast (in place) to it, the output cast back to the input's dtype
        inp_dtype = x.dtype
        x = x.to(self.compute_dtype)
        shape = (self.out_features, self.in_features)
        out = _MatMul4Bit.apply(x, self.weight, shape, self.compute_dtype)  # type: ignore[no-untyped-call]
        if self.bias is not None:
            if self.bias.dtype != self.compute_dtype:
                self.bias.data = self.bias.data.to(self.compute_dtype)
            out = out + self.bias.to(out.dtype)
        out = out.to(inp_dtype)
        return out.clone() if self.clones_output else out  # type: ignore[no-any-return]


def quantize_linears(
    net: torch.nn.Module,
    compute_dtype: torch.dtype,
    *,
    with_head: bool = False,
    storage: torch.dtype = torch.uint8,
) -> int:
    """Replace every ``nn.Linear`` of ``net`` but its output head with :class:`Linear4bit`
    (transformers' bitsandbytes quantizer skips the head; ``with_head``: Lightning's plugin
    does not, unless the head is tied to the embeddings); returns how many were replaced.
    ``storage``: the dtype the packed codes are stored as (bnb_4bit_quant_storage; a 16-bit
    one under FSDP, which flattens floating-point parameters only)."""
    get_head = getattr(net, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    get_embeddings = getattr(net, "get_input_embeddings", None)
    embeddings = get_embeddings() if callable(get_embeddings) else None
    tied = head is not None and getattr(embeddings, "weight", None) is head.weight
    # modules the model keeps in fp32 (T5's ``wo``): transformers' 4-bit quantizer leaves them
    # unquantised (quantizers/quantizer_bnb_4bit.py, _keep_in_fp32_modules among the skipped)
    kept = set(getattr(net, "_keep_in_fp32_modules", None) or ())
    replaced = 0
    for parent in list(net.modules()):
        for name, child in list(parent.named_children()):
            if (name in HEAD_NAMES or child is head) and (tied or not with_head):
                continue
            if name in kept:
                continue
            if type(child) is torch.nn.Linear:
                setattr(parent, name, Linear4bit(child, compute_dtype, storage))
                replaced += 1
            elif type(child).__name__ == "Conv1D" and getattr(child, "weight", None) is not None:
                # GPT-2's transposed linear: transformers' quantizer converts it too
                # (integrations/bitsandbytes.py, replace_with_bnb_linear: nn.Linear or Conv1D)
                weight: torch.Tensor = child.weight  # type: ignore[assignment]
                in_features, out_features = weight.shape
                shell = torch.nn.Linear(in_features, out_features, bias=False, device="meta")
                shell.bias = child.bias  # type: ignore[assignment]
                layer = Linear4bit(shell, compute_dtype, storage)
                layer.weight = torch.nn.Parameter(
                    torch.empty_like(layer.weight, device=weight.device), requires_grad=False
                )
                for buffer in ("absmax", "absmax2", "code", "nf4"):
                    old = getattr(layer, buffer)
                    setattr(layer, buffer, torch.empty_like(old, device=weight.device))
                setattr(parent, name, layer)
                replaced += 1
    return replaced


def upcast_unquantised(net: torch.nn.Module) -> list[str]:
    """peft's ``prepare_model_for_kbit_training`` on the 4-bit model: every fp16/bf16 parameter
    not stored 4-bit is cast to fp32 (peft 0.21.2 utils/other.py:204-209); returns the names.

    The 4-bit layers' biases are left as they are: bitsandbytes casts them back to the compute
    dtype in place at the first forward (nn/modules.py:630-634 at bitsandbytes 95f9af30).
    """
    quantised = {id(p) for m in net.modules() if isinstance(m, Linear4bit) for p in m.parameters()}
    cast = []
    for name, param in net.named_parameters():
        if id(param) in quantised or param.dtype not in (torch.float16, torch.bfloat16):
            continue
        param.data = param.data.to(torch.float32)
        cast.append(name)
    return cast


def mark_lora_wrapped(net: torch.nn.Module) -> None:
    """Flag the 4-bit layers peft wrapped with LoRA: their output is cloned (see the module)."""
    for module in net.modules():
        get_base = getattr(module, "get_base_layer", None)
        if callable(get_base) and hasattr(module, "lora_A"):
            base = get_base()
            if isinstance(base, Linear4bit):
                base.clones_output = True
