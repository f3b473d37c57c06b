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
# Image models transformers builds with AutoModelForImageClassification (its mapping, 5.24)
# that batchfit has checked; "torchvision" marks a torchvision model named by MODEL. Their
# per-sample size is the image side in pixels. ViT-style encoders see patches as tokens;
# ConvNeXt, Swin and ResNet change width stage by stage, so they are traced whole.
VISION_TYPES = frozenset(
    {
        "vit",
        "deit",
        "beit",
        "dinov2",
        "clip",
        "siglip",
        "convnext",
        "convnextv2",
        "swin",
        "swinv2",
        "resnet",
        "regnet",
        "efficientnet",
        "mobilenet_v2",
        "torchvision",
    }
)
# Of those, the ViT-style encoders (patches as tokens, one width along the stack) ...
PATCH_ENCODER_TYPES = frozenset({"vit", "deit", "beit", "dinov2", "clip", "siglip"})
# ... and the convolutional ones, which have no attention to implement (transformers refuses
# an attention implementation for them; built with its default).
# Linear modules a model class keeps in fp32 (``_keep_in_fp32_modules``), by model type: the
# 4-bit quantizer leaves them unquantised (transformers 5.24.0: models/t5, mt5, umt5, udop,
# pop2piano). The trace reads the attribute from the built model; the formulas read this.
KEEP_IN_FP32: dict[str, tuple[str, ...]] = {
    model_type: ("wo",) for model_type in ("t5", "mt5", "umt5", "udop", "pop2piano")
}
ATTENTION_FREE_TYPES = frozenset(
    {"convnext", "convnextv2", "resnet", "regnet", "efficientnet", "mobilenet_v2", "torchvision"}
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
        # Pegasus and Marian add fixed sinusoidal tables of max_position_embeddings rows: a
        # hard limit on the sequence, as learned tables are (modeling_pegasus.py).
        "pegasus",
        "marian",
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
# Model types whose transformers model class has ``_supports_sdpa = False`` (transformers
# 5.24; tests/models/test_attention.py checks this against the installed classes). Asked for
# SDPA, transformers raises; left to choose, it runs eager attention. Kept as data so the
# analytic engine knows without importing transformers.
NO_SDPA_TYPES = frozenset(
    {
        "big_bird",
        "bigbird_pegasus",
        "bloom",
        "canine",
        "convbert",
        "cpmant",
        "deberta",
        "deberta-v2",
        "deepseek_v4",
        "falcon_mamba",
        "flaubert",
        "flint",
        "fnet",
        "fsmt",
        "funnel",
        "gemma2",
        "git",
        "got_ocr2",
        "gpt_neo",
        "gpt_neox_japanese",
        "gpt_oss",
        "granite_swa",
        "granitemoe_swa",
        "hy_v4",
        "ibert",
        "inkling2_text",
        "layoutlmv2",
        "led",
        "lilt",
        "longformer",
        "longt5",
        "luke",
        "mamba",
        "mamba2",
        "markuplm",
        "megatron-bert",
        "mimo_v2_flash",
        "mpnet",
        "mpt",
        "mra",
        "mvp",
        "nllb-moe",
        "nystromformer",
        "openai-gpt",
        "pegasus_x",
        "perceiver",
        "prophetnet",
        "reformer",
        "rembert",
        "roformer",
        "rwkv",
        "squeezebert",
        "switch_transformers",
        "t5gemma",
        "tapas",
        "trocr",
        "vaultgemma",
        "xglm",
        "xlm",
        "xlnet",
        "xlstm",
        "yoso",
    }
)
# The config keys that set each shape, first match wins; the one list both the reader below
# and the value checks of _config.py use. Model types name a field apart: GPT-2 n_embd, T5
# d_model / num_layers / num_heads / d_ff, BART d_model / encoder_layers /
# encoder_attention_heads / encoder_ffn_dim (its decoder_* keys size the decoder).
SHAPE_KEYS: dict[str, tuple[str, ...]] = {
    "hidden size": ("hidden_size", "n_embd", "d_model", "dim"),
    "layers": ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "encoder_layers"),
    "decoder layers": ("num_decoder_layers", "decoder_layers"),
    "attention heads": (
        "num_attention_heads",
        "n_head",
        "num_heads",
        "n_heads",
        "encoder_attention_heads",
    ),
    "decoder attention heads": ("decoder_attention_heads",),
    "key/value heads": ("num_key_value_heads",),
    "head size": ("head_dim", "d_kv"),
    "intermediate size": (
        # MoE models with their own expert width (Qwen2/3-MoE: every layer routed to
        # experts this wide; their intermediate_size sizes dense layers, none by default)
        "moe_intermediate_size",
        "intermediate_size",
        "n_inner",
        "ffn_dim",
        "d_ff",
        "hidden_dim",
        "encoder_ffn_dim",
    ),
    "decoder intermediate size": ("decoder_ffn_dim",),
    "vocabulary": ("vocab_size",),
    "positions": ("max_position_embeddings", "n_positions"),
}
# Of those, the counts of layers (module lists), as opposed to widths.
DEPTH_SHAPES = ("layers", "decoder layers")

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
    # image models only (family "vision"): the config's image side, patch side and channels
    image_size: int = 0
    patch_size: int = 0
    num_channels: int = 0


