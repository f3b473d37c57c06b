"""The generic decoder a bare size (``7B``) stands for: a Llama-style config and its table."""

from __future__ import annotations

import math
from typing import Any

# Generic decoder for a bare size: Llama-2 proportions (hidden/layers = 128, SwiGLU with
# intermediate = 8/3 hidden rounded to 256, 128-wide MHA heads, 32k vocabulary).
_GENERIC_VOCAB = 32000


def generic_decoder_config(num_params: int) -> dict[str, Any]:
    """A Llama-style config.json of about ``num_params`` parameters."""
    vocab = _GENERIC_VOCAB
    # 12 h^2 per layer (4 h^2 attention + 3 h * 8h/3 MLP) + 2 V h embeddings, with L = h / 128.
    hidden = _generic_hidden(num_params, vocab)
    inter = int(math.ceil(8 * hidden / 3 / 256) * 256)
    per_layer = 4 * hidden * hidden + 3 * hidden * inter + 2 * hidden
    layers = max(1, round((num_params - 2 * vocab * hidden) / per_layer))
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": max(1, hidden // 128),
        "num_key_value_heads": max(1, hidden // 128),
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "attention_dropout": 0.0,
        "rms_norm_eps": 1e-5,
    }


def _generic_hidden(num_params: int, vocab: int) -> int:
    """The largest multiple of 128 (at least 128) whose next step would pass ``num_params``.

    Starts from the cube root, so a size of 10^30 costs a few steps, not 10^8.
    """

    def fits(hidden: int) -> bool:
        return 12 * hidden**3 / 128 + 2 * vocab * hidden <= num_params

    hidden = max(128, int((num_params * 128 / 12) ** (1 / 3)) // 128 * 128)
    while hidden > 128 and not fits(hidden):
        hidden -= 128
    while fits(hidden + 128):
        hidden += 128
    return hidden


def generic_rows(cfg: dict[str, Any]) -> list[list[Any]]:
    h, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    n = cfg["num_hidden_layers"]
    layer = "model.layers.*."
    return [
        ["model.embed_tokens.weight", [v, h], 1, "Embedding"],
        *[
            [f"{layer}self_attn.{p}.weight", [h, h], n, "Linear"]
            for p in ("q_proj", "k_proj", "v_proj", "o_proj")
        ],
        [f"{layer}mlp.gate_proj.weight", [f, h], n, "Linear"],
        [f"{layer}mlp.up_proj.weight", [f, h], n, "Linear"],
        [f"{layer}mlp.down_proj.weight", [h, f], n, "Linear"],
        [f"{layer}input_layernorm.weight", [h], n, "LlamaRMSNorm"],
        [f"{layer}post_attention_layernorm.weight", [h], n, "LlamaRMSNorm"],
        ["model.norm.weight", [h], 1, "LlamaRMSNorm"],
        ["lm_head.weight", [v, h], 1, "Linear"],
    ]
