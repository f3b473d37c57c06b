"""Find and read the config.json a MODEL names (a path, or the Hugging Face cache), and check
its values before transformers sees them.

transformers takes a config's values on trust: NaN, strings, floats or zero where a size goes
surface as tracebacks from deep inside a model's constructor, or as a silent estimate of a
model that cannot exist. Every size is checked here, with one line naming key, value and file.
"""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path
from typing import Any

from batchfit.errors import UsageError
from batchfit.models._arch import DEPTH_SHAPES, SHAPE_KEYS

# Hugging Face config.json files are a few KiB; a sharded model's index is the largest JSON
# beside them (about 100 KiB). Anything past this is not a config.
MAX_CONFIG_BYTES = 10 * 2**20

# Widths (hidden, heads, vocabulary, positions, ...): torch indexes tensors with int64, but
# index kernels and position buffers take int32.
_MAX_WIDTH = 2**31 - 1
# Counts that transformers turns into Python lists or module lists, one entry each.
_MAX_REPEATS = 2**20

# Keys that must be positive integers where present: the shape keys arch_from_config reads
# (one list, _arch.SHAPE_KEYS), split into layer counts and widths.
LAYER_KEYS = frozenset(k for shape in DEPTH_SHAPES for k in SHAPE_KEYS[shape])
_WIDTH_KEYS = frozenset(k for keys in SHAPE_KEYS.values() for k in keys) - LAYER_KEYS
# Counts where 0 means "none" (a dense model has no experts).
_COUNT_KEYS = frozenset({"num_local_experts", "num_experts", "num_experts_per_tok"})
# Sizes an image model may list per stage (Swin's num_heads, ConvNeXt's hidden_sizes).
_STAGE_KEYS = frozenset({"num_heads", "hidden_sizes", "depths"})
# Dropout probabilities (torch.nn.Dropout takes 0 <= p <= 1); null means "no dropout layer".
_PROBABILITY_KEYS = frozenset(
    {
        "dropout_rate",
        "hidden_dropout_prob",
        "resid_pdrop",
        "embd_pdrop",
        "attn_pdrop",
        "dropout",
        "hidden_dropout",
        "attention_probs_dropout_prob",
        "attention_dropout",
        "activation_dropout",
        "classifier_dropout",
    }
)
# Activation names, looked up in transformers' ACT2FN.
_TEXT_KEYS = frozenset({"hidden_act", "activation_function", "feed_forward_proj"})
# transformers reads null as "use the default" for these (GPT-2 ships "n_inner": null).
_NULLABLE = frozenset({"n_inner", "head_dim", "num_key_value_heads"}) | _COUNT_KEYS


def read_config_file(path: Path) -> dict[str, Any]:
    """Read and check a config.json (or a folder holding one), with one-line errors."""
    file = path / "config.json" if _is_dir(path) else path
    try:
        info = file.stat()
    except FileNotFoundError:
        raise UsageError(f"{path} has no config.json") from None
    except OSError as e:
        raise UsageError(f"cannot read {file}: {e.strerror or e}") from None
    # A FIFO or a device (/dev/zero) would be read forever: only regular files are configs.
    if not stat.S_ISREG(info.st_mode):
        raise UsageError(f"{file} is not a regular file: give a config.json or its folder")
    text = _read_bounded(file)
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"{file} is not valid JSON (line {e.lineno}): {e.msg}") from None
    if not isinstance(cfg, dict) or "model_type" not in cfg:
        raise UsageError(f'{file} has no "model_type": is it a Hugging Face config.json?')
    check_config_values(cfg, file)
    return cfg


def _is_dir(path: Path) -> bool:
    try:
        return stat.S_ISDIR(path.stat().st_mode)
    except FileNotFoundError:
        return False
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror or e}") from None


def _read_bounded(file: Path) -> str:
    """The file's text, refusing more than MAX_CONFIG_BYTES (st_size is 0 for /proc files)."""
    try:
        with open(file, "rb") as handle:
            data = handle.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise UsageError(f"cannot read {file}: {e.strerror or e}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise UsageError(
            f"{file} is over {MAX_CONFIG_BYTES // 2**20} MiB: not a config.json "
            "(give the model's config.json or its folder)"
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"cannot read {file}: not UTF-8 text ({e.reason})") from None


