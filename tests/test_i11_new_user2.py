"""Fresh-clone findings of issue #11's second new-user trial, each a test that failed before."""

from __future__ import annotations

import json

import pytest

from tests._cli import run_cli

SWIN_TINY = {
    "model_type": "swin",
    "architectures": ["SwinForImageClassification"],
    "embed_dim": 16,
    "depths": [1, 1],
    "num_heads": [2, 4],
    "window_size": 4,
    "image_size": 32,
    "patch_size": 4,
    "num_labels": 10,
}


@pytest.mark.slow
def test_swin_lora_with_checkpointing_is_traced(tmp_path, capsys):
    # peft hooked transformers' make_inputs_require_grads, which breaks on Swin's tuple output
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(SWIN_TINY))
    args = ["estimate", str(cfg), "-b", "2", "--image-size", "32", "--gpu", "t4"]
    code, out, err = run_cli([*args, "--method", "lora", "--grad-ckpt", "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["engine"] == "trace"


@pytest.mark.parametrize("model", ["convnext-tiny-224", "resnet-50"])
def test_image_smaller_than_the_downsampling_is_one_line(model, capsys):
    code, _, err = run_cli(["estimate", model, "-b", "2", "--image-size", "31"], capsys)
    assert code == 2
    assert "use at least 32 pixels" in err
    assert "Traceback" not in err


def test_a_language_framework_preset_keeps_a_classifier_loss_full(capsys):
    args = ["estimate", "vit-base-patch16-224", "-b", "2", "--gpu", "a100-40gb"]
    args += ["--framework", "litgpt", "--engine", "trace", "--json"]
    code, _, err = run_cli(args, capsys)
    assert code == 0, err
    code, _, err = run_cli([*args[:-1], "--loss", "chunked"], capsys)  # asked for: refused
    assert code == 2 and "use --loss full" in err


@pytest.mark.parametrize("model", ["qwen3-30b-a3b", "olmo-2-7b"])
def test_lora_targets_peft_does_not_know_are_said_to_be_assumed(model, capsys):
    args = ["estimate", model, "-b", "1", "-s", "128", "--method", "lora"]
    code, out, err = run_cli([*args, "--engine", "analytic", "--json"], capsys)
    assert code == 0, err
    assert any("peft has no default LoRA targets" in w for w in json.loads(out)["warnings"])
