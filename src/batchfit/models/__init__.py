"""What is trained: resolve MODEL to architecture facts and an exact parameter table.

Catalog models resolve from shipped data without importing torch; config files outside the
catalog are built on the meta device (``_meta.py``) to count parameters exactly.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, cast

from batchfit import _cache, catalog
from batchfit._names import normalise, suggest
from batchfit._units import human_count, looks_like_count, parse_count
from batchfit.errors import UsageError
from batchfit.models import _meta, _torchvision
from batchfit.models._arch import (
    ATTENTION_FREE_TYPES,
    ENCODER_DECODER_TYPES,
    ENCODER_TYPES,
    KEEP_IN_FP32,
    NO_SDPA_TYPES,
    SHAPE_KEYS,
    VISION_TYPES,
    Architecture,
    arch_from_config,
    default_task,
)
from batchfit.models._config import LAYER_KEYS, existing_path, hub_cache_config, read_config_file
from batchfit.models._generic import generic_decoder_config, generic_rows
from batchfit.models._lora import all_linear, linear_weights, wrapped
from batchfit.models._meta import auto_class, make_config
from batchfit.models._torchvision import build as build_torchvision
from batchfit.spec import Attention, Task

__all__ = [
    "ATTENTION_FREE_TYPES",
    "DEFAULT_LORA_TARGETS",
    "ENCODER_DECODER_TYPES",
    "ENCODER_TYPES",
    "LAYER_KEYS",
    "Architecture",
    "ModelInfo",
    "ParamGroup",
    "arch_from_config",
    "auto_class",
    "build_torchvision",
    "catalog_names",
    "default_task",
    "generic_decoder_config",
    "make_config",
    "resolve_model",
]

# peft's TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING; the two marked entries are ours,
# for model types peft has no default for.
DEFAULT_LORA_TARGETS: dict[str, tuple[str, ...]] = {
    "gpt2": ("c_attn",),
    "bert": ("query", "value"),
    "roberta": ("query", "value"),
    "xlm-roberta": ("query", "value"),
    "t5": ("q", "v"),
    "mt5": ("q", "v"),
    "gpt_neox": ("query_key_value",),
    "deberta-v2": ("query_proj", "value_proj"),
    "deberta": ("in_proj",),
    "electra": ("query", "value"),
    "falcon": ("query_key_value",),
    "bloom": ("query_key_value",),
    "distilbert": ("q_lin", "v_lin"),  # ours: peft has no default
    "phi3": ("qkv_proj",),  # ours: peft has no default
    "modernbert": ("Wqkv",),  # ours: peft has no default; ModernBERT fuses q, k and v
    # image models: peft has none; its image-classification guide targets attention's query
    # and value, which transformers 5 names q_proj / v_proj in ViT, DeiT, BEiT, DINOv2, Swin,
    # CLIP and SigLIP alike; ConvNeXt has no attention, its pointwise linears are the target
    **dict.fromkeys(
        ("vit", "deit", "beit", "dinov2", "swin", "swinv2", "clip", "siglip"), ("q_proj", "v_proj")
    ),
    "convnext": ("pwconv1", "pwconv2"),
    "convnextv2": ("pwconv1", "pwconv2"),
}
_PEFT_GUESSED = frozenset({"distilbert", "phi3", "modernbert", "olmo2", "qwen3_moe"} | VISION_TYPES)

KIND_ORDER = ("embedding", "attention", "mlp", "experts", "norm", "head", "other")


@dataclass(frozen=True)
class ParamGroup:
    """Parameters sharing a name pattern (layer index folded to ``*``) and a shape."""

    pattern: str
    shape: tuple[int, ...]
    count: int
    module: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def total(self) -> int:
        return self.numel * self.count

    @property
    def leaf(self) -> str:
        """The owning module's name: ``q_proj`` for ``model.layers.*.self_attn.q_proj.weight``."""
        parts = self.pattern.split(".")
        return parts[-2] if len(parts) >= 2 else parts[0]

    @property
    def kind(self) -> str:
        return _param_kind(self.pattern, self.module)

    @property
    def is_matrix_weight(self) -> bool:
        return self.module in ("Linear", "Conv1D") and self.pattern.endswith("weight")