def check_config_values(cfg: dict[str, Any], file: os.PathLike[str] | str) -> None:
    """Refuse values transformers would crash on or estimate silently, naming key and file.

    Raises:
        UsageError: a number is not finite, a size is not a positive integer within bounds,
            or a field has the wrong type.
    """
    _check_finite(cfg, "", file)
    if not isinstance(cfg["model_type"], str) or not cfg["model_type"]:
        _bad(file, "model_type", cfg["model_type"], "a model type name such as llama")
    archs = cfg.get("architectures")
    if archs is not None and (
        not isinstance(archs, list) or not all(isinstance(a, str) for a in archs)
    ):
        _bad(file, "architectures", archs, 'a list of class names such as ["LlamaForCausalLM"]')
    for key, value in cfg.items():
        if key in _STAGE_KEYS and isinstance(value, list):  # Swin: heads per stage
            for index, item in enumerate(value):
                _check_size(file, f"{key}[{index}]", item)
        elif key in _WIDTH_KEYS or key in LAYER_KEYS or key in _COUNT_KEYS:
            _check_size(file, key, value)
        elif key in _PROBABILITY_KEYS and value is not None:
            is_number = isinstance(value, int | float) and not isinstance(value, bool)
            if not is_number or not 0 <= value <= 1:
                _bad(file, key, value, "a probability between 0 and 1")
        elif key in _TEXT_KEYS and not isinstance(value, str):
            _bad(file, key, value, "a name such as gelu")
        elif key == "tie_word_embeddings" and not isinstance(value, bool):
            _bad(file, key, value, "true or false")


def _check_finite(value: Any, where: str, file: os.PathLike[str] | str) -> None:
    """NaN and Infinity (which Python's json accepts) anywhere in the config, nested too."""
    if isinstance(value, float) and not math.isfinite(value):
        _bad(file, where, value, "a finite number")
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_finite(item, f"{where}.{key}" if where else str(key), file)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _check_finite(item, f"{where}[{index}]", file)


def _check_size(file: os.PathLike[str] | str, key: str, value: Any) -> None:
    if value is None and key in _NULLABLE:
        return
    low = 0 if key in _COUNT_KEYS else 1
    high = _MAX_WIDTH if key in _WIDTH_KEYS else _MAX_REPEATS
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if not is_int or not low <= value <= high:
        kind = "a non-negative" if low == 0 else "a positive"
        _bad(file, key, value, f"{kind} integer up to {high:,}")


def _bad(file: os.PathLike[str] | str, key: str, value: Any, wanted: str) -> None:
    shown = repr(value) if not isinstance(value, float) or math.isfinite(value) else str(value)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    raise UsageError(f"{file}: {key} is {shown}, expected {wanted}")


def existing_path(text: str) -> Path | None:
    """``text`` as a path when something is there; OS errors as one line, not a traceback."""
    shown = text if len(text) <= 80 else text[:77] + "..."
    try:
        path = Path(text).expanduser()
    except RuntimeError:  # pathlib: "Could not determine home directory" for ~nosuchuser
        raise UsageError(f"MODEL {shown!r}: no such user's home directory") from None
    try:
        os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:  # ENAMETOOLONG, EACCES, ELOOP, ...
        raise UsageError(f"MODEL {shown!r}: {e.strerror or e}") from None
    return path


def hub_cache_config(hub_id: str) -> Path | None:
    """A config.json for ``org/name`` in the local Hugging Face cache, if one is there."""
    if hub_id.count("/") != 1:
        return None
    root = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME", os.path.expanduser("~/.cache/huggingface")), "hub"
    )
    snapshots = Path(root) / f"models--{hub_id.replace('/', '--')}" / "snapshots"
    try:
        if not snapshots.is_dir():
            return None
        configs = [d / "config.json" for d in snapshots.iterdir()]
        found = sorted((p.stat().st_mtime, p) for p in configs if p.exists())
    except OSError as e:  # an unreadable cache folder: say which, in one line
        raise UsageError(
            f"cannot read the Hugging Face cache at {snapshots}: {e.strerror or e}"
        ) from None
    return found[-1][1] if found else None
