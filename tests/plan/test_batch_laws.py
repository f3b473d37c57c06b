"""The global batch and peak LR from published batch-size scaling laws."""

from __future__ import annotations

import json
import math

import pytest

from batchfit.errors import UsageError
from batchfit.models import resolve_model
from batchfit.plan._batch_laws import batch_laws, deepseek_llm, model_batch_laws, step_law
from tests._cli import run_cli


def test_deepseek_llm_by_hand():
    # DeepSeek LLM 7B: M = 72·30·4096² + 6·30·4096·4096 (30 layers, d 4096, seq 4096), D = 2T
    m = 72 * 30 * 4096**2 + 6 * 30 * 4096 * 4096
    a = deepseek_llm(m, 2e12)
    c = m * 2e12
    assert a.batch_tokens == pytest.approx(0.2920 * c**0.3271)
    assert a.learning_rate == pytest.approx(0.3118 * c**-0.1250)
    # the paper's 7B run used 2304 x 4096 = 9.4M tokens and LR 4.2e-4, on its fitted line
    assert a.batch_tokens == pytest.approx(2304 * 4096, rel=0.05)
    assert a.learning_rate == pytest.approx(4.2e-4, rel=0.03)
    assert not a.inside_fit and "7B and 67B" in a.note


def test_step_law_by_hand():
    a = step_law(1e9, 1e11)
    # 0.58 x 1e11^0.571 = 0.58 x 10^6.281; 1.79 x 10^(-6.417) x 10^(3.377)
    assert a.batch_tokens == pytest.approx(0.58 * 10**6.281)
    assert a.learning_rate == pytest.approx(1.79 * 10 ** (-0.713 * 9 + 0.307 * 11))
    assert a.inside_fit and a.note == ""
    far = step_law(7e9, 15e12)
    assert not far.inside_fit and "7B parameters" in far.note and "15T tokens" in far.note


def test_deepseek_fit_range_flags():
    assert deepseek_llm(1e9, 1e10).inside_fit  # C = 1e19
    below = deepseek_llm(1e6, 1e10)  # C = 1e16
    assert not below.inside_fit and "below the fit" in below.note
    beyond = deepseek_llm(1e12, 1e13)  # C = 1e25
    assert "67B run" in beyond.note


def test_range_and_suggestion():
    a = batch_laws(1e9, 100_000_000_000, seq_len=2048)
    lo, hi = a.batch_tokens_range
    assert lo == pytest.approx(step_law(1e9, 1e11).batch_tokens)
    assert hi == pytest.approx(deepseek_llm(6e9, 1e11).batch_tokens)  # M defaults to 6N
    # geometric mean 1.43M tokens = 697 samples of 2048 -> the power of two 512
    assert a.suggested_batch_tokens == 512 * 2048
    lr_lo, lr_hi = a.learning_rate_range
    assert a.suggested_learning_rate == pytest.approx(math.sqrt(lr_lo * lr_hi))


def test_model_counts_non_embedding_params_and_flops():
    gpt2 = resolve_model("gpt2")
    a = model_batch_laws(gpt2, 10_000_000_000, seq_len=1024)
    kinds = gpt2.params_by_kind()
    assert a.non_embedding_params == gpt2.total_params - kinds["embedding"]
    # 6 x matrix params + 6 x 12 layers x 768 x 1024 (attention)
    assert a.flops_per_token == 6 * (kinds["attention"] + kinds["mlp"]) + 6 * 12 * 768 * 1024
    llama = model_batch_laws(resolve_model("llama-3.1-8b"), 15 * 10**12)
    assert llama.non_embedding_params == pytest.approx(6.98e9, rel=0.01)  # no embed, no head


def test_disagreement_is_warned():
    a = model_batch_laws(resolve_model("llama-3.1-8b"), 15 * 10**12)
    assert any("disagree" in w and "peak LR" in w for w in a.warnings)


def test_image_model_refused():
    with pytest.raises(UsageError, match="image model"):
        model_batch_laws(resolve_model("vit-base-patch16-224"), 10**9)


def test_cli_human(capsys):
    code, out, _ = run_cli(["batch-size", "gpt2", "--train-tokens", "10B", "-s", "1024"], capsys)
    assert code == 0
    assert "deepseek-llm" in out and "step-law" in out and "suggested" in out
    assert "arXiv:2401.02954" in out and "arXiv:2503.04715" in out


def test_cli_json(capsys):
    code, out, _ = run_cli(
        ["batch-size", "llama-3.1-8b", "--train-tokens", "15T", "--json"], capsys
    )
    assert code == 0
    data = json.loads(out)
    assert [law["name"] for law in data["laws"]] == ["deepseek-llm", "step-law"]
    assert data["train_tokens"] == 15 * 10**12 and data["seq_len"] == 4096
    assert data["compute_flops"] == pytest.approx(data["flops_per_token"] * 15e12)
    lo, hi = data["batch_tokens_range"]
    assert lo <= data["suggested_global_batch_tokens"] * 2 and hi >= lo
    assert data["suggested_global_batch"] * 4096 == data["suggested_global_batch_tokens"]
    assert not any(law["inside_fit"] for law in data["laws"])
    assert data["warnings"] and "versions" in data


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--train-tokens", "-5"], "--train-tokens"),
        (["--train-tokens", "0"], "--train-tokens"),
        (["--train-tokens", "lots"], "--train-tokens"),
        (["--train-tokens", "1e30"], "--train-tokens"),
        (["--train-tokens", "1B", "-s", "0"], "--seq-len"),
    ],
)
def test_cli_bad_input_exits_2_one_line(capsys, args, needle):
    code, out, err = run_cli(["batch-size", "gpt2", *args], capsys)
    assert code == 2 and needle in err and out == ""
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_cli_unknown_model_exits_2(capsys):
    code, _, err = run_cli(["batch-size", "gpt-17", "--train-tokens", "1B"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1


def test_plan_hints_the_command_for_full_pre_training(capsys):
    base = ["plan", "gpt2", "--gpu", "a100-40gb", "-s", "1024", "--global-batch", "64"]
    code, out, _ = run_cli([*base, "--engine", "analytic", "--train-tokens", "1000000000"], capsys)
    assert code == 0 and "batchfit batch-size gpt2 --train-tokens" in out
    code, out, _ = run_cli([*base, "--engine", "analytic"], capsys)
    assert code == 0 and "batch-size" not in out