def _param_kind(pattern: str, module: str) -> str:
    name = pattern.lower()
    if "norm" in module.lower() or module in ("LayerNorm", "T5LayerNorm"):
        return "norm"
    if module == "Embedding" or "embed" in name or name.startswith("shared.") or "wte" in name:
        return "embedding" if "relative_attention_bias" not in name else "attention"
    if any(k in name for k in ("lm_head", "classifier", "score", "pooler", "cls.", "vocab_")):
        return "head"
    if "expert" in name:
        return "experts"
    if any(k in name for k in ("attn", "attention", "q_lin", "k_lin", "v_lin", "out_lin")):
        return "attention"
    if any(
        k in name
        for k in (
            "mlp",
            "ffn",
            "intermediate",
            "output.dense",
            "densereludense",
            "fc1",
            "fc2",
            "layer.1.",
            "layer.2.",
            "moe",
            "gate",
        )
    ):
        return "mlp"
    return "other"


@dataclass(frozen=True)
class ModelInfo:
    """A resolved MODEL: its config, architecture, task and parameter table."""

    name: str
    hub_id: str | None
    config: dict[str, Any]
    arch: Architecture
    task: Task
    params: tuple[ParamGroup, ...]
    warnings: tuple[str, ...] = ()

    @property
    def total_params(self) -> int:
        return sum(g.total for g in self.params)

    @property
    def supports_sdpa(self) -> bool:
        """Whether transformers' model class runs SDPA attention (its ``_supports_sdpa``)."""
        return self.arch.model_type not in NO_SDPA_TYPES | ATTENTION_FREE_TYPES

    @property
    def supports_grad_ckpt(self) -> bool:
        """Whether transformers can checkpoint this model's layers (``--grad-ckpt``).

        Every catalog language model can; of the image models, the convolutional ones
        (ConvNeXt, ResNet: ``supports_gradient_checkpointing = False``) cannot. Asked of an
        image model, this reads the class from transformers (imported: seconds) or from the
        cache, which keeps the answer per model type, task and transformers version.
        """
        if self.arch.family != "vision":
            return True
        if self.arch.model_type == "torchvision":
            return False
        key = {"model_type": self.arch.model_type, "task": self.task}
        record = _cache.load("grad-ckpt", key)
        if record is not None and isinstance(record.get("supported"), bool):
            return bool(record["supported"])
        cls = _meta.model_class(self.config, self.task)
        supported = bool(getattr(cls, "supports_gradient_checkpointing", False))
        _cache.store("grad-ckpt", key, {"supported": supported})
        return supported

    def resolve_attention(self, requested: Attention) -> Attention:
        """``--attention`` made concrete for this model class, as transformers resolves it.

        ``auto`` is SDPA where the class supports it, else eager (transformers'
        ``get_correct_attn_implementation``); other choices are kept.

        Example:
            >>> resolve_model("gpt2").resolve_attention("auto")
            'sdpa'

        Raises:
            UsageError: ``sdpa`` asked of a model class without it (transformers raises too).
        """
        if requested == "auto":
            return "sdpa" if self.supports_sdpa else "eager"
        if requested == "sdpa" and not self.supports_sdpa:
            raise UsageError(
                f"--attention sdpa: transformers has no SDPA attention for "
                f"{self.arch.model_type} models; use --attention eager (or auto)"
            )
        return requested

    def params_by_kind(self) -> dict[str, int]:
        out = dict.fromkeys(KIND_ORDER, 0)
        for group in self.params:
            out[group.kind] += group.total
        return {k: v for k, v in out.items() if v}

    def default_lora_targets(self) -> tuple[str, ...]:
        mt = self.arch.model_type
        return DEFAULT_LORA_TARGETS.get(mt, ("q_proj", "v_proj"))

    @property
    def lora_targets_guessed(self) -> bool:
        """peft has no default LoRA targets for this model type; ours are a guess."""
        return self.arch.model_type in _PEFT_GUESSED

    def guessed_targets_warning(self, lora_targets: tuple[str, ...] | None) -> str | None:
        """The warning for LoRA on this model without ``--lora-targets`` when peft has no
        defaults for its type (ours are a guess), else None."""
        if lora_targets is not None or not self.lora_targets_guessed:
            return None
        return (
            f"peft has no default LoRA targets for {self.arch.model_type}: assumed "
            f"{','.join(self.default_lora_targets())} (set --lora-targets)"
        )

    def lora_params(self, rank: int, targets: Iterable[str] | None = None) -> int:
        """Trainable LoRA parameters: ``rank * (in + out)`` per targeted module (peft LoraLayer).

        Raises:
            UsageError: no module matches the targets.
        """
        return sum(rank * sum(g.shape[:2]) * g.count for g in self.lora_groups(targets))

    def lora_target_names(self, targets: Iterable[str] | None = None) -> tuple[str, ...]:
        """The modules LoRA wraps: ``targets``, the defaults for None, and for ``all-linear``
        (peft's shorthand) every linear module's name but the output head's.

        Example:
            >>> resolve_model("gpt2").lora_target_names(["all-linear"])
            ('c_attn', 'c_fc', 'c_proj')
        """
        wanted = tuple(targets) if targets is not None else self.default_lora_targets()
        return all_linear(self.params) if wanted == ("all-linear",) else wanted

    def linear_weights(self) -> list[ParamGroup]:
        """The linear modules' weights but the output head's (peft's ``all-linear``)."""
        return linear_weights(self.params)

    def lora_groups(self, targets: Iterable[str] | None = None) -> list[ParamGroup]:
        """The weights peft wraps for ``targets``: a LoRA-capable module's 2-D weight whose
        path is a target or ends with ``.target`` (peft's ``check_target_module_exists``).

        Raises:
            UsageError: a target matches no module (the default targets when None).
        """
        return wrapped(self.name, self.params, self.lora_target_names(targets), targets is None)

    def quantizable_params(self, head: bool = False) -> int:
        """Parameters bitsandbytes quantises for QLoRA: Linear weights, not the output head
        unless ``head`` (Lightning's plugin replaces every ``nn.Linear``; a tied head stays).

        transformers' ``get_keys_to_not_convert`` keeps the output embedding in 16-bit. Fused
        MoE expert tensors (transformers 5 stores each layer's experts as one 3-D parameter)
        are not ``nn.Linear``: transformers' conversion skips them and they stay unquantised
        (``replace_with_bnb_linear`` converts ``nn.Linear`` and ``Conv1D`` only, transformers
        5.24.0 integrations/bitsandbytes.py:189; bitsandbytes-foundation/bitsandbytes#1849),
        as the trace's emulation does; nor are modules kept in fp32 (T5's ``wo``).
        """
        return sum(
            g.total
            for g in self.params
            if g.module in ("Linear", "Conv1D")
            and g.pattern.endswith("weight")
            and (head or g.kind != "head")
            and g.pattern.split(".")[-2] not in KEEP_IN_FP32.get(self.arch.model_type, ())
        )

    def fused_expert_params(self) -> int:
        """Parameters in fused 3-D MoE expert tensors (transformers 5)."""
        return sum(g.total for g in self.params if g.kind == "experts" and len(g.shape) == 3)


