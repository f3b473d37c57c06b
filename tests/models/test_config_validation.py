"""MODEL and its config.json: bad values and bad files give one UsageError line, never a
traceback from transformers, a silent estimate, or a read that never ends."""

import json
import os
import re
from pathlib import Path

import pytest

from batchfit.errors import UsageError
from batchfit.models import resolve_model
from batchfit.models._config import MAX_CONFIG_BYTES

TINY_GPT2 = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 100}


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.json"
    path.write_text(text)
    return path


def _refused(path: Path | str, *needles: str) -> str:
    with pytest.raises(UsageError) as caught:
        resolve_model(str(path))
    message = str(caught.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, message
    return message


@pytest.mark.parametrize(
    ("key", "raw_value", "shown"),
    [
        ("n_embd", "NaN", "nan"),
        ("n_embd", "Infinity", "inf"),
        ("n_embd", '"64"', "'64'"),
        ("n_embd", "64.0", "64.0"),
        ("n_embd", '{"a": 1}', "{'a': 1}"),
        ("n_embd", "null", "None"),
        ("n_embd", "1e300", "1e+300"),
        ("n_embd", "0", "0"),
        ("n_embd", "-64", "-64"),
        ("n_embd", "1" + "0" * 40, "1000"),
        ("n_head", "0", "0"),  # hidden // heads divided by zero
        ("n_layer", "-1", "-1"),
        ("n_layer", "0", "0"),
        ("n_layer", "true", "True"),
        ("vocab_size", "0", "0"),
        ("n_positions", "-5", "-5"),
        ("n_inner", '"big"', "'big'"),
        ("resid_pdrop", '"0.1"', "'0.1'"),
        ("resid_pdrop", "NaN", "nan"),
        ("activation_function", "{}", "{}"),
        ("architectures", '"GPT2LMHeadModel"', "'GPT2LMHeadModel'"),
        ("architectures", "[1]", "[1]"),
        ("model_type", "7", "7"),
    ],
)
def test_bad_config_values_name_key_value_and_file(tmp_path, key, raw_value, shown):
    text = json.dumps(TINY_GPT2)[:-1] + f', "{key}": {raw_value}}}'
    path = _write(tmp_path, text)
    _refused(path, f"{key} is {shown}", str(path))


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ({"model_type": "llama", "num_key_value_heads": 0}, "num_key_value_heads is 0"),
        ({"model_type": "mixtral", "num_local_experts": -1}, "num_local_experts is -1"),
        ({"model_type": "llama", "rope_scaling": {"factor": "NaN"}}, "rope_scaling.factor"),
    ],
)
def test_bad_values_in_other_model_types(tmp_path, extra, needle):
    cfg = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 99}
    text = json.dumps({**cfg, **extra}).replace('"NaN"', "NaN")
    _refused(_write(tmp_path, text), needle)


def test_zero_layers_are_refused_when_read_not_blamed_on_lora_targets(tmp_path):
    cfg = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 99}
    path = _write(tmp_path, json.dumps({**cfg, "num_hidden_layers": 0}))
    _refused(path, "num_hidden_layers is 0")


def test_real_configs_still_resolve(tmp_path):
    path = _write(tmp_path, json.dumps({**TINY_GPT2, "n_inner": None, "resid_pdrop": 0.1}))
    assert resolve_model(str(path)).arch.num_layers == 2


def test_model_must_be_text_or_a_path(tmp_path):
    with pytest.raises(TypeError, match="MODEL must be a str or a path"):
        resolve_model(None)  # type: ignore[arg-type]
    assert resolve_model(_write(tmp_path, json.dumps(TINY_GPT2))).arch.num_layers == 2


def test_a_name_too_long_for_the_os_is_one_line():
    _refused("x" * 5000, "File name too long")


def test_an_unknown_users_home_is_one_line():
    _refused("~nosuchuser-batchfit/config.json", "~nosuchuser-batchfit")


def test_devices_and_fifos_are_not_read(tmp_path):
    _refused("/dev/zero", "not a regular file")
    fifo = tmp_path / "pipe.json"
    os.mkfifo(fifo)
    _refused(fifo, "not a regular file")  # opening it would wait for a writer forever


def test_a_huge_file_is_refused_unread(tmp_path):
    head = json.dumps(TINY_GPT2)[:-1]
    path = _write(tmp_path, head + " " * MAX_CONFIG_BYTES + "}")
    _refused(path, "over 10 MiB")


def test_an_unreadable_hub_cache_is_one_line(tmp_path, monkeypatch):
    snapshots = tmp_path / "models--acme--tiny" / "snapshots"
    (snapshots / "abc").mkdir(parents=True)
    (snapshots / "abc" / "config.json").write_text(json.dumps(TINY_GPT2))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    snapshots.chmod(0)
    if os.geteuid() == 0:  # permissions do not bind root: answer as the kernel would for a user
        real_listdir, real_scandir = os.listdir, os.scandir

        def denied(real):
            def call(path=".", *args, **kwargs):
                if Path(path) == snapshots:
                    raise PermissionError(13, "Permission denied", str(path))
                return real(path, *args, **kwargs)

            return call

        monkeypatch.setattr(os, "listdir", denied(real_listdir))
        monkeypatch.setattr(os, "scandir", denied(real_scandir))
    try:
        _refused("acme/tiny", "cannot read the Hugging Face cache", "Permission denied")
    finally:
        snapshots.chmod(0o755)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"num_attention_heads": 3}, "not a multiple of the number of attention heads"),
        ({"num_attention_heads": 4, "hidden_act": "nosuch"}, "unknown name 'nosuch'"),
        (
            {"num_attention_heads": 4, "rope_scaling": {"type": "bogus", "factor": 2.0}},
            "unknown name 'bogus'",
        ),
        ({"num_attention_heads": 4, "num_key_value_heads": 3}, "does not divide"),
    ],
)
def test_configs_transformers_rejects_are_one_line(tmp_path, extra, message):
    config = {
        "model_type": "llama",
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "vocab_size": 1000,
        "max_position_embeddings": 512,
        **extra,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    with pytest.raises(UsageError, match=re.escape(message)):
        resolve_model(str(path))
