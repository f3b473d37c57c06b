"""Tiny configs, models and data shared by the tests (and the workers they launch).

- Configs (``config.json`` contents): ``TINY_GPT2`` is examples/train_tiny_gpt2.py's own config
  (2 layers of width 64, a vocabulary of 96), read from the example so the two agree;
  ``PROBE_GPT2`` is the GPT-2 the probe runs real steps on; ``TIMELINE_GPT2`` the one the
  step's timeline is traced and drawn for; ``DEBERTA_V3_BASE`` is
  microsoft/deberta-v3-base's config and ``TINY_DEBERTA_V3`` the same narrowed to 2 layers of
  width 64; ``TINY_VIT`` a 2-layer ViT classifier of 64 px images.
- Models: ``example_gpt2`` builds ``TINY_GPT2``; ``linear_stack``, ``tiny_gpt2_lm`` and
  ``wide_mlp`` are the training-runtime tests' models, with their data (``token_batches``,
  ``wide_batches``) and reference steps (``full_batch_steps``, ``accumulated_steps``).
- ``one_thread``: torch's CPU work on one thread, for the modules whose real training steps
  run in the test process.
"""

from __future__ import annotations

import ast
import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from batchfit.train import Accumulator, cross_entropy_sum

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_tiny_gpt2.py"


def _example_config() -> dict[str, Any]:
    """The example's ``CONFIG`` literal, read without running the example (no transformers
    import: the workers and children that import this module stay light)."""
    for node in ast.parse(EXAMPLE.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "CONFIG" for t in node.targets
        ):
            return dict(ast.literal_eval(node.value))
    raise LookupError(f"no CONFIG = {{...}} in {EXAMPLE}")


TINY_GPT2: dict[str, Any] = _example_config()
# A 2-layer Llama of width 64 as a config.json's text: what an optimizer's dry-run-against-real
# test steps (small enough for a real CPU step, a real Llama's layer kinds).
TINY_LLAMA_JSON = (
    '{"model_type": "llama", "hidden_size": 64, "intermediate_size": 176, '
    '"num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 256}'
)

PROBE_GPT2: dict[str, Any] = {
    "model_type": "gpt2",
    "n_layer": 2,
    "n_embd": 64,
    "n_head": 4,
    "vocab_size": 512,
    "n_positions": 256,
    "architectures": ["GPT2LMHeadModel"],
}

TIMELINE_GPT2: dict[str, Any] = {
    "model_type": "gpt2",
    "architectures": ["GPT2LMHeadModel"],
    "n_embd": 128,
    "n_layer": 2,
    "n_head": 4,
    "n_positions": 256,
    "vocab_size": 3000,
}

# a ViT image classifier of 2 layers of width 64, 64 px images in 16 px patches
TINY_VIT: dict[str, Any] = {
    "model_type": "vit",
    "architectures": ["ViTForImageClassification"],
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 128,
    "image_size": 64,
    "patch_size": 16,
    "num_labels": 10,
}

# microsoft/deberta-v3-base's config.json (the keys that shape it)
DEBERTA_V3_BASE: dict[str, Any] = {
    "model_type": "deberta-v2",
    "architectures": ["DebertaV2ForMaskedLM"],
    "hidden_size": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "intermediate_size": 3072,
    "vocab_size": 128100,
    "max_position_embeddings": 512,
    "relative_attention": True,
    "position_buckets": 256,
    "norm_rel_ebd": "layer_norm",
    "share_att_key": True,
    "pos_att_type": ["p2c", "c2p"],
    "position_biased_input": False,
    "type_vocab_size": 0,
    "layer_norm_eps": 1e-7,
    "hidden_act": "gelu",
    "max_relative_positions": -1,
    "pad_token_id": 0,
}
# the same, narrowed to 2 layers of width 64 to stay quick
TINY_DEBERTA_V3: dict[str, Any] = {
    **DEBERTA_V3_BASE,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 256,
    "vocab_size": 1000,
}


def example_gpt2(n_embd: int = 64) -> nn.Module:
    """``TINY_GPT2`` built with seed 0; another ``n_embd`` gives another model."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(**{**TINY_GPT2, "n_embd": n_embd}))


# The training-runtime tests' token data: ids below VOCAB, right-padded to MAX_LEN.
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


def tiny_gpt2_lm(seed: int = 0) -> nn.Module:
    """A 2-layer GPT-2 over ``VOCAB`` tokens and ``MAX_LEN`` positions, dropout 0."""
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


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch's CPU work on one thread while inside, its thread count restored after: beside
    the other test worker on two cores, a second thread spin-waits and makes small CPU
    training steps several times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
