"""Build a transformers model on the meta device and tabulate its parameters.

Imports torch and transformers: used for configs outside the catalog and by
``scripts/gen_catalog.py``, never on the catalog fast path.
"""

from __future__ import annotations

import copy
import json
import re
import warnings
from typing import Any

from batchfit import _cache
from batchfit.errors import UsageError
from batchfit.models._config import LAYER_KEYS

_LAYER_INDEX = re.compile(r"\.(\d+)\.")
_AUTO_CLASS = {
    "causal-lm": "AutoModelForCausalLM",
    "masked-lm": "AutoModelForMaskedLM",
    "classification": "AutoModelForSequenceClassification",
    "seq2seq": "AutoModelForSeq2SeqLM",
    "image-classification": "AutoModelForImageClassification",
}


def _first_sentence(error: BaseException, limit: int = 200) -> str:
    """transformers' errors can list every model type it knows: keep the first sentence."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    # "Class validation error for validator 'x':" then the reason on the next line
    text = lines[1] if lines[0].endswith(":") and len(lines) > 1 else lines[0]
    text = text.split(". ")[0]
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _strict_config_errors() -> tuple[type[Exception], ...]:
    """transformers 5 validates configs through huggingface_hub's strict dataclasses, whose
    errors are not ValueErrors (a hidden size that the heads do not divide)."""
    try:
        # lazy: transformers and torch (~2 s) load only when a model is built
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:  # older huggingface_hub: configs are not validated there
        return ()
    return (StrictDataclassError,)


def make_config(config: dict[str, Any], task: str) -> Any:
    """A transformers config object from a config.json dict (transformers fills defaults)."""
    # lazy: transformers and torch (~2 s) load only when a model is built
    import transformers

    # a deep copy: transformers edits nested values in place (it adds rope_theta to a
    # rope_scaling dict), and the caller's dict is what the trace cache is keyed by
    fields = {
        k: copy.deepcopy(v)
        for k, v in config.items()
        if k not in ("model_type", "transformers_version")
    }
    rejected: tuple[type[Exception], ...] = (ValueError, KeyError, TypeError)
    try:
        cfg = transformers.AutoConfig.for_model(config["model_type"], **fields)
    except rejected + _strict_config_errors() as e:
        raise UsageError(
            f"transformers cannot read this config (model_type {config.get('model_type')!r}): "
            f"{_first_sentence(e)}"
        ) from e
    if task == "image-classification" and not getattr(cfg, "architectures", None):
        # DeiT maps to two classes (with and without the distillation head); transformers
        # picks by ``architectures`` and fails without it: the plain classifier is meant
        # lazy: transformers and torch (~2 s) load only when a model is built
        from transformers.models.auto import modeling_auto

        names = modeling_auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES.get(config["model_type"])
        if isinstance(names, tuple | list):
            cfg.architectures = [names[0]]
    if task == "classification":
        if "num_labels" not in config and "id2label" not in config:
            cfg.num_labels = 2
        # Sequence classification pools the last non-pad token and refuses a batch of more
        # than one without a pad token (GPT-2 has none): users set it to eos, as we do.
        if getattr(cfg, "pad_token_id", None) is None and _eos_id(cfg) is not None:
            cfg.pad_token_id = _eos_id(cfg)
        # What the models infer from integer labels; said here because DeBERTa, left to
        # infer it, selects labelled rows with nonzero(), whose shape a dry run cannot know.
        if getattr(cfg, "problem_type", None) is None and (cfg.num_labels or 0) > 1:
            cfg.problem_type = "single_label_classification"
    return cfg


def _eos_id(cfg: Any) -> int | None:
    """The config's end-of-sequence id (the first, where it lists several)."""
    eos = getattr(cfg, "eos_token_id", None)
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    return eos if isinstance(eos, int) else None


def auto_class(task: str) -> Any:
    """transformers' auto class that builds a model for ``task`` (``AutoModelForCausalLM``, ...)."""
    # lazy: transformers and torch (~2 s) load only when a model is built
    import transformers

    return getattr(transformers, _AUTO_CLASS[task])


def model_class(config: dict[str, Any], task: str) -> Any:
    """The transformers class ``task``'s auto class builds for ``config`` (nothing built)."""
    cfg = make_config(config, task)
    return auto_class(task)._model_mapping[type(cfg)]


def build_on_meta(config: dict[str, Any], task: str) -> Any:
    """Instantiate the task's model class on the meta device: shapes only, no memory."""
    # lazy: transformers and torch (~2 s) load only when a model is built
    import torch

    # lazy: transformers and torch (~2 s) load only when a model is built
    import transformers

    cfg = make_config(config, task)
    auto = getattr(transformers, _AUTO_CLASS[task])
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return auto.from_config(cfg)
        except KeyError as e:  # a value transformers looks up by name: hidden_act, rope type
            raise UsageError(
                f"transformers cannot build this config (model_type "
                f"{config.get('model_type')!r}): unknown name {e}"
            ) from e
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


