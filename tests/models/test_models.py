"""Parameter counts: LoRA against peft, tied embeddings, heads and quantised layers; the
task read from the config; LoRA targets."""

import json

import pytest

from batchfit.errors import UsageError
from batchfit.models import DEFAULT_LORA_TARGETS, resolve_model
from tests._cli import run_cli


def test_lora_count_llama_31_8b_exact():
    # r=16 on q_proj, v_proj = 6,815,744
    assert resolve_model("llama-3.1-8b").lora_params(16, ["q_proj", "v_proj"]) == 6_815_744


@pytest.mark.parametrize(
    ("name", "targets"),
    [
        ("gpt2", None),
        ("bert-base-uncased", None),
        ("qwen2.5-0.5b", ("q_proj", "k_proj", "o_proj")),
        ("t5-small", None),
    ],
)
def test_lora_count_matches_peft_on_meta(name, targets):
    import torch
    from peft import LoraConfig, get_peft_model

    from batchfit.models import _meta

    info = resolve_model(name)
    model = _meta.build_on_meta(info.config, info.task)
    wanted = list(targets or info.default_lora_targets())
    with torch.device("meta"):
        peft_model = get_peft_model(model, LoraConfig(r=8, target_modules=wanted))
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    assert info.lora_params(8, wanted) == trainable


def test_default_lora_targets_follow_peft():
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as peft

    for model_type, targets in DEFAULT_LORA_TARGETS.items():
        if model_type in peft and peft[model_type] is not None:
            assert list(targets) == list(peft[model_type]), model_type
    assert resolve_model("llama-3.1-8b").default_lora_targets() == tuple(peft["llama"])


def test_unknown_lora_target_lists_the_real_modules():
    with pytest.raises(UsageError, match="q_proj"):
        resolve_model("llama-3.2-1b").lora_params(8, ["query"])


def test_tied_embeddings_counted_once():
    info = resolve_model("llama-3.2-1b")
    assert info.arch.tied_embeddings
    assert "head" not in info.params_by_kind()
    assert info.total_params == 1_235_814_400


def test_task_from_architectures_and_encoder_checks():
    assert resolve_model("bert-base-uncased").task == "masked-lm"
    assert resolve_model("t5-small").task == "seq2seq"
    assert resolve_model("gpt2").task == "causal-lm"
    with pytest.raises(UsageError, match="encoder"):
        resolve_model("bert-base-uncased", task="causal-lm")
    with pytest.raises(UsageError, match="encoder-decoder"):
        resolve_model("gpt2", task="seq2seq")


def test_classification_head_replaces_lm_head():
    lm = resolve_model("gpt2")
    cls = resolve_model("gpt2", task="classification")
    assert cls.total_params == lm.total_params + 768 * 2  # score: hidden x 2 labels, no bias


def test_qlora_quantises_linears_not_head_or_embeddings():
    info = resolve_model("llama-3.1-8b")
    kinds = info.params_by_kind()
    assert info.quantizable_params() == kinds["attention"] + kinds["mlp"]


@pytest.mark.parametrize("model", ["qwen3-30b-a3b", "olmo-2-7b"])
def test_lora_targets_peft_does_not_know_are_said_to_be_assumed(model, capsys):
    args = ["estimate", model, "-b", "1", "-s", "128", "--method", "lora"]
    code, out, err = run_cli([*args, "--engine", "analytic", "--json"], capsys)
    assert code == 0, err
    assert any("peft has no default LoRA targets" in w for w in json.loads(out)["warnings"])


@pytest.mark.slow
def test_an_image_model_says_its_lora_targets_are_assumed(capsys):
    code, out, err = run_cli(
        [
            "estimate",
            "vit-base-patch16-224",
            "-b",
            "2",
            "--gpu",
            "t4",
            "--method",
            "lora",
            "--json",
        ],
        capsys,
    )
    assert code == 0, err
    assert any("peft has no default LoRA targets" in w for w in json.loads(out)["warnings"])
