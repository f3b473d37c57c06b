"""The loss's activations: logits and the fp32 log-softmax held through backward, and the
loss's transients, for the full loss (transformers' ``ForCausalLMLoss``), a chunked one
(torchtune's ``LinearCrossEntropyLoss``) and Liger's fused linear cross-entropy. Bytes per
token; :func:`loss_activations` multiplies by the micro-step's tokens.
"""

from __future__ import annotations

import math

from batchfit.memory.formulas._regime import Regime
from batchfit.memory.types import Line
from batchfit.models import ModelInfo
from batchfit.spec import TrainingSetup


def loss_terms(
    vocab: int, rg: Regime, loop: str = "trainer", kept_bytes: int | None = None
) -> tuple[float, float]:
    """Bytes per token held by logits and the loss, and the extra during the loss's backward.

    transformers' ForCausalLMLoss upcasts logits (``logits.float()``); cross-entropy's
    log_softmax keeps its fp32 output; its backward adds the incoming and outgoing gradients
    (both fp32, ``b*s*V`` each). The logits themselves outlive forward only when the loop
    keeps the model's outputs through backward (``loop="keep-outputs"``), in ``kept_bytes``
    per element (fp32 where the framework casts the outputs: accelerate, Fabric).
    """
    kept = rg.compute_bytes if kept_bytes is None else kept_bytes
    held = 4 * vocab + (kept * vocab if loop == "keep-outputs" else 0)
    return held, 8 * vocab


def chunked_loss_terms(
    vocab: int, rg: Regime, loop: str, chunks: int, kept_bytes: int | None = None
) -> tuple[float, float, float]:
    """As :func:`loss_terms` for a loss computed per chunk of the tokens: bytes per token held,
    and the transients of forward and of backward.

    Every chunk's fp32 log-softmax is saved, as with the full loss; what shrinks is the
    transient. torchtune's LinearCrossEntropyLoss (the trainer loop) projects and upcasts one
    chunk at a time; a loop that keeps the outputs (litgpt) holds every chunk's logits while
    one chunk's fp32 copy is made. In backward one chunk's fp32 gradients (and their 16-bit
    cast) exist at a time.
    """
    upcast = 4 * vocab if rg.compute_bytes < 4 else 0  # .float() copies only 16-bit logits
    kept = loop == "keep-outputs"
    kept_b = rg.compute_bytes if kept_bytes is None else kept_bytes
    held = 4 * vocab + (kept_b * vocab if kept else 0)
    in_forward = (0 if kept else rg.compute_bytes * vocab) / chunks + upcast / chunks
    in_backward = (8 * vocab + (rg.compute_bytes * vocab if upcast else 0)) / chunks
    return held, in_forward, in_backward


# A dry run of Liger's loss runs the first and last of a run of identical chunks this many at
# a time (``trace/_lm_loss.py``): what each allocates and frees is the same
KEPT_FAKE_CHUNKS = 2


def fused_loss_rows(tokens: int, vocab: int, hidden: int) -> int:
    """Rows of one chunk of Liger's fused linear cross-entropy:
    ``next_power_of_2(cdiv(BT, cdiv(V, H)))`` (``fused_linear_cross_entropy.py``)."""
    rows = -(-tokens // -(-vocab // hidden))
    return min(1 << max(0, math.ceil(math.log2(max(rows, 1)))), tokens)


def kept_logit_bytes(setup: TrainingSetup, rg: Regime) -> int:
    """Bytes per element of the logits a keep-outputs loop holds: fp32 where the framework
    casts the outputs (``TrainingSetup.outputs_fp32``), else the compute dtype."""
    return 4 if setup.outputs_fp32 else rg.compute_bytes


def loss_activations(
    model: ModelInfo,
    setup: TrainingSetup,
    rg: Regime,
    tokens: int,
    seq_len: int,
    *,
    head_trainable: bool,
) -> tuple[float, float, list[Line]]:
    """Logits and loss buffers held through backward, and the extra at its start."""
    if model.task == "classification":
        return 0.0, 0.0, []
    vocab, loop = model.arch.vocab_size, setup.loop
    kept_b = kept_logit_bytes(setup, rg)
    if setup.loss == "fused":
        return _fused_loss(model, rg, tokens, head_trainable=head_trainable)
    chunks = setup.loss_chunk_count(tokens, seq_len)
    if setup.loss == "chunked" and chunks > 1:  # one chunk is the full loss
        held_pt, forward_pt, backward_pt = chunked_loss_terms(vocab, rg, loop, chunks, kept_b)
        # Each chunk's projection gives the head's weight its own gradient; autograd sums them
        # in a buffer before the weight's .grad exists: the buffer and one chunk's gradient.
        head_sum = 2 * vocab * model.arch.hidden_size * (4 if rg.amp else rg.stream_bytes)
        head_sum = head_sum if head_trainable else 0
        held = held_pt * tokens
        bwd_extra = max(forward_pt * tokens, backward_pt * tokens + head_sum)
        extra_why = f"the larger of forward and backward over {chunks} chunks" + (
            " (with the head's gradient summed over the chunks)" if head_sum else ""
        )
    else:
        held_pt, extra_pt = loss_terms(vocab, rg, loop, kept_b)
        extra_why = f"{tokens:,} x {vocab:,} x 8 B, at the start of backward"
        held, bwd_extra = held_pt * tokens, extra_pt * tokens
    what, per = "fp32 log-softmax (the loop frees the logits)", "4"
    if loop == "keep-outputs":
        what, per = "logits (kept by the loop) + fp32 log-softmax", f"({kept_b} + 4)"
    if setup.loss == "chunked":
        what = f"{what}, {chunks} chunks"
    lines = [
        Line("activations", what, int(held), f"{tokens:,} tokens x {vocab:,} vocab x {per} B"),
        Line("activations", "loss backward (fp32 grads of logits)", int(bwd_extra), extra_why),
    ]
    return held, bwd_extra, lines


def _fused_loss(
    model: ModelInfo, rg: Regime, tokens: int, *, head_trainable: bool
) -> tuple[float, float, list[Line]]:
    """Liger's fused linear cross-entropy: the gradients of the head's input (and weight, when
    it trains) and the per-token fp32 losses are made in forward and held through backward;
    one chunk's logits (and, for an fp32 input, their fp32 cast for the weight's gradient)
    are the transient."""
    arch = model.arch
    rows = fused_loss_rows(tokens, arch.vocab_size, arch.hidden_size)
    weight_grad = arch.vocab_size * arch.hidden_size * (4 if rg.amp else rg.stream_bytes)
    held = (rg.stream_bytes * arch.hidden_size + 4) * tokens + (
        weight_grad if head_trainable else 0
    )
    chunk = (
        rows
        * arch.vocab_size
        * (rg.compute_bytes + (4 if rg.stream_bytes > rg.compute_bytes else 0))
    )
    chunk += rows * arch.hidden_size * rg.compute_bytes
    lines = [
        Line(
            "activations",
            "fused loss: head input gradient + fp32 losses"
            + (" + head gradient" if head_trainable else ""),
            int(held),
            f"{tokens:,} x ({rg.stream_bytes} x {arch.hidden_size:,} + 4) B, made in forward",
        ),
        Line(
            "activations",
            "fused loss: one chunk's logits",
            int(chunk),
            f"{rows:,} rows x {arch.vocab_size:,} vocab, in forward",
        ),
    ]
    return held, float(chunk), lines
