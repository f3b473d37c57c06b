"""Tiny real models and data shared by the training-runtime tests (and their subprocesses)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from batchfit.train import Accumulator, cross_entropy_sum

VOCAB = 24
MAX_LEN = 12

MakeOpt = Callable[[Iterator[nn.Parameter]], torch.optim.Optimizer]
TokenBatch = tuple[torch.Tensor, torch.Tensor]  # input ids [B, L], labels [B, L] (-100 = pad)


def token_batches(num_batches: int, batch_size: int, seed: int = 0) -> list[TokenBatch]:
    """Variable-length sequences right-padded to ``MAX_LEN``; labels skewed toward class 0."""
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(num_batches):
        lengths = torch.randint(2, MAX_LEN + 1, (batch_size,), generator=gen)
        ids = torch.randint(1, VOCAB, (batch_size, MAX_LEN), generator=gen)
        labels = torch.randint(0, VOCAB, (batch_size, MAX_LEN), generator=gen)
        labels[torch.rand(batch_size, MAX_LEN, generator=gen) < 0.5] = 0  # imbalance
        pad = torch.arange(MAX_LEN) >= lengths[:, None]
        ids[pad] = 0
        labels[pad] = -100
        batches.append((ids, labels))
    return batches


def linear_stack(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Embedding(VOCAB, 16), nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, VOCAB)
    )


def tiny_gpt2(seed: int = 0) -> nn.Module:
    """A 2-layer GPT-2 from a config, dropout 0."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=MAX_LEN,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return GPT2LMHeadModel(config)


def logits_of(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    out = model(ids)
    return out if isinstance(out, torch.Tensor) else out.logits


def full_batch_steps(
    model: nn.Module,
    batches: list[TokenBatch],
    weights: torch.Tensor | None = None,
    *,
    make_opt: MakeOpt,
) -> list[float]:
    """The hand-written reference: one mean-loss step per global batch. Returns the losses."""
    opt = make_opt(model.parameters())
    losses = []
    for ids, labels in batches:
        logits = logits_of(model, ids)
        loss = F.cross_entropy(
            logits.reshape(-1, VOCAB), labels.reshape(-1), weight=weights, ignore_index=-100
        )
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def accumulated_steps(
    model: nn.Module,
    batches: list[TokenBatch],
    micro_batch_size: int,
    weights: torch.Tensor | None = None,
    *,
    make_opt: MakeOpt,
) -> list[float]:
    """The same steps through an ``Accumulator`` at ``micro_batch_size``. Returns the losses."""
    opt = make_opt(model.parameters())
    global_size = len(batches[0][0])
    k = global_size // micro_batch_size
    acc = Accumulator(model, opt, grad_accum_steps=k)
    losses = []
    for ids, labels in batches:
        for start in range(0, global_size, micro_batch_size):
            with acc.micro_step() as micro:
                sl = slice(start, start + micro_batch_size)
                acc.backward(
                    *cross_entropy_sum(logits_of(model, ids[sl]), labels[sl], class_weights=weights)
                )
        assert micro.result is not None
        losses.append(micro.result.loss)
    return losses


# A wide MLP whose activations dominate its memory: per sample ~5 MB of saved activations
# against ~0.5 MB of weights, so a real OS limit separates micro-batches of 8 and 16.
WIDE_ROWS, WIDE_IN, WIDE_HIDDEN = 128, 64, 1024


def wide_mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(WIDE_IN, WIDE_HIDDEN),
        nn.Dropout(0.1),  # draws random numbers: a redo must draw the same
        *[nn.ReLU() for _ in range(8)],  # each keeps its output for backward
        nn.Linear(WIDE_HIDDEN, WIDE_IN),
    )


def wide_batches(num_batches: int, batch_size: int, seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(batch_size, WIDE_ROWS, WIDE_IN, generator=gen) for _ in range(num_batches)]


def wide_step_fn(model: nn.Module) -> Callable[[torch.Tensor], tuple[torch.Tensor, int]]:
    """Forward pass of a micro-batch: squared error against the input, summed over rows."""

    def step_fn(x: torch.Tensor) -> tuple[torch.Tensor, int]:
        return ((model(x) - x) ** 2).sum(), x.shape[0] * x.shape[1]

    return step_fn