@cache
def _catalog_index() -> dict[str, dict[str, Any]]:
    index: dict[str, dict[str, Any]] = {}
    for entry in catalog.load("models")["models"]:
        for key in (entry["name"], entry["hub_id"], *entry.get("aliases", ())):
            index[normalise(key)] = entry
            index[normalise(key.split("/")[-1])] = index.get(normalise(key.split("/")[-1]), entry)
    return index


def catalog_names() -> list[str]:
    return [entry["name"] for entry in catalog.load("models")["models"]]


def resolve_model(spec: str | os.PathLike[str], task: str | None = None) -> ModelInfo:
    """Resolve MODEL: a catalog name or hub id, a config.json path or folder, or a size (7B).

    Example:
        >>> info = resolve_model("gpt2")
        >>> info.task, info.total_params
        ('causal-lm', 124439808)

    Raises:
        TypeError: ``spec`` is not a string or a path.
        UsageError: MODEL names nothing readable, or its config.json is malformed.
    """
    if not isinstance(spec, str | os.PathLike):
        raise TypeError(
            f"MODEL must be a str or a path (a catalog name, a config.json, or a size such as "
            f"'7B'), got {type(spec).__name__} {spec!r}"
        )
    text = os.fspath(spec).strip()
    if not text:
        raise UsageError("MODEL is empty: give a catalog name, a config.json path, or a size")
    entry = _catalog_index().get(normalise(text))
    if entry is not None:
        return _from_catalog(entry, task)
    path = existing_path(text)
    if path is not None:
        return _from_config_file(path, task)
    if looks_like_count(text):
        return _from_size(parse_count(text), task)
    cached = hub_cache_config(text)
    if cached is not None:
        return _from_config_file(cached, task, hub_id=text)

    tv_name = _torchvision.lookup(text)
    if tv_name is not None:
        return _from_torchvision(tv_name, task)
    raise UsageError(
        f"unknown model {spec!r}{suggest(text, catalog_names())}: give a catalog name "
        "(`batchfit models`), a path to a config.json or its folder, or a size such as 7B"
    )


