"""Resolving MODEL costs time in proportion to the answer, not to the input's magnitude."""

import json
import time

import pytest

from batchfit.models import generic_decoder_config, resolve_model


def _hidden_by_steps(num_params: int, vocab: int = 32000) -> int:
    # The original linear walk: the reference the closed form must agree with.
    hidden = 128
    while 12 * (hidden + 128) ** 3 / 128 + 2 * vocab * (hidden + 128) <= num_params:
        hidden += 128
    return hidden


@pytest.mark.parametrize(
    "num_params", [1, 124_000_000, 7 * 10**9, 7 * 10**9 + 1, 70 * 10**9, 10**13]
)
def test_generic_hidden_size_matches_the_linear_walk(num_params):
    assert generic_decoder_config(num_params)["hidden_size"] == _hidden_by_steps(num_params)


def test_an_absurd_bare_size_resolves_at_once():
    started = time.perf_counter()
    info = resolve_model("1000000000000000000T")  # 10^30 parameters: 54 s before
    assert time.perf_counter() - started < 2.0
    assert abs(info.total_params - 10**30) / 10**30 < 0.01


def _by_key(rows):
    return {(r[0], tuple(r[1])): (r[2], r[3]) for r in rows}


@pytest.mark.parametrize(
    ("name", "task"),
    [
        ("gpt2", "causal-lm"),
        ("bert-base-uncased", "classification"),
        ("t5-base", "seq2seq"),
        ("llama-3.1-8b", "causal-lm"),
        ("mixtral-8x7b", "causal-lm"),
        ("gemma-2-2b", "causal-lm"),
        ("phi-3-mini", "classification"),
    ],
)
def test_counting_from_a_few_layers_equals_the_full_tables(name, task):
    from batchfit.models import _meta, catalog

    entry = next(e for e in catalog.load("models")["models"] if e["name"] == name)
    want = catalog.load("derived")["models"][name][task]  # built layer by layer
    assert _by_key(_meta.count_params(entry["config"], task, extrapolate_above=0)) == _by_key(want)


def test_alternating_layer_types_are_counted_by_their_period():
    from batchfit.models import _meta

    cfg = {
        "model_type": "qwen2_moe",  # every second layer a mixture of experts
        "decoder_sparse_step": 2,
        "mlp_only_layers": [],
        "num_hidden_layers": 13,
        "hidden_size": 32,
        "intermediate_size": 64,
        "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 32,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "vocab_size": 50,
    }
    full = _meta.param_table(_meta.build_on_meta(cfg, "causal-lm"))
    assert _by_key(_meta.count_params(cfg, "causal-lm", extrapolate_above=0)) == _by_key(full)


def test_a_100000_layer_config_resolves_in_seconds(tmp_path):
    cfg = {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 100_000,  # 218 s and 4.2 GB when every layer was built
        "num_attention_heads": 4,
        "vocab_size": 100,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    import transformers  # noqa: F401  (imported outside the clock)

    started = time.perf_counter()
    info = resolve_model(str(tmp_path))
    assert time.perf_counter() - started < 30.0
    per_layer = 4 * 64 * 64 + 3 * 64 * 128 + 2 * 64  # attention, SwiGLU MLP, two RMSNorms
    assert info.total_params == 100_000 * per_layer + 2 * 100 * 64 + 64
    assert info.arch.num_layers == 100_000
