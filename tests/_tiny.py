"""The tiny GPT-2 the tests plan and train on the CPU (examples/train_tiny_gpt2.py's, without
its token ids): 2 layers of width 64, a vocabulary of 96."""

from __future__ import annotations

from typing import Any

TINY_GPT2: dict[str, Any] = {
    "model_type": "gpt2",
    "architectures": ["GPT2LMHeadModel"],
    "vocab_size": 96,
    "n_positions": 64,
    "n_embd": 64,
    "n_layer": 2,
    "n_head": 4,
}
