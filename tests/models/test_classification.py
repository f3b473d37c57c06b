"""GPT-2-style classification gets a pad token (= eos) where its config has none."""

import json

import torch

from batchfit.memory.estimate import estimate
from batchfit.memory.trace import dry_run as trace
from batchfit.memory.trace import hf as _hf_trace
from batchfit.models import _meta, resolve_model
from batchfit.spec import TrainingSetup

TINY_GPT2 = {
    "model_type": "gpt2",
    "n_layer": 1,
    "n_embd": 64,
    "n_head": 4,
    "vocab_size": 512,
    "n_positions": 256,
    "bos_token_id": 511,
    "eos_token_id": 511,
    "architectures": ["GPT2LMHeadModel"],
}


def test_classification_config_gets_pad_from_eos():
    cfg = _meta.make_config(TINY_GPT2, "classification")
    assert cfg.pad_token_id == 511
    assert _meta.make_config({**TINY_GPT2, "pad_token_id": 3}, "classification").pad_token_id == 3
    assert _meta.make_config(TINY_GPT2, "causal-lm").pad_token_id is None  # only where needed


def test_gpt2_classification_traces_at_micro_batch_4():
    info = resolve_model("gpt2", "classification")
    est = estimate(info, TrainingSetup(), micro_batch_size=4, seq_len=64, device="cpu")
    assert est.engine == "trace"
    assert not any("cannot run" in w for w in est.warnings)


def test_real_cpu_step_of_one_layer_gpt2_classifier(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_GPT2))
    info = resolve_model(str(path), "classification")
    setup = TrainingSetup(precision="fp32").resolved(device="cpu", bf16_supported=True)
    parts = _hf_trace.step_parts(info, setup, micro=2, seq=16, emulate_cuda=False, depth=1)
    with trace.quiet():
        out = parts.model(**parts.make_batch())
    out.loss.backward()
    assert out.logits.shape == (2, 2) and torch.isfinite(out.loss)