def _check_task(task: str | None, cfg: dict[str, Any]) -> Task:
    chosen = cast(Task, task or default_task(cfg))
    mt = cfg.get("model_type", "")
    if chosen == "seq2seq" and mt not in ENCODER_DECODER_TYPES:
        raise UsageError(f"--task seq2seq needs an encoder-decoder model; {mt} is not one")
    if chosen == "causal-lm" and mt in ENCODER_TYPES:
        raise UsageError(f"{mt} is an encoder: use --task masked-lm or classification")
    if (chosen == "image-classification") != (mt in VISION_TYPES):
        if mt in VISION_TYPES:
            raise UsageError(f"{mt} is an image model: use --task image-classification")
        raise UsageError(
            f"--task image-classification needs an image model (ViT, DeiT, ConvNeXt, Swin, "
            f"CLIP, ResNet, ...); {mt or 'this model'} is not one"
        )
    return chosen


def _from_catalog(entry: dict[str, Any], task: str | None) -> ModelInfo:
    cfg = entry["config"]
    chosen = _check_task(task, cfg)
    rows = catalog.load("derived")["models"].get(entry["name"], {}).get(chosen)
    if rows is None:
        rows = _meta.param_table(_meta.build_on_meta(cfg, chosen))
    return ModelInfo(
        name=entry["name"],
        hub_id=entry["hub_id"],
        config=cfg,
        arch=arch_from_config(cfg),
        task=chosen,
        params=_groups(rows),
    )


def _groups(rows: Iterable[list[Any]]) -> tuple[ParamGroup, ...]:
    return tuple(ParamGroup(r[0], tuple(r[1]), int(r[2]), r[3]) for r in rows)


def _from_config_file(path: Path, task: str | None, hub_id: str | None = None) -> ModelInfo:
    raw = read_config_file(path)
    chosen = _check_task(task, raw)
    rows, full = _meta.describe(raw, chosen)
    full["model_type"] = raw["model_type"]
    try:
        arch = arch_from_config(full)
    except (KeyError, TypeError, ValueError) as e:
        raise UsageError(f"{path}: cannot read the model's shape from its config ({e})") from None
    return ModelInfo(
        name=hub_id or str(path),
        hub_id=hub_id,
        config=full,
        arch=arch,
        task=chosen,
        params=_groups(rows),
        warnings=_defaults_used(raw, arch),
    )


# The shapes a minimal config.json may leave to transformers' defaults, said in a warning.
_DEFAULTED_SHAPES = ("hidden size", "layers", "attention heads", "intermediate size", "vocabulary")


def _defaults_used(raw: dict[str, Any], arch: Architecture) -> tuple[str, ...]:
    """Say which shapes a minimal config.json left to transformers' defaults."""
    if arch.family == "vision":
        return ()  # image models' shapes are stage lists, checked by transformers' build
    values = {
        "hidden size": arch.hidden_size,
        "layers": arch.num_layers,
        "attention heads": arch.num_heads,
        "intermediate size": arch.intermediate_size,
        "vocabulary": arch.vocab_size,
    }
    missing = [
        f"{name} {values[name]}"
        for name in _DEFAULTED_SHAPES
        if not any(k in raw for k in SHAPE_KEYS[name])
    ]
    if not missing:
        return ()
    return (
        f"config.json does not set {', '.join(missing)}: transformers' defaults for "
        f"{raw.get('model_type')} are used",
    )


def _from_torchvision(name: str, task: str | None) -> ModelInfo:
    """A torchvision classifier, built on the meta device to count its parameters."""
    # lazy: torch (~1 s), only to count a torchvision model's parameters
    import torch

    cfg = _torchvision.config(name)
    chosen = _check_task(task, cfg)
    with torch.device("meta"):
        rows = _meta.param_table(_torchvision.build(cfg))
    return ModelInfo(
        name=f"torchvision:{name}",
        hub_id=None,
        config=cfg,
        arch=arch_from_config(cfg),
        task=chosen,
        params=_groups(rows),
    )


def _from_size(num_params: int, task: str | None) -> ModelInfo:
    cfg = generic_decoder_config(num_params)
    chosen = _check_task(task, cfg)
    if chosen != "causal-lm":
        raise UsageError("a bare size means a generic decoder: only --task causal-lm applies")
    arch = arch_from_config(cfg)
    info = ModelInfo(
        name=f"generic-{human_count(num_params)}",
        hub_id=None,
        config=cfg,
        arch=arch,
        task=chosen,
        params=_groups(generic_rows(cfg)),
    )
    note = (
        f"{human_count(num_params)} is a bare size: assuming a Llama-style decoder with "
        f"{arch.num_layers} layers, hidden {arch.hidden_size}, vocabulary {arch.vocab_size} "
        f"({human_count(info.total_params)} parameters); give a config.json for exact figures"
    )
    return ModelInfo(**{**info.__dict__, "warnings": (note,)})