def _first(cfg: dict[str, Any], *keys: str, default: Any = None) -> Any:
    """The value of the first of ``keys`` the config sets (model types name a field apart)."""
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    return default


def _family(mt: str) -> str:
    if mt in VISION_TYPES:
        return "vision"
    if mt in ENCODER_DECODER_TYPES:
        return "encoder-decoder"
    return "encoder" if mt in ENCODER_TYPES else "decoder"


def _positions(mt: str, cfg: dict[str, Any]) -> tuple[str, int | None]:
    """The position scheme and the longest sequence it has learned (None: no hard limit)."""
    max_pos = _first(cfg, *SHAPE_KEYS["positions"])
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
    # Learned-position decoders (GPT-2, OPT) and BART-style encoder-decoders use plain MLPs.
    gated = family == "decoder" and mt not in LEARNED_POSITION_TYPES
    return gated, act


def vision_arch(cfg: dict[str, Any]) -> Architecture:
    """An image model's shape: widths and depths of ViT-style stacks or of stages.

    CLIP and SigLIP keep the image tower under ``vision_config``; ConvNeXt, Swin and ResNet
    list a width (``hidden_sizes``, or Swin's ``embed_dim`` doubling) and a depth per stage.
    """
    mt = cfg.get("model_type", "")
    if isinstance(cfg.get("vision_config"), dict):
        cfg = {**cfg, **cfg["vision_config"]}
    depths = cfg.get("depths")
    stages = list(depths) if isinstance(depths, list) else []
    widths = cfg.get("hidden_sizes")
    if isinstance(widths, list) and widths:
        hidden = int(widths[-1])
    elif cfg.get("embed_dim") is not None and stages:  # Swin: the width doubles per stage
        hidden = int(cfg["embed_dim"]) * 2 ** (len(stages) - 1)
    else:
        hidden = int(_first(cfg, "hidden_size", "hidden_dim", default=0))
    layers = (
        sum(int(d) for d in stages) if stages else int(_first(cfg, "num_hidden_layers", default=0))
    )
    heads = _first(cfg, "num_attention_heads", "num_heads", default=1)
    heads = max(int(h) for h in heads) if isinstance(heads, list) else int(heads)
    inter = _first(cfg, "intermediate_size")
    return Architecture(
        model_type=mt,
        family="vision",
        hidden_size=hidden,
        num_layers=layers,
        num_decoder_layers=0,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads if heads else hidden,
        intermediate_size=int(inter) if inter is not None else 4 * hidden,
        vocab_size=0,
        max_positions=None,
        positional="patch" if mt in PATCH_ENCODER_TYPES else "none",
        gated_mlp=False,
        activation=str(_first(cfg, "hidden_act", default="gelu")),
        norm="layernorm",
        tied_embeddings=False,
        num_experts=0,
        experts_per_token=0,
        attention_dropout=float(_first(cfg, "attention_probs_dropout_prob", default=0.0)),
        hidden_dropout=float(_first(cfg, "hidden_dropout_prob", default=0.0)),
        image_size=int(_first(cfg, "image_size", default=224)),
        patch_size=int(_first(cfg, "patch_size", default=1)),
        num_channels=int(_first(cfg, "num_channels", default=3)),
    )


def arch_from_config(cfg: dict[str, Any]) -> Architecture:
    """Normalise a config.json dict's field names (GPT-2, BERT, T5, OPT, Llama, ViT, ...)."""
    mt = cfg.get("model_type", "")
    if mt in VISION_TYPES:
        return vision_arch(cfg)
    hidden = int(_first(cfg, *SHAPE_KEYS["hidden size"]))
    layers = int(_first(cfg, *SHAPE_KEYS["layers"]))
    heads = int(_first(cfg, *SHAPE_KEYS["attention heads"]))
    inter = _first(cfg, *SHAPE_KEYS["intermediate size"])
    kv_heads = int(_first(cfg, *SHAPE_KEYS["key/value heads"], default=heads))
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
        num_decoder_layers=int(_first(cfg, *SHAPE_KEYS["decoder layers"], default=layers))
        if family == "encoder-decoder"
        else 0,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=int(_first(cfg, *SHAPE_KEYS["head size"], default=hidden // heads)),
        intermediate_size=int(inter) if inter is not None else 4 * hidden,
        vocab_size=int(_first(cfg, *SHAPE_KEYS["vocabulary"])),
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
        if arch_name.endswith("ForImageClassification"):
            return "image-classification"
    mt = cfg.get("model_type", "")
    if mt in VISION_TYPES:
        return "image-classification"
    if mt in ENCODER_DECODER_TYPES:
        return "seq2seq"
    return "masked-lm" if mt in ENCODER_TYPES else "causal-lm"
