"""QLoRA traced: bitsandbytes' 4-bit linear emulated on fake and real tensors."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from batchfit.hardware import get_gpu
from batchfit.memory.estimate import estimate
from batchfit.memory.formulas._params import NF4_BYTES_PER_PARAM
from batchfit.memory.trace._nf4 import Linear4bit
from batchfit.memory.trace.hf import step_parts
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
    layer = Linear4bit(torch.nn.Linear(256, 512, bias=False), torch.bfloat16, torch.uint8)
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
    assert trace.components["weights"] > 4 * experts  # fp32 after the recipe's preparation
    assert analytic.components["weights"] == pytest.approx(trace.components["weights"], rel=0.02)
    assert any("so they stay fp32" in n for n in trace.extras["notes"])


@pytest.mark.slow
def test_qlora_quantises_gpt2s_conv1d_layers_in_both_engines():
    from batchfit.memory.estimate import estimate

    info, gpu = resolve_model("gpt2"), get_gpu("t4")
    kw = dict(micro_batch_size=2, seq_len=256, gpu=gpu)
    # without the recipe's fp32 cast of what stays unquantised (GPT-2's large embeddings)
    setup = TrainingSetup(method="qlora", precision="amp-fp16", framework="accelerate")
    lora = estimate(info, replace(setup, method="lora"), **kw)
    trace = estimate(info, setup, **kw)
    analytic = estimate(info, setup, engine="analytic", **kw)
    assert trace.components["weights"] < 0.6 * lora.components["weights"]
    assert analytic.components["weights"] == pytest.approx(trace.components["weights"], rel=0.01)


TINY_MIXTRAL = {
    "model_type": "mixtral",
    "architectures": ["MixtralForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "vocab_size": 512,
    "max_position_embeddings": 256,
}


def _resolve(tmp_path, config):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return resolve_model(str(path))


def _dtypes(parts) -> dict[str, torch.dtype]:
    return {name: p.dtype for name, p in parts.model.named_parameters()}


def test_the_kbit_recipe_casts_what_stays_unquantised_to_fp32_in_a_real_step(tiny):
    # HF Trainer's QLoRA recipe runs peft's prepare_model_for_kbit_training; accelerate's does not
    prepared = TrainingSetup(method="qlora", precision="amp-bf16", framework="hf-trainer")
    plain = TrainingSetup(method="qlora", precision="amp-bf16", framework="accelerate")
    assert prepared.kbit_upcast and not plain.kbit_upcast
    dtypes = _dtypes(assert_dry_run_matches_real(tiny, prepared, micro=2, seq=32))
    for name in ("embed_tokens.weight", "input_layernorm.weight", "norm.weight", "lm_head.weight"):
        assert {d for n, d in dtypes.items() if n.endswith(name)} == {torch.float32}, name
    assert {d for n, d in dtypes.items() if n.endswith("base_layer.weight")} == {torch.uint8}
    plain_dtypes = _dtypes(assert_dry_run_matches_real(tiny, plain, micro=2, seq=32))
    assert {d for n, d in plain_dtypes.items() if n.endswith("lm_head.weight")} == {torch.bfloat16}


def test_both_engines_count_the_fp32_upcast_and_name_it(tiny):
    kw = {"micro_batch_size": 1, "seq_len": 64, "gpu": get_gpu("a100-80gb")}
    rest = tiny.total_params - tiny.quantizable_params()
    weights = {}
    for framework in ("hf-trainer", "accelerate"):
        setup = TrainingSetup(method="qlora", precision="amp-bf16", framework=framework)
        traced = estimate(tiny, setup, engine="trace", **kw)  # type: ignore[arg-type]
        formulas = estimate(tiny, setup, engine="analytic", **kw)  # type: ignore[arg-type]
        # the formulas leave out each 4-bit layer's fixed code tables (272 fp32; 14 layers)
        assert traced.components["weights"] == pytest.approx(
            formulas.components["weights"], abs=14 * 272 * 4 + 1024
        )
        weights[framework] = traced.components["weights"]
        for est in (traced, formulas):  # both engines name what the recipe casts
            notes = est.extras.get("notes", [])
            assert any("prepare_model_for_kbit_training casts" in n for n in notes) == (
                framework == "hf-trainer"
            ), est.engine
    # 2 more bytes for each parameter left unquantised (adapters are fp32 in both)
    assert weights["hf-trainer"] - weights["accelerate"] == pytest.approx(2 * rest, rel=0.01)


def _expert_dtypes(info, framework: str) -> set[torch.dtype]:
    setup = TrainingSetup(method="qlora", precision="amp-bf16", framework=framework)
    setup = setup.resolved(device="cpu", bf16_supported=True)
    parts = step_parts(info, setup, micro=1, seq=8, emulate_cuda=False)
    return {p.dtype for n, p in parts.model.named_parameters() if ".experts." in n}


def test_qlora_on_a_tiny_mixtral_keeps_its_3d_experts_unquantised(tmp_path):
    info = _resolve(tmp_path, TINY_MIXTRAL)
    experts = info.fused_expert_params()
    assert experts == 2 * 4 * 3 * 64 * 128  # layers x experts x (gate, up, down) x in x out
    # not quantised, then cast to fp32 by the recipe's preparation; 16-bit without it
    assert _expert_dtypes(info, "hf-trainer") == {torch.float32}
    assert _expert_dtypes(info, "accelerate") == {torch.bfloat16}
    setup = TrainingSetup(method="qlora", precision="amp-bf16", framework="hf-trainer")
    kw = {"micro_batch_size": 1, "seq_len": 32, "gpu": get_gpu("a100-80gb")}
    traced = estimate(info, setup, engine="trace", **kw)  # type: ignore[arg-type]
    formulas = estimate(info, setup, engine="analytic", **kw)  # type: ignore[arg-type]
    assert traced.components["weights"] > 4 * experts
    assert formulas.components["weights"] > 4 * experts
    assert any("so they stay fp32" in n for n in traced.extras["notes"])


def test_litgpt_quantises_the_output_head_too_in_both_engines(tiny):
    setup = TrainingSetup(method="qlora", precision="bf16", framework="litgpt")
    parts = assert_dry_run_matches_real(tiny, setup, micro=2, seq=32)
    heads = [m for n, m in parts.model.named_modules() if n.endswith("lm_head.base_layer")]
    heads += [m for n, m in parts.model.named_modules() if n.endswith("lm_head")]
    assert any(isinstance(m, Linear4bit) for m in heads)
    assert not setup.kbit_upcast  # Lightning's plugin builds the rest in bf16
    kw = {"micro_batch_size": 1, "seq_len": 64, "gpu": get_gpu("a100-80gb")}
    traced = estimate(tiny, setup, engine="trace", **kw)  # type: ignore[arg-type]
    formulas = estimate(tiny, setup, engine="analytic", **kw)  # type: ignore[arg-type]
    assert traced.components["weights"] == pytest.approx(
        formulas.components["weights"], abs=15 * 272 * 4 + 1024
    )
    assert tiny.quantizable_params(head=True) - tiny.quantizable_params() == 1024 * 128


def test_modules_a_model_keeps_in_fp32_stay_unquantised():
    """transformers' 4-bit quantizer skips ``_keep_in_fp32_modules`` (T5's ``wo``, whose
    forward casts its input to the weight's dtype): the emulation leaves them ``nn.Linear``."""
    from transformers import T5Config, T5ForConditionalGeneration

    from batchfit.memory.trace._nf4 import quantize_linears

    config = T5Config(d_model=32, d_ff=64, num_layers=1, num_heads=2, d_kv=16, vocab_size=64)
    net = T5ForConditionalGeneration(config)
    quantize_linears(net, torch.bfloat16)
    kinds = {name: type(m) for name, m in net.named_modules()}
    wo = [k for k in kinds if k.endswith(".wo")]
    wi = [k for k in kinds if k.endswith(".wi")]
    assert wo and all(kinds[k] is torch.nn.Linear for k in wo)
    assert wi and all(kinds[k] is Linear4bit for k in wi)


