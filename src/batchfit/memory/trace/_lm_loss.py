"""A language model's loss as the training framework computes it, run on fake or real tensors.

``--loss full`` is the model's own loss (transformers' ``ForCausalLMLoss``). For ``chunked``
and ``fused`` the model's output head is bypassed (its forward returns the hidden states) and
:class:`HeadLoss` applies the head and the cross-entropy as those implementations do:

- ``chunked``: torchtune's ``LinearCrossEntropyLoss`` (``modules/loss/cross_entropy_loss.py``,
  ``num_output_chunks=8``): the model skips its output layer, the tokens are split into chunks
  and each is projected, upcast (``logits.float()``) and summed into the loss before the next.
  Under a loop that keeps the outputs (litgpt's ``lm_head_chunk_size``: ``model.py`` returns
  ``[lm_head(x_i) for x_i in x.split(...)]``), every chunk's logits exist first and are held.
  Either way each chunk's fp32 log-softmax is saved for backward.
- ``fused``: Liger's ``LigerFusedLinearCrossEntropyFunction``
  (``ops/fused_linear_cross_entropy.py``): during forward, per chunk of
  ``next_power_of_2(ceil(BT / ceil(V / H)))`` rows, the chunk's logits are computed, turned
  into their gradient in place, and multiplied into the gradients of the head's input
  (``zeros_like(input)``) and weight (``zeros_like(weight)``), which are saved for backward;
  no logits outlive the chunk.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake

from batchfit.errors import UsageError
from batchfit.memory.formulas.loss import KEPT_FAKE_CHUNKS, fused_loss_rows

IGNORE_INDEX = -100  # transformers', torchtune's and Liger's ignore index


@dataclass
class LossOutput:
    """What the wrapped model returns: the loss, and the logits a keep-outputs loop holds."""

    loss: torch.Tensor
    logits: list[torch.Tensor] | None


def _ce_grad_in_place(
    logits: torch.Tensor, target: torch.Tensor, count: torch.Tensor
) -> torch.Tensor:
    """Turn ``logits`` (rows x V) into d(mean loss)/d(logits) in place; return per-row losses.

    Liger's Triton kernel does this row by row in registers: nothing the size of the chunk is
    allocated besides the chunk itself, and neither is here (only per-row vectors).
    """
    valid = target != IGNORE_INDEX
    index = target.clamp(min=0).unsqueeze(1)
    picked = logits.gather(1, index).squeeze(1).float()
    top = logits.amax(dim=-1, keepdim=True)
    logits.sub_(top).exp_()
    total = logits.sum(dim=-1, keepdim=True, dtype=torch.float32)
    losses = (total.log() + top.float()).squeeze(1) - picked
    logits.div_(total.to(logits.dtype))
    logits.scatter_add_(1, index, torch.full_like(index, -1, dtype=logits.dtype))
    logits.mul_((valid.to(logits.dtype) / count.to(logits.dtype)).unsqueeze(1))
    return losses * valid / count  # liger's kernel stores each row's share of the mean


def _chunk_starts(rows: int, chunk: int, fake: bool) -> list[int]:
    """The first row of each chunk the loss runs.

    Each chunk allocates its logits and per-row vectors and frees them before the next, so
    chunks of one size leave the caching allocator as the first ones did: on fake tensors
    (a dry run: nothing is computed) the middle of a long run is skipped, and the peak and the
    reserve are those of every chunk run (``tests/memory/test_loss.py``). A small hidden size
    over a large vocabulary makes chunks of a few rows: hundreds of them, most of a dry run.
    On real tensors every chunk runs.
    """
    starts = list(range(0, rows, chunk))
    if fake and len(starts) > 2 * KEPT_FAKE_CHUNKS:
        # the last start may begin a shorter chunk: the one before it is kept too
        return starts[:KEPT_FAKE_CHUNKS] + starts[-KEPT_FAKE_CHUNKS:]
    return starts


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """Liger's fused linear cross-entropy (mean over the tokens not ignored), in torch ops."""

    @staticmethod
    def forward(
        ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor
    ) -> torch.Tensor:
        rows, width = hidden.shape
        chunk = fused_loss_rows(rows, weight.shape[0], width)  # the formulas' own chunk size
        grad_input = torch.zeros_like(hidden)
        grad_weight = torch.zeros_like(weight) if weight.requires_grad else None
        losses = torch.zeros(rows, dtype=torch.float32, device=hidden.device)
        count = (target != IGNORE_INDEX).sum()
        for start in _chunk_starts(rows, chunk, is_fake(hidden)):
            x = hidden[start : start + chunk]
            logits = (x @ weight.t()).contiguous()
            losses[start : start + chunk] = _ce_grad_in_place(
                logits, target[start : start + chunk], count
            )
            grad_input[start : start + chunk] = logits @ weight
            if grad_weight is not None:
                with torch.autocast(hidden.device.type, enabled=False):
                    torch.addmm(
                        grad_weight, logits.t().to(x.dtype), x, out=grad_weight
                    )  # liger: mat1=logits_chunk.t().to(_input_chunk.dtype), mat2=_input_chunk
            del logits
        ctx.save_for_backward(grad_input, grad_weight)
        return losses.sum()

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        grad_input, grad_weight = ctx.saved_tensors
        # liger scales both in place unless grad_output is 1 (element_mul_kernel)
        grad_input.mul_(grad_output.to(grad_input.dtype))
        if grad_weight is not None:
            grad_weight.mul_(grad_output.to(grad_weight.dtype))
        return grad_input, grad_weight, None


