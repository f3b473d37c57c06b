"""The catalog: its models and GPUs, their sources and published sizes, and how names, hub ids
and config files resolve to them."""

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
import torch

from batchfit import catalog
from batchfit.errors import UsageError
from batchfit.hardware import all_gpus, get_gpu
from batchfit.models import catalog_names, resolve_model

ROOT = Path(__file__).resolve().parents[2]
REQUIRED_MODELS = [
    "gpt2",
    "gpt2-medium",
    "gpt2-large",
    "gpt2-xl",
    "bert-base-uncased",
    "bert-large-uncased",
    "roberta-base",
    "roberta-large",
    "distilbert-base-uncased",
    "biobert-v1.1",
    "pubmedbert",
    "scibert",
    "t5-small",
    "t5-base",
    "opt-125m",
    "opt-1.3b",
    "llama-2-7b",
    "llama-2-13b",
    "llama-3.1-8b",
    "llama-3.1-70b",
    "llama-3.2-1b",
    "llama-3.2-3b",
    "mistral-7b",
    "mixtral-8x7b",
    "qwen2.5-0.5b",
    "qwen2.5-1.5b",
    "qwen2.5-7b",
    "qwen2.5-14b",
    "phi-3-mini",
    "gemma-2-2b",
    "gemma-2-9b",
]
REQUIRED_GPUS = [
    "t4",
    "p100",
    "v100-16gb",
    "v100-32gb",
    "a10",
    "a10g",
    "l4",
    "l40s",
    "a100-40gb",
    "a100-80gb",
    "h100-80gb",
    "h100-nvl",
    "h200",
    "b200",
    "rtx-3060",
    "rtx-3090",
    "rtx-4090",
    "rtx-a6000",
    "mi250x",
    "mi300x",
]


def test_catalog_has_required_models_and_gpus():
    assert set(REQUIRED_MODELS) <= set(catalog_names())
    assert len(catalog_names()) >= 30
    assert set(REQUIRED_GPUS) <= set(all_gpus())
    assert all(re.fullmatch(r"[a-z0-9.-]+", name) for name in all_gpus())


def test_every_gpu_cites_sources():
    for row in catalog.load("gpus")["gpus"]:
        assert row["memory_source"] and row["spec_source"], row["name"]
        assert row["memory_mib"] > 4000


@pytest.mark.parametrize("entry", catalog.load("models")["models"], ids=lambda e: e["name"])
def test_published_parameter_counts_match(entry):
    info = resolve_model(entry["name"])
    if entry.get("published_params"):
        assert info.total_params == entry["published_params"]


def test_derived_table_regenerates_identically(monkeypatch, capsys):
    """``scripts/gen_catalog.py --check`` builds every catalog model on the meta device with
    transformers and compares the tables with ``derived.json``: run here as its ``main``, with
    torch's weight initializers made no-ops (on meta tensors they fill nothing; a shape never
    depends on them) so the builds cost only their modules."""
    spec = importlib.util.spec_from_file_location(
        "gen_catalog", ROOT / "scripts" / "gen_catalog.py"
    )
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    for name in SHAPE_FREE_INITIALIZERS:
        monkeypatch.setattr(torch.nn.init, name, _unfilled)
    monkeypatch.setattr(sys, "argv", ["gen_catalog.py", "--check"])
    code = script.main()
    out = capsys.readouterr().out
    assert code == 0, out
    assert "derived.json is current" in out


# torch.nn.init's in-place initializers: what a module's reset_parameters calls
SHAPE_FREE_INITIALIZERS = (
    "uniform_",
    "normal_",
    "trunc_normal_",
    "constant_",
    "ones_",
    "zeros_",
    "eye_",
    "dirac_",
    "xavier_uniform_",
    "xavier_normal_",
    "kaiming_uniform_",
    "kaiming_normal_",
    "orthogonal_",
    "sparse_",
)


def _unfilled(tensor, *args, **kwargs):
    return tensor


@pytest.mark.parametrize(
    "name",
    [
        "LLAMA-3.1-8B",
        "meta-llama/Llama-3.1-8B",
        "Llama-3.1-8B",
        "openai-community/gpt2",
        "bert-base-uncased",
    ],
)
def test_names_and_hub_ids_resolve_case_insensitively(name):
    assert resolve_model(name).name in catalog_names()


def test_unknown_names_suggest_close_matches():
    with pytest.raises(UsageError, match=r"did you mean: llama-3\.1-8b"):
        resolve_model("llama-3.1-8")
    with pytest.raises(UsageError, match="did you mean: a100-40gb"):
        get_gpu("a100-40")


def test_gpu_lookup_is_case_insensitive():
    assert get_gpu("A100-40GB").name == "a100-40gb"
    assert get_gpu("a100-40gb").memory_bytes == 40960 * 2**20


def test_config_path_and_folder(tmp_path):
    cfg = {
        "model_type": "gpt2",
        "n_layer": 2,
        "n_embd": 64,
        "n_head": 4,
        "vocab_size": 1000,
        "n_positions": 128,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    by_file = resolve_model(str(tmp_path / "config.json"))
    by_dir = resolve_model(str(tmp_path))
    assert by_file.total_params == by_dir.total_params
    # wte 1000x64 + wpe 128x64 + 2 layers x (12*64^2 + 13*64) + final ln 2*64
    assert by_file.total_params == 1000 * 64 + 128 * 64 + 2 * (12 * 64 * 64 + 13 * 64) + 128
    assert by_file.task == "causal-lm" and by_file.arch.max_positions == 128


def test_config_with_only_model_type_takes_task_from_flag(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "bert",
                "num_hidden_layers": 2,
                "hidden_size": 64,
                "num_attention_heads": 4,
                "intermediate_size": 128,
            }
        )
    )
    info = resolve_model(str(tmp_path), task="classification")
    assert info.task == "classification"
    assert any("classifier" in g.pattern for g in info.params)


def test_hub_cache_config(tmp_path, monkeypatch):
    snap = tmp_path / "models--acme--tiny" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "vocab_size": 500,
            }
        )
    )
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    info = resolve_model("acme/tiny")
    assert info.hub_id == "acme/tiny" and info.arch.num_layers == 2


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ("{not json", "not valid JSON"),
        ('{"hidden_size": 3}', "model_type"),
        ('{"model_type": "nonexistent-arch"}', "cannot read this config"),
    ],
)
def test_malformed_configs_are_usage_errors(tmp_path, content, needle):
    path = tmp_path / "config.json"
    path.write_text(content)
    with pytest.raises(UsageError, match=needle):
        resolve_model(str(path))


def test_bare_size_is_a_generic_decoder_with_a_warning():
    info = resolve_model("7B")
    assert abs(info.total_params - 7e9) / 7e9 < 0.05
    assert info.name.startswith("generic-") and "assuming" in info.warnings[0]