def test_the_formulas_keep_t5_s_fp32_modules_unquantised_as_the_trace_does(tmp_path):
    """T5 keeps each feed-forward's ``wo`` in fp32 (``_keep_in_fp32_modules``) and transformers'
    4-bit quantizer skips it: both engines count it unquantised (the formulas counted it as
    NF4, half the weights' bytes on this T5)."""
    config = {
        "model_type": "t5",
        "architectures": ["T5ForConditionalGeneration"],
        "d_model": 128,
        "d_ff": 512,
        "d_kv": 32,
        "num_heads": 4,
        "num_layers": 2,
        "num_decoder_layers": 2,
        "vocab_size": 512,
        "decoder_start_token_id": 0,
        "pad_token_id": 0,
        "eos_token_id": 1,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    model = resolve_model(str(path), "seq2seq")
    wo = sum(g.total for g in model.params if g.pattern.endswith(".wo.weight"))
    assert wo and model.quantizable_params() + wo <= model.total_params

    def weights(engine: str) -> int:
        est = estimate(
            model,
            TrainingSetup(method="qlora"),
            micro_batch_size=1,
            seq_len=32,
            gpu=get_gpu("l4"),
            engine=engine,
        )
        return sum(line.num_bytes for line in est.lines if line.component == "weights")

    assert weights("analytic") == pytest.approx(weights("trace"), rel=0.03)
