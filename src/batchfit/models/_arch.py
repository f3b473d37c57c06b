"""A config.json's shape, normalised across model types (GPT-2, BERT, T5, OPT, Llama, ...)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from batchfit.errors import UsageError

ENCODER_TYPES = frozenset(
    {
        "bert",
        "roberta",
        "distilbert",
        "deberta",
        "deberta-v2",
        "electra",
        "xlm-roberta",
        "albert",
        "camembert",
        "mpnet",
        "modernbert",
    }
)
ENCODER_DECODER_TYPES = frozenset({"t5", "mt5", "umt5", "bart", "mbart", "pegasus", "marian"})
LEARNED_POSITION_TYPES = frozenset(
    {
        "gpt2",
        "bert",
        "roberta",
        "distilbert",
        "opt",
        "gpt_neo",
        "electra",
        "xlm-roberta",
        "camembert",
        "albert",
        "bart",
        "mbart",
        "biogpt",
    }
)
RELATIVE_POSITION_TYPES = frozenset({"t5", "mt5", "umt5", "deberta", "deberta-v2"})
RMSNORM_TYPES = frozenset(
    {
        "llama",
        "mistral",
        "mixtral",
        "qwen2",
        "qwen2_moe",
        "qwen3",
        "phi3",
        "gemma",
        "gemma2",
        "gemma3_text",
        "t5",
        "mt5",
        "umt5",
        "olmo2",
        "granite",
    }
)
# RoBERTa-style embeddings start positions at padding_idx + 1 = 2 (modeling_roberta.py).
_POSITION_OFFSET = {"roberta": 2, "xlm-roberta": 2, "camembert": 2}


@dataclass(frozen=True)
class Architecture:
    """Shape facts the analytic engine needs, normalised across model types."""

    model_type: str
    family: str  # decoder | encoder | encoder-decoder
    hidden_size: int
    num_layers: int
    num_decoder_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_positions: int | None  # None: rotary/relative, no hard limit
    positional: str  # learned | rotary | relative
    gated_mlp: bool
    activation: str
    norm: str  # layernorm | rmsnorm
    tied_embeddings: bool
    num_experts: int
    experts_per_token: int
    attention_dropout: float
    hidden_dropout: float


def _first(cfg: dict[str, Any], *keys: str, default: Any = None) -> Any:
    """The value of the first of ``keys`` the config sets (model types name a field apart)."""
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    return default


def _family(mt: str) -> str:
    if mt in ENCODER_DECODER_TYPES:
        return "encoder-decoder"
    return "encoder" if mt in ENCODER_TYPES else "decoder"


def _positions(mt: str, cfg: dict[str, Any]) -> tuple[str, int | None]:
    """The position scheme and the longest sequence it has learned (None: no hard limit)."""
    max_pos = _first(cfg, "max_position_embeddings", "n_positions")
    if mt in LEARNED_POSITION_TYPES and max_pos is not None:
        return "learned", int(max_pos) - _POSITION_OFFSET.get(mt, 0)
    if mt in RELATIVE_POSITION_TYPES:
        return "relative", None
    return "rotary", int(max_pos) if max_pos is not None else None


def _mlp(mt: str, family: str, cfg: dict[str, Any]) -> tuple[bool, str]:
    """Whether the MLP is gated, and its activation (T5 spells gating in the name)."""
    act = str(
        _first(
            cfg,
            "hidden_act",
            "activation_function",
            "feed_forward_proj",
            "activation",
            default="gelu",
        )
    )
    if mt in ("t5", "mt5", "umt5"):
        return act.startswith("gated-"), act.removeprefix("gated-")
    gated = mt not in LEARNED_POSITION_TYPES and family != "encoder" and not mt.startswith("t5")
    return gated, act


def arch_from_config(cfg: dict[str, Any]) -> Architecture:
    """Normalise a config.json dict's field names (GPT-2, BERT, T5, OPT, Llama, ...)."""
    mt = cfg.get("model_type", "")
    hidden = int(_first(cfg, "hidden_size", "n_embd", "d_model", "dim"))
    layers = int(_first(cfg, "num_hidden_layers", "n_layer", "num_layers", "n_layers"))
    heads = int(_first(cfg, "num_attention_heads", "n_head", "num_heads", "n_heads"))
    inter = _first(
        cfg, "intermediate_size", "n_inner", "ffn_dim", "d_ff", "hidden_dim", "encoder_ffn_dim"
    )
    kv_heads = int(_first(cfg, "num_key_value_heads", default=heads))
    if heads % kv_heads:
        raise UsageError(
            f"num_key_value_heads {kv_heads} does not divide num_attention_heads {heads}: "
            "each key/value head serves a whole group of query heads"
        )
    family = _family(mt)
    gated, act = _mlp(mt, family, cfg)
    positional, max_pos = _positions(mt, cfg)
    return Architecture(
        model_type=mt,
        family=family,
        hidden_size=hidden,
        num_layers=layers,
        num_decoder_layers=int(_first(cfg, "num_decoder_layers", default=layers))
        if family == "encoder-decoder"
        else 0,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=int(_first(cfg, "head_dim", "d_kv", default=hidden // heads)),
        intermediate_size=int(inter) if inter is not None else 4 * hidden,
        vocab_size=int(cfg["vocab_size"]),
        max_positions=max_pos,
        positional=positional,
        gated_mlp=gated,
        activation=act,
        norm="rmsnorm" if mt in RMSNORM_TYPES else "layernorm",
        tied_embeddings=bool(
            _first(cfg, "tie_word_embeddings", default=mt not in ("llama", "mistral"))
        ),
        num_experts=int(_first(cfg, "num_local_experts", "num_experts", default=0)),
        experts_per_token=int(_first(cfg, "num_experts_per_tok", default=0)),
        attention_dropout=float(
            _first(
                cfg,
                "attn_pdrop",
                "attention_probs_dropout_prob",
                "attention_dropout",
                "dropout_rate",
                default=0.0,
            )
        ),
        hidden_dropout=float(
            _first(
                cfg,
                "dropout_rate",
                "hidden_dropout_prob",
                "resid_pdrop",
                "dropout",
                "hidden_dropout",
                default=0.0,
            )
        ),
    )


def default_task(cfg: dict[str, Any]) -> str:
    """Task from ``architectures`` (…ForCausalLM, …ForMaskedLM, …), else from the model type."""
    for arch_name in cfg.get("architectures") or ():
        if arch_name.endswith(("ForCausalLM", "LMHeadModel")):
            return "causal-lm"
        if arch_name.endswith(("ForMaskedLM", "ForPreTraining")):
            return "masked-lm"
        if arch_name.endswith("ForSequenceClassification"):
            return "classification"
        if arch_name.endswith("ForConditionalGeneration"):
            return "seq2seq"
    mt = cfg.get("model_type", "")
    if mt in ENCODER_DECODER_TYPES:
        return "seq2seq"
    return "masked-lm" if mt in ENCODER_TYPES else "causal-lm"
