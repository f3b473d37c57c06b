"""A current catalog: the families people fine-tune now, MoE traced, Gemma 3's
layer pattern paired up in the trace."""

from __future__ import annotations

import json

import pytest

from batchfit.hardware import get_gpu
from batchfit.memory.estimate import estimate
from batchfit.memory.trace.estimate import layer_period, trace_depths
from batchfit.models import resolve_model
from batchfit.spec import TrainingSetup
from tests.memory._dry_vs_real import assert_dry_run_matches_real

# Published parameter counts (model cards, or keras-hub presets where the card rounds): each
# catalog config built by transformers must give them.
PUBLISHED = {
    "gemma-3-1b": (999_885_952, 0.0),  # keras-hub gemma3_1b preset, exact
    "llama-3.3-70b": (70_553_706_496, 0.0),  # the same shapes as Llama 3.1 70B
    "qwen3-0.6b": (0.6e9, 0.01),
    "qwen3-8b": (8.2e9, 0.01),
    "qwen3-30b-a3b": (30.5e9, 0.01),
    "phi-4": (14.7e9, 0.01),
    "smollm2-135m": (135e6, 0.01),
    "smollm2-1.7b": (1.71e9, 0.01),
    "olmo-2-7b": (7.3e9, 0.01),
    "mistral-nemo-12b": (12.2e9, 0.01),
    "mistral-small-24b": (23.6e9, 0.01),
    "modernbert-base": (149e6, 0.01),
    "modernbert-large": (395e6, 0.01),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_new_catalog_models_have_their_published_sizes(name):
    params, rel = PUBLISHED[name]
    assert resolve_model(name).total_params == pytest.approx(params, rel=rel, abs=0)


def test_the_new_families_are_all_there():
    for name in (
        "qwen3-4b",
        "qwen3-14b",
        "gemma-3-4b",
        "gemma-3-12b",
        "gemma-3-27b",
        "smollm2-360m",
        "olmo-2-13b",
        "deberta-v3-base",
        "deberta-v3-large",
    ):
        assert resolve_model(name).total_params > 100e6, name
    assert resolve_model("deberta-v3-base").task == "masked-lm"
    assert resolve_model("modernbert-base").default_lora_targets() == ("Wqkv",)
    # Qwen3-MoE's experts are moe_intermediate_size wide; intermediate_size is for dense layers
    assert resolve_model("qwen3-30b-a3b").arch.intermediate_size == 768


def test_gemma3_is_traced_at_whole_periods_of_its_layer_pattern():
    assert layer_period(["s", "s", "s", "s", "s", "f"] * 3) == 6
    assert layer_period(["s", "f"] * 4) == 2
    assert layer_period(["f"] * 5) == 1
    assert trace_depths(resolve_model("gemma-3-1b")) == (6, 12)
    assert trace_depths(resolve_model("gemma-2-2b")) == (2, 4)
    assert trace_depths(resolve_model("llama-3.2-1b")) == (1, 2)


MOE = {
    "qwen3_moe": {
        "model_type": "qwen3_moe",
        "hidden_size": 128,
        "intermediate_size": 256,
        "moe_intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "vocab_size": 2048,
    },
    "mixtral": {
        "model_type": "mixtral",
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "vocab_size": 2048,
    },
}


@pytest.mark.parametrize("kind", sorted(MOE))
def test_moe_dry_run_matches_a_real_cpu_step(tmp_path, kind):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(MOE[kind]))
    info = resolve_model(str(path))
    assert info.arch.num_experts
    assert_dry_run_matches_real(info, TrainingSetup(precision="fp32"), micro=2, seq=64)


def test_catalog_moe_is_traced_not_answered_by_formulas():
    est = estimate(
        resolve_model("qwen3-30b-a3b"),
        TrainingSetup(method="lora"),
        micro_batch_size=1,
        seq_len=1024,
        gpu=get_gpu("h100-80gb"),
    )
    assert est.engine == "trace"
    assert not any("cannot run" in w for w in est.warnings)
