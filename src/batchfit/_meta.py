"""Build a transformers model on the meta device and tabulate its parameters.

Imports torch and transformers: used for configs outside the catalog and by
``scripts/gen_catalog.py``, never on the catalog fast path.
"""

from __future__ import annotations

import re
import warnings
from typing import Any

from batchfit.errors import UsageError

_LAYER_INDEX = re.compile(r"\.(\d+)\.")
_AUTO_CLASS = {
    "causal-lm": "AutoModelForCausalLM",
    "masked-lm": "AutoModelForMaskedLM",
    "classification": "AutoModelForSequenceClassification",
    "seq2seq": "AutoModelForSeq2SeqLM",
}


def _first_sentence(error: BaseException, limit: int = 200) -> str:
    """transformers' errors can list every model type it knows: keep the first sentence."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    text = text.split(". ")[0]
    return text if len(text) <= limit else text[: limit - 3] + "..."


def make_config(config: dict[str, Any], task: str) -> Any:
    """A transformers config object from a config.json dict (transformers fills defaults)."""
    import transformers

    fields = {k: v for k, v in config.items() if k not in ("model_type", "transformers_version")}
    try:
        cfg = transformers.AutoConfig.for_model(config["model_type"], **fields)
    except (ValueError, KeyError, TypeError) as e:
        raise UsageError(
            f"transformers cannot read this config (model_type {config.get('model_type')!r}): "
            f"{_first_sentence(e)}"
        ) from e
    if task == "classification" and "num_labels" not in config and "id2label" not in config:
        cfg.num_labels = 2
    return cfg


def build_on_meta(config: dict[str, Any], task: str) -> Any:
    """Instantiate the task's model class on the meta device: shapes only, no memory."""
    import torch
    import transformers

    cfg = make_config(config, task)
    auto = getattr(transformers, _AUTO_CLASS[task])
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return auto.from_config(cfg)
        except ValueError as e:
            raise UsageError(
                f"{config.get('model_type')!r} has no {task} model in transformers "
                f"(pick another --task): {_first_sentence(e)}"
            ) from e


def param_table(model: Any) -> list[list[Any]]:
    """Rows ``[pattern, shape, count, module_class]``, layer indices folded into ``*``.

    Tied parameters appear once (``named_parameters`` de-duplicates them).
    """
    owner = {}
    for module_name, module in model.named_modules():
        for param_name, _ in module.named_parameters(recurse=False):
            full = f"{module_name}.{param_name}" if module_name else param_name
            owner[full] = type(module).__name__
    rows: dict[tuple[str, tuple[int, ...]], list[Any]] = {}
    for name, param in model.named_parameters():
        pattern = _LAYER_INDEX.sub(".*.", f".{name}.")[1:-1]
        pattern = _LAYER_INDEX.sub(".*.", f".{pattern}.")[1:-1]
        key = (pattern, tuple(param.shape))
        if key in rows:
            rows[key][2] += 1
        else:
            rows[key] = [pattern, list(param.shape), 1, owner.get(name, "")]
    return list(rows.values())
