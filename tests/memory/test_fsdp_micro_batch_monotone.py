"""FSDP2's traced peak never falls as the micro-batch grows, with and without checkpointing.

Forward was one moment: its peak is early (the root's all-gather: embeddings and head, twice
over while the flat buffer is copied out) or late (every layer's activations), and which one
wins changed between the traced depths 3 and 4 at micro-batch 1. Extrapolated per category,
the early moment's "other" fell and the late one's "activations" rose, so micro-batch 1 came
out above micro-batch 4 (Llama-3.1-8B on 8 H100s, 2048 tokens: 87.2 GiB against 64.7). A tiny
Llama with a large vocabulary and 32 layers reproduces it in seconds.
"""

from __future__ import annotations

import json

import pytest

from batchfit.hardware import get_gpu
from batchfit.memory.trace.estimate import estimate_trace
from batchfit.models import ModelInfo, resolve_model
from batchfit.spec import TrainingSetup
from batchfit.workload import Workload

TINY_LLAMA = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}


@pytest.fixture(autouse=True)
def _no_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHFIT_NO_CACHE", "1")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> ModelInfo:
    path = tmp_path_factory.mktemp("llama") / "config.json"
    path.write_text(json.dumps(TINY_LLAMA))
    return resolve_model(str(path))


@pytest.mark.parametrize("grad_ckpt", [False, True])
def test_fsdp_peak_is_non_decreasing_in_the_micro_batch(model: ModelInfo, grad_ckpt: bool) -> None:
    setup = TrainingSetup(num_gpus=8, sharding="fsdp", loss="fused", grad_ckpt=grad_ckpt)
    estimates = [
        estimate_trace(
            model,
            setup,
            Workload(micro_batch_size=micro, seq_len=400, gpu=get_gpu("h100-80gb")),
        )
        for micro in (1, 2, 4)
    ]
    assert all("extrapolated to 32" in " ".join(e.extras["notes"]) for e in estimates)
    peaks = [e.peak_bytes for e in estimates]
    assert peaks == sorted(peaks), peaks
    # forward is split where it enters the stack's layers, so each part is a line in the depth
    forward = [k for k in estimates[0].extras["moments"] if k.startswith("forward|")]
    assert len(forward) > 1, forward
