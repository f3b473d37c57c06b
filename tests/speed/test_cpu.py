"""The step-time model on the CPU: a catalog CPU profile, a prediction that exists,
is positive and grows with the micro-batch, and matches the formula worked by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from batchfit.hardware import CpuSpec, all_cpus, get_cpu, host_cpu
from batchfit.models import ModelInfo, resolve_model
from batchfit.spec import TrainingSetup
from batchfit.speed import _cpu, step_time

# hand-checkable numbers, independent of whatever the catalog's measured profile says
CPU = CpuSpec(
    name="test-cpu",
    full_name="test",
    cpu_model_name="test",
    threads=1,
    fp32_gflops=100.0,
    bf16_gflops=None,
    bandwidth_gb_s=10.0,
)


@pytest.fixture
def tiny_gpt2(tmp_path: Path) -> ModelInfo:
    config = {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "n_layer": 2,
        "n_embd": 64,
        "n_head": 4,
        "vocab_size": 1000,
        "n_positions": 128,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    return resolve_model(tmp_path / "config.json")


def test_catalog_profile_is_measured_and_complete() -> None:
    cpus = all_cpus()
    assert cpus, "catalog/cpus.json holds at least this machine's profile"
    for cpu in cpus.values():
        assert cpu.fp32_gflops > 0 and cpu.bandwidth_gb_s > 0 and cpu.threads >= 1
        assert get_cpu(cpu.name) is cpu
    for row in __import__("batchfit.catalog", fromlist=["load"]).load("cpus")["cpus"]:
        for field in ("fp32_source", "bandwidth_source"):
            assert "measure_cpu_profile.py" in row[field]


def test_prediction_exists_is_positive_and_grows_with_micro_batch(tiny_gpt2: ModelInfo) -> None:
    setup = TrainingSetup(precision="fp32").resolved(device="cpu", bf16_supported=True)
    cpu = next(iter(all_cpus().values()))
    times = []
    for micro in (1, 2, 4, 8, 16):
        t = step_time(tiny_gpt2, setup, cpu, micro_batch_size=micro, seq_len=64)
        assert t is not None
        assert t.micro_seconds > 0 and t.optimizer_seconds > 0
        times.append(t.step_seconds())
    assert times == sorted(times) and times[-1] > times[0]
    # per token it gets cheaper: fixed costs (launches, the optimizer) spread over more tokens
    assert times[-1] / 16 < times[0]


def test_matches_the_formula_by_hand(tiny_gpt2: ModelInfo) -> None:
    setup = TrainingSetup(precision="fp32", optimizer="adamw").resolved(
        device="cpu", bf16_supported=True
    )
    t = step_time(tiny_gpt2, setup, CPU, micro_batch_size=4, seq_len=32)
    assert t is not None
    h, layers, vocab, seq, tokens = 64, 2, 1000, 32, 128
    # matmul parameters: per layer c_attn (3h^2 + 3h) and c_proj (h^2 + h), the MLP
    # (8h^2 + 4h + h); the tied head multiplies by the embedding (vocab x h)
    matmul = layers * (4 * h * h + 4 * h + 8 * h * h + 5 * h) + vocab * h
    assert matmul == 163_456
    attention = 4 * seq * h * layers * 0.5  # QK^T and PV, the causal half skipped
    flops_per_token = 6 * matmul + 3 * attention  # forward 2x, backward 4x (+ attention 2x)
    at_peak = flops_per_token * tokens / 100e9
    elementwise = 4 * tokens * (layers * h + vocab) / 10e9
    micro = (
        at_peak / _cpu.UTIL * (1 + _cpu.HALF_ROWS / tokens) + _cpu.ELEMENTWISE_PASSES * elementwise
    )
    total_params = 172_288  # the embeddings and norms are updated too
    optimizer = 20 * 4 * total_params / 10e9  # AdamW's per-parameter loop: 20 accesses
    assert t.micro_seconds == pytest.approx(micro, rel=1e-9)
    assert t.optimizer_seconds == pytest.approx(optimizer, rel=1e-9)
    assert t.to_json()["mfu"] == pytest.approx(
        flops_per_token * tokens / (t.step_seconds() * 100e9), rel=1e-9
    )


def test_not_predicted_where_not_measured(tiny_gpt2: ModelInfo) -> None:
    for setup in (
        TrainingSetup(precision="amp-bf16"),
        TrainingSetup(precision="fp32", compile=True),
    ):
        assert step_time(tiny_gpt2, setup, CPU, micro_batch_size=1, seq_len=32) is None


def test_estimate_on_this_cpu_carries_the_time_when_profiled() -> None:
    from batchfit.memory.estimate import estimate

    est = estimate(
        resolve_model("gpt2"),
        TrainingSetup(),
        micro_batch_size=2,
        seq_len=128,
        device="cpu",
        engine="analytic",
    )
    speed = est.speed_json()
    if host_cpu() is None:
        assert speed["step_seconds"] is None
    else:
        assert speed["step_seconds"] and speed["step_seconds"] > 0
        assert speed["tokens_per_s_per_gpu"] and speed["mfu"]
