"""QLoRA traced: bitsandbytes' 4-bit linear emulated on fake and real tensors."""

from __future__ import annotations

import json

import pytest
import torch

from batchfit.hardware import get_gpu
from batchfit.memory.estimate import estimate
from batchfit.memory.formulas._params import NF4_BYTES_PER_PARAM
from batchfit.memory.trace._nf4 import Linear4bit
from batchfit.memory.trace.tracker import AllocationTracker
from batchfit.models import resolve_model
from batchfit.spec import TrainingSetup
from tests.memory._dry_vs_real import assert_dry_run_matches_real

pytestmark = pytest.mark.slow

TINY_LLAMA = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 128,
    "intermediate_size": 352,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1024,
    "max_position_embeddings": 512,
}


@pytest.fixture
def tiny(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_LLAMA))
    return resolve_model(str(path))


def test_the_4bit_layer_stores_nf4_and_dequantises_a_transient_weight():
    layer = Linear4bit(torch.nn.Linear(256, 512, bias=False), torch.bfloat16)
    stored = sum(t.numel() * t.element_size() for t in (*layer.parameters(), *layer.buffers()))
    n = 256 * 512
    # the packed codes and statistics, plus the two fixed code tables (256 + 16 fp32)
    assert stored - 4 * (256 + 16) == pytest.approx(n * NF4_BYTES_PER_PARAM, rel=0.01)
    x = torch.randn(8, 256, dtype=torch.bfloat16, requires_grad=True)
    with AllocationTracker() as tracker:
        tracker.track(x)
        for t in (*layer.parameters(), *layer.buffers()):
            tracker.track(t, "weights")
        start = tracker.live_bytes
        y = layer(x)
        forward = tracker.peak_total - start
        y.sum().backward()
    # the 16-bit weight while it is used, and the output (nothing saved but the packed weight)
    assert forward == 2 * n + 2 * 8 * 512
    assert x.grad is not None and x.grad.shape == x.shape


@pytest.mark.parametrize("grad_ckpt", [False, True])
def test_a_qlora_dry_run_matches_real_cpu_tensors(tiny, grad_ckpt):
    setup = TrainingSetup(method="qlora", precision="amp-bf16", grad_ckpt=grad_ckpt)
    parts = assert_dry_run_matches_real(tiny, setup, micro=2, seq=32)
    quantized = [m for m in parts.model.modules() if isinstance(m, Linear4bit)]
    assert len(quantized) == 2 * 7  # q, k, v, o, gate, up, down per layer; not the head
    assert sum(m.clones_output for m in quantized) == 2 * 2  # peft's default: q_proj, v_proj


def test_qlora_is_traced_and_its_weights_agree_with_the_formulas():
    info = resolve_model("llama-3.2-1b")
    kw = {"micro_batch_size": 1, "seq_len": 256, "gpu": get_gpu("t4")}
    traced = estimate(info, TrainingSetup(method="qlora"), engine="trace", **kw)  # type: ignore[arg-type]
    formulas = estimate(info, TrainingSetup(method="qlora"), engine="analytic", **kw)  # type: ignore[arg-type]
    assert traced.engine == "trace"
    assert any("4-bit linears emulated" in n for n in traced.extras.get("notes", []))
    assert traced.components["weights"] == pytest.approx(formulas.components["weights"], rel=0.01)


@pytest.mark.slow
def test_qlora_on_moe_leaves_fused_experts_16bit_in_both_engines():
    info = resolve_model("qwen3-30b-a3b")
    setup = TrainingSetup(method="qlora", precision="amp-bf16")
    kw = dict(micro_batch_size=1, seq_len=128, gpu=get_gpu("h100-80gb"))
    trace = estimate(info, setup, engine="trace", **kw)
    analytic = estimate(info, setup, engine="analytic", **kw)
    experts = info.fused_expert_params()
    assert experts > 0.9 * info.total_params
    assert trace.components["weights"] > 2 * experts  # 16-bit, not 4-bit
    assert analytic.components["weights"] == pytest.approx(trace.components["weights"], rel=0.02)
    assert any("bitsandbytes leaves them 16-bit" in n for n in trace.extras["notes"])


@pytest.mark.slow
def test_qlora_quantises_gpt2s_conv1d_layers_in_both_engines():
    from batchfit.memory.estimate import estimate

    info, gpu = resolve_model("gpt2"), get_gpu("t4")
    kw = dict(micro_batch_size=2, seq_len=256, gpu=gpu)
    lora = estimate(info, TrainingSetup(method="lora", precision="amp-fp16"), **kw)
    trace = estimate(info, TrainingSetup(method="qlora", precision="amp-fp16"), **kw)
    analytic = estimate(
        info, TrainingSetup(method="qlora", precision="amp-fp16"), engine="analytic", **kw
    )
    assert trace.components["weights"] < 0.6 * lora.components["weights"]
    assert analytic.components["weights"] == pytest.approx(trace.components["weights"], rel=0.01)