# Stacks deeper than this are counted from a few layers: a meta build of 100,000 layers takes
# minutes and gigabytes, and every row's count is affine in the depth, one period of layer
# types at a time. Shallower stacks are built whole, as before.
EXTRAPOLATE_ABOVE_LAYERS = 256
# Small builds start this deep, past the special first layers some models have (DeepSeek's
# first_k_dense_replace, T5's relative attention bias in block 0).
_BASE_LAYERS = 8
# Periods of alternating layer types to try (Gemma 2: 2; Gemma 3: 6; Llama 4 MoE steps: 2, 4).
_PERIODS = (1, 2, 3, 4, 6, 8)


def count_params(
    config: dict[str, Any], task: str, *, extrapolate_above: int = EXTRAPOLATE_ABOVE_LAYERS
) -> list[list[Any]]:
    """``param_table`` of the model, counting stacks deeper than ``extrapolate_above`` exactly
    from a few small builds instead of building every layer.

    For a period ``p`` the stack is built at depths ``n``, ``n + p`` and ``n + 2p`` (``n`` as
    deep as ``L`` modulo ``p``); the third build checks that the counts grow linearly, and
    per-layer lists in the config must repeat with period ``p``. When no period checks out,
    the whole model is built.
    """
    floor = max(extrapolate_above, _BASE_LAYERS)
    depths: dict[int, list[str]] = {}
    for key, value in config.items():
        if key in LAYER_KEYS and isinstance(value, int) and value > floor:
            depths.setdefault(value, []).append(key)
    for period in _PERIODS if depths else ():
        rows = _extrapolate(config, task, depths, period)
        if rows is not None:
            return rows
    return param_table(build_on_meta(config, task))


def _extrapolate(
    config: dict[str, Any], task: str, depths: dict[int, list[str]], period: int
) -> list[list[Any]] | None:
    lists = {k: v for k, v in config.items() if isinstance(v, list) and len(v) in depths}
    for values in lists.values():
        if any(values[i] != values[i - period] for i in range(_BASE_LAYERS + period, len(values))):
            return None
    start = {depth: _BASE_LAYERS + (depth - _BASE_LAYERS) % period for depth in depths}

    def table(shift: dict[int, int]) -> dict[tuple[str, tuple[int, ...]], list[Any]]:
        small = dict(config)
        for depth, keys in depths.items():
            small.update(dict.fromkeys(keys, start[depth] + shift.get(depth, 0)))
        for key, values in lists.items():
            small[key] = values[: start[len(values)] + shift.get(len(values), 0)]
        rows = param_table(build_on_meta(small, task))
        return {(r[0], tuple(r[1])): r for r in rows}

    base = table({})
    steps = {depth: table({depth: period}) for depth in depths}
    check = table(dict.fromkeys(depths, 2 * period))
    out: dict[tuple[str, tuple[int, ...]], list[Any]] = {}
    for key in [*base, *(k for s in (*steps.values(), check) for k in s)]:
        if key in out:
            continue
        count0 = base[key][2] if key in base else 0
        grow = {d: (s[key][2] if key in s else 0) - count0 for d, s in steps.items()}
        checked = check[key][2] if key in check else 0
        if checked != count0 + 2 * sum(grow.values()):
            return None
        count = count0 + sum(g * (d - start[d]) // period for d, g in grow.items())
        row = base.get(key) or next(s[key] for s in (*steps.values(), check) if key in s)
        out[key] = [row[0], row[1], count, row[3]]
    return [row for row in out.values() if row[2]]


def describe(raw: dict[str, Any], task: str) -> tuple[list[list[Any]], dict[str, Any]]:
    """A config file's parameter table (``count_params``) and its whole config, transformers'
    defaults filled in; from the cache when the same config and task were described before
    (keyed with the versions): a later question about the file, not only the same one
    replayed, then needs neither torch nor transformers."""
    key = {"config": raw, "task": task}
    record = _cache.load("config-file", key)
    if record is not None:
        try:
            return [list(row) for row in record["rows"]], dict(record["full"])
        except (KeyError, TypeError, ValueError):
            pass  # a record of another shape: describe it again
    rows = count_params(raw, task)
    full = {k: v for k, v in make_config(raw, task).to_dict().items() if not k.startswith("_")}
    try:  # as a cached record reads back (JSON: string keys, lists), so cold and warm agree
        rows, full = json.loads(json.dumps([rows, full]))
    except (TypeError, ValueError):
        return rows, full  # not JSON: not cached
    _cache.store("config-file", key, {"rows": rows, "full": full})
    return rows, full
