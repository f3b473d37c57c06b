"""One answer per question (issue #10): a plan's micro-batch fits by its own ``estimate`` (same
flags), and the next size up does not, on the cases that gave a T4 student an OOM before."""

from __future__ import annotations

import json

import pytest

from tests._cli import run_cli

pytestmark = pytest.mark.slow

# (model, plan flags, setup flags shared with estimate)
CASES = [
    (
        "bert-base-uncased",
        ["--gpu", "t4", "--seq-len", "512", "--global-batch", "64"],
        ["--task", "classification"],
    ),
    ("gpt2", ["--gpu", "t4", "--seq-len", "1024", "--global-batch", "64"], []),
    ("roberta-large", ["--gpu", "a100-40gb", "--seq-len", "512", "--global-batch", "1024"], []),
    (
        "DEBERTA",
        ["--gpu", "t4", "--seq-len", "512", "--global-batch", "64"],
        ["--task", "classification"],
    ),
    (
        "gpt2",
        ["--gpu", "t4", "--seq-len", "1024", "--global-batch", "64"],
        ["--task", "classification"],
    ),
]


# microsoft/deberta-v3-base's config.json (the keys that shape it)
DEBERTA_V3_BASE = {
    "model_type": "deberta-v2",
    "architectures": ["DebertaV2ForMaskedLM"],
    "hidden_size": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "intermediate_size": 3072,
    "vocab_size": 128100,
    "max_position_embeddings": 512,
    "relative_attention": True,
    "position_buckets": 256,
    "norm_rel_ebd": "layer_norm",
    "share_att_key": True,
    "pos_att_type": ["p2c", "c2p"],
    "position_biased_input": False,
    "type_vocab_size": 0,
    "layer_norm_eps": 1e-7,
    "hidden_act": "gelu",
    "max_relative_positions": -1,
    "pad_token_id": 0,
}


def _json(args: list[str], capsys: pytest.CaptureFixture[str]) -> dict:
    code, out, err = run_cli([*args, "--json"], capsys)
    assert code == 0, err
    return dict(json.loads(out))


@pytest.mark.parametrize(("model", "plan_flags", "setup_flags"), CASES)
def test_the_planned_micro_batch_fits_by_its_own_estimate(
    model, plan_flags, setup_flags, capsys, tmp_path
):
    if model == "DEBERTA":
        model = str(tmp_path / "config.json")
        (tmp_path / "config.json").write_text(json.dumps(DEBERTA_V3_BASE))
    plan = _json(["plan", model, *plan_flags, *setup_flags], capsys)
    assert plan["engine"] == "trace"
    assert not any("analytic engine answered" in w for w in plan["warnings"])
    micro = plan["micro_batch_size"]
    # --gpu G --seq-len S, and the plan's accumulation (later micro-steps hold gradients)
    gpu_seq = [*plan_flags[:4], "--grad-accum", str(plan["grad_accum_steps"])]
    est = _json(["estimate", model, *gpu_seq, "-b", str(micro), *setup_flags], capsys)
    assert est["fits"]
    assert est["device_total_bytes"] == plan["device_total_bytes"]
    assert est["engine"] == "trace"
    if plan["max_micro_batch"] == micro:  # the largest that fits: one more does not
        over = _json(["estimate", model, *gpu_seq, "-b", str(micro + 1), *setup_flags], capsys)
        assert not over["fits"] or over["headroom_bytes"] < 512 * 2**20