class HeadLoss(torch.nn.Module):
    """A Hugging Face language model whose head and loss run as ``loss`` does (see above)."""

    def __init__(
        self,
        net: torch.nn.Module,
        *,
        loss: str,
        chunks: int,
        chunk_tokens: int | None,
        shift: bool,
        keep_logits: bool,
        fp32_logits: bool,
    ) -> None:
        super().__init__()
        self.net = net
        self.kind, self.chunks, self.chunk_tokens = loss, chunks, chunk_tokens
        self.shift, self.keep_logits, self.fp32_logits = shift, keep_logits, fp32_logits
        getter = getattr(net, "get_base_model", None)
        base: Any = getter() if callable(getter) else net
        head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
        if not isinstance(head, torch.nn.Linear):
            raise UsageError(
                f"--loss {loss} needs a language-model head (a linear layer over the vocabulary); "
                f"{type(base).__name__} has none: use --loss full"
            )
        self._head_forward: Callable[[torch.Tensor], torch.Tensor] = head.forward
        self._head = head
        head.forward = _identity  # type: ignore[method-assign, assignment]
        # A soft-capping of the logits (Gemma-2) applies per chunk, not to the hidden states.
        config = base.config
        self._softcap = getattr(config, "final_logit_softcapping", None)
        if self._softcap is not None:
            config.final_logit_softcapping = None
        self._decoder_ids = getattr(base, "prepare_decoder_input_ids_from_labels", None)
        if not base.config.is_encoder_decoder:
            self._decoder_ids = None

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self._head_forward(hidden)
        if self._softcap:
            logits = torch.tanh(logits / self._softcap) * self._softcap
        return logits

    def forward(self, labels: torch.Tensor, **inputs: Any) -> LossOutput:
        if self._decoder_ids is not None:
            inputs["decoder_input_ids"] = self._decoder_ids(labels=labels)
        hidden = self.net(**inputs).logits  # the bypassed head returns its input
        if self.shift:  # transformers' ForCausalLMLoss: pad, then shift the labels
            labels = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
        if self.kind == "fused":
            flat = hidden.reshape(-1, hidden.shape[-1])
            loss = _FusedLinearCrossEntropy.apply(  # type: ignore[no-untyped-call]
                flat, self._head.weight, labels.reshape(-1)
            )
            return LossOutput(cast(torch.Tensor, loss), None)
        count = (labels != IGNORE_INDEX).sum()
        if self.keep_logits:
            # The model returns every chunk's logits (litgpt's lm_head_chunk_size) and the
            # loop holds them: all exist before the loss runs.
            size = self.chunk_tokens or -(-hidden.shape[1] // self.chunks)
            parts = torch.split(hidden, size, dim=1)
            targets = torch.split(labels, size, dim=1)
            logits = [self._logits(part) for part in parts]
            if self.fp32_logits:  # Fabric's convert_output, before the loss sees them
                logits = [part.float() for part in logits]
            total = sum(
                (
                    self._chunk_loss(part, target)
                    for part, target in zip(logits, targets, strict=True)
                ),
                torch.zeros((), device=hidden.device),
            )
            return LossOutput(total / count, logits)
        # torchtune's LinearCrossEntropyLoss: tokens split into chunks, each projected,
        # upcast and summed before the next; no chunk's logits outlive its loss.
        flat = hidden.reshape(-1, hidden.shape[-1])
        flat_labels = labels.reshape(-1)
        total = torch.zeros((), device=hidden.device)
        if self.chunk_tokens:
            pairs = zip(
                torch.split(flat, self.chunk_tokens),
                torch.split(flat_labels, self.chunk_tokens),
                strict=True,
            )
        else:
            pairs = zip(
                flat.tensor_split(self.chunks), flat_labels.tensor_split(self.chunks), strict=True
            )
        for part, target in pairs:
            total = total + self._chunk_loss(self._logits(part), target)
        return LossOutput(total / count, None)

    @staticmethod
    def _chunk_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(),
            target.reshape(-1),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )


class Fp32Outputs(torch.nn.Module):
    """The model with its logits cast to fp32 after forward, as accelerate's
    ``convert_outputs_to_fp32`` does under mixed precision (the loss, computed inside
    forward, saw the 16-bit logits)."""

    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, **inputs: Any) -> Any:
        out = self.net(**inputs)
        logits = getattr(out, "logits", None)
        if isinstance(logits, torch.Tensor) and logits.dtype != torch.float32:
            out.logits = logits.float()
        return out


def _identity(hidden: torch.Tensor) -> torch.Tensor:
    return hidden
