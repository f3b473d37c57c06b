"""FSDP1 (``--fsdp-version 1``): traced per rank as FullyShardedDataParallel, chosen by the
framework's preset or the option, and written by the exports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from batchfit.export import export
from batchfit.frameworks import with_framework
from batchfit.hardware import get_gpu
from batchfit.memory.trace.estimate import estimate_trace
from batchfit.models import resolve_model
from batchfit.plan import make_plan
from batchfit.spec import TrainingSetup
from batchfit.workload import Workload
from tests._cli import run_cli

# 2 layers, wide enough that the parameters and their gradients decide the peak
TINY_LLAMA = {
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "vocab_size": 1000,
}
ESTIMATE = ["estimate", "gpt2", "-b", "1", "-s", "64", "--engine", "analytic"]


@pytest.fixture(autouse=True)
def _no_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHFIT_NO_CACHE", "1")
    # an AVX2-only CPU's bf16 matmul scratch is not what these tests are about
    monkeypatch.setattr("batchfit.memory.trace.hf.cpu_bf16_gemm_scratch", lambda: False)


def _peaks(tmp_path: Path, **setup: object) -> dict[int, int]:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_LLAMA))
    out = {}
    for version in (1, 2):
        est = estimate_trace(
            resolve_model(str(path)),
            TrainingSetup(num_gpus=2, sharding="fsdp", fsdp_version=version, **setup),  # type: ignore[arg-type]
            Workload(micro_batch_size=1, seq_len=16, device="cpu"),
            full_depth=True,
        )
        assert est.engine == "trace", est.warnings
        assert any(f"FSDP{version}: rank 0 of 2" in note for note in est.extras.get("notes", []))
        out[version] = est.peak_bytes
    return out


def test_fsdp1_fp32_holds_more_than_fsdp2(tmp_path: Path) -> None:
    # flat parameters gathered whole (the next unit prefetched, BACKWARD_PRE), and on CPU
    # ranks through gloo's flat copy of the whole output (benchmarks/fsdp1.py measures both)
    peaks = _peaks(tmp_path, precision="fp32")
    assert peaks[1] > 1.03 * peaks[2]


def test_fsdp1_amp_reduces_in_16_bit(tmp_path: Path) -> None:
    # accelerate's MixedPrecision reduces in bf16; FSDP2's policy here reduces in fp32
    peaks = _peaks(tmp_path, precision="amp-bf16")
    assert peaks[1] < 0.9 * peaks[2]


def test_the_framework_chooses_the_version_and_the_option_wins() -> None:
    assert with_framework(TrainingSetup(), "accelerate").fsdp_version == 1
    assert with_framework(TrainingSetup(), "torchtune").fsdp_version == 2
    given = TrainingSetup(fsdp_version=2)
    assert with_framework(given, "accelerate", frozenset({"fsdp_version"})).fsdp_version == 2
    fsdp = TrainingSetup(num_gpus=2, sharding="fsdp")
    assert fsdp.resolved(device="cpu", bf16_supported=False).fsdp_version == 2
    assert TrainingSetup().resolved(device="cpu", bf16_supported=False).fsdp_version is None


@pytest.mark.parametrize("value", ["3", "one", "1.5"])
def test_a_bad_version_is_one_line(capsys: pytest.CaptureFixture[str], value: str) -> None:
    code, out, err = run_cli([*ESTIMATE, "--fsdp-version", value], capsys)
    assert code == 2 and out == "", (code, out)
    assert err.startswith("batchfit: error:") and "--fsdp-version" in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_the_option_reaches_the_setup(capsys: pytest.CaptureFixture[str]) -> None:
    args = [*ESTIMATE, "--num-gpus", "2", "--sharding", "fsdp", "--json"]
    code, out, _ = run_cli([*args, "--framework", "accelerate", "--fsdp-version", "2"], capsys)
    assert code == 0 and json.loads(out)["setup"]["fsdp_version"] == 2
    code, out, _ = run_cli([*args, "--framework", "accelerate"], capsys)
    assert code == 0 and json.loads(out)["setup"]["fsdp_version"] == 1


@pytest.mark.parametrize("version", [1, 2])
def test_exports_write_the_version(version: int) -> None:
    plan = make_plan(
        resolve_model("llama-3.1-8b"),
        get_gpu("h100-80gb"),
        TrainingSetup(num_gpus=8, sharding="fsdp", fsdp_version=version),
        seq_len=2048,
        global_batch_tokens=1 << 20,
        engine="analytic",
    )
    accelerate = export(plan, "accelerate")["fsdp_config"]
    assert accelerate["fsdp_version"] == version
    assert ("fsdp_backward_prefetch" in accelerate) == (version == 1)
    hf = export(plan, "hf")["training_arguments"]["fsdp_config"]
    assert hf["version"] == version
    assert hf["reshard_after_forward"] == (True if version == 2 else "full_shard")
