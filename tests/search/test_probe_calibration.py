"""The probe's calibration record: a real probe's largest measured peak
beside the trace's estimate for the same setup and micro-batch. Only CUDA's records are kept
(a CPU peak is resident memory); the record is built here by the same code on the CPU."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from batchfit import calibration
from batchfit.memory.estimate import estimate
from batchfit.models import resolve_model
from batchfit.search import SearchResult, Trial
from batchfit.search import probe as _probe
from batchfit.spec import TrainingSetup
from tests._tiny import TINY_GPT2

# the tiny GPT-2 of examples/train_tiny_gpt2.py
CONFIG = TINY_GPT2
SEQ = 32


def _trial(micro: int, ok: bool, peak: int | None) -> Trial:
    return Trial(micro, ok, peak, 10.0 if ok else None, 0.1, 2)


def test_no_size_that_fitted_gives_no_record() -> None:
    info = resolve_model("gpt2")
    result = SearchResult(1, 1, (_trial(4, False, None),), 1.0, "max")
    setup = _probe.run_setup(info, TrainingSetup(), "cpu")
    assert _probe.calibration_record(result, info, setup, SEQ, "cpu", "cpu") is None


def test_a_cuda_probe_records_its_step_time_beside_the_models(tmp_path: Path) -> None:
    from batchfit.hardware import get_gpu

    config = tmp_path / "config.json"
    config.write_text(json.dumps(CONFIG))
    info = resolve_model(str(config))
    setup = TrainingSetup(task="causal-lm", precision="amp-bf16")
    # sizes 2 and 4 ran, 4 at 16 samples a second: one step of 4 took 0.25 s
    trials = (_trial(2, True, 10**6), Trial(4, True, 2 * 10**6, 16.0, 1.0, 4))
    result = SearchResult(4, 4, trials, 1.0, "max")
    a100 = get_gpu("a100-80gb")
    record = _probe.calibration_record(result, info, setup, SEQ, "cuda", "a100-80gb", a100)
    assert record is not None and record.measured_seconds == 0.25
    predicted = estimate(
        info, setup, micro_batch_size=4, seq_len=SEQ, gpu=a100, engine="trace"
    ).speed_json()["step_seconds"]
    assert record.estimated_seconds == pytest.approx(predicted)
    # a GPU the catalog does not know: no time model, no step time kept
    other = _probe.calibration_record(result, info, setup, SEQ, "cuda", "some gpu")
    assert other is not None and other.measured_seconds is other.estimated_seconds is None


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="the CPU probe reads /proc")
def test_a_real_probe_becomes_a_record_on_cuda_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BATCHFIT_DATA_DIR", str(tmp_path / "data"))
    config = tmp_path / "config.json"
    config.write_text(json.dumps(CONFIG))
    asked = TrainingSetup(task="causal-lm")
    spec = _probe.make_spec(str(config), asked, "cpu", SEQ, 600 << 20, "max", 8, 2)
    result = _probe.run(spec, lambda _line: None)
    assert calibration.load() == []  # the CPU run recorded nothing

    info = resolve_model(str(config))
    setup = _probe.run_setup(info, asked, "cpu")
    record = _probe.calibration_record(result, info, setup, SEQ, "cpu", "cpu")
    assert record is not None
    largest = max((t for t in result.trials if t.ok), key=lambda t: t.micro_batch_size)
    assert largest.micro_batch_size == result.max_fitting_micro_batch == 8
    assert record.measured_bytes == largest.peak_bytes
    expected = estimate(info, setup, micro_batch_size=8, seq_len=SEQ, device="cpu", engine="trace")
    assert record.estimated_bytes == expected.peak_bytes
    assert record.setup == calibration.setup_key(expected)
    assert json.loads(record.setup)["micro"] == 8
    assert (record.source, record.model, record.device) == ("probe", info.name, "cpu")
    assert calibration.append(record) and calibration.load()[0].measured_bytes == largest.peak_bytes
