"""The calibration loop: records, a corrupt file, the automatic headroom, `batchfit calibration`,
and `monitor --plan` recording a GPU run."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

from batchfit import calibration, monitor
from tests._cli import run_cli


@pytest.fixture(autouse=True)
def data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("BATCHFIT_DATA_DIR", str(tmp_path / "data"))
    return tmp_path / "data"


def _record(device: str, estimated: int, measured: int) -> calibration.Record:
    return calibration.Record("monitor", "gpt2", "{}", device, estimated, measured)


def test_records_round_trip_with_versions() -> None:
    assert calibration.append(_record("t4", 100, 110))
    (loaded,) = calibration.load()
    assert loaded.error == pytest.approx(0.10)
    assert loaded.torch and loaded.batchfit and loaded.time > 0


def test_a_corrupt_file_is_set_aside_and_a_new_one_started(data_dir: Path) -> None:
    calibration.path().parent.mkdir(parents=True, exist_ok=True)
    calibration.path().write_text("{broken\nnot a record either\n")
    with pytest.warns(UserWarning, match="set aside"):
        assert calibration.load() == []
    assert list(data_dir.glob("calibration.jsonl.corrupt-*"))
    calibration.append(_record("t4", 100, 101))
    assert len(calibration.load()) == 1


def test_a_write_cut_off_loses_only_its_own_line(data_dir: Path) -> None:
    # a run killed while appending leaves half a line, with no line end, after good records
    calibration.append(_record("t4", 100, 110))
    calibration.append(_record("t4", 100, 120))
    with open(calibration.path(), "a") as f:
        f.write('{"device": "t4", "estimated_')
    calibration.append(_record("t4", 100, 130))  # starts a line of its own
    with pytest.warns(UserWarning, match="1 line of .* set aside .* 3 records kept"):
        records = calibration.load()
    assert [r.measured_bytes for r in records] == [110, 120, 130]
    (aside,) = data_dir.glob("calibration.jsonl.corrupt-*")
    assert aside.read_text() == '{"device": "t4", "estimated_\n'  # nothing lost
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(calibration.load()) == 3  # repaired: no warning the second time
    # another cut-off line in the same second: set aside beside the first, not over it
    with open(calibration.path(), "a") as f:
        f.write("half2{")
    with pytest.warns(UserWarning, match="set aside"):
        assert len(calibration.load()) == 3
    asides = sorted(p.read_text() for p in data_dir.glob("calibration.jsonl.corrupt-*"))
    assert asides == sorted(['{"device": "t4", "estimated_\n', "half2{\n"])


def test_auto_headroom_default_percentile_floor_and_device() -> None:
    few = calibration.auto_headroom([_record("t4", 100, 120)] * 2)
    assert few.fraction == calibration.DEFAULT_HEADROOM_FRACTION and "fewer than" in few.why
    errors = [0.0, 0.01, 0.02, 0.03, 0.10]
    mixed = [_record("a100-80gb", 1000, int(1000 * (1 + e))) for e in errors]
    h = calibration.auto_headroom(mixed)
    assert h.fraction == pytest.approx(calibration.percentile(errors, 99), abs=1e-3)
    under = [_record("t4", 1000, 900) for _ in range(5)]  # estimates always above the truth
    assert calibration.auto_headroom(under).fraction == calibration.HEADROOM_FLOOR_FRACTION
    # a device with enough records of its own uses them
    both = mixed + under
    assert calibration.auto_headroom(both, "t4").fraction == calibration.HEADROOM_FLOOR_FRACTION
    assert "on t4" in calibration.auto_headroom(both, "t4").why


def test_calibration_command(capsys: pytest.CaptureFixture[str]) -> None:
    for e in (0.0, 0.02, 0.04, 0.01, 0.03):
        calibration.append(_record("t4", 1000, int(1000 * (1 + e))))
    code, out, _ = run_cli(["calibration", "--json"], capsys)
    assert code == 0
    data = json.loads(out)
    assert data["records"] == 5 and data["by_device"][0]["device"] == "t4"
    assert 0.02 <= data["headroom_auto"] <= 0.05
    code, out, _ = run_cli(["calibration"], capsys)
    assert code == 0 and "plan --headroom auto" in out
    assert data["step_time"] == [] and "step time" not in out
    # runs that timed their steps: what plan and estimate scale their time by
    for measured in (1.1, 1.3, 9.0):
        calibration.append(
            calibration.Record(
                "hf-callback",
                "gpt2",
                "s",
                "t4",
                1,
                1,
                estimated_seconds=1.0,
                measured_seconds=measured,
            )
        )
    code, out, _ = run_cli(["calibration", "--json"], capsys)
    (row,) = json.loads(out)["step_time"]
    assert (row["device"], row["model"], row["runs"], row["counted"]) == ("t4", "gpt2", 3, 2)
    assert row["median"] == pytest.approx(1.3)
    code, out, _ = run_cli(["calibration"], capsys)
    assert "step time: measured / predicted" in out and "x 1.30" in out


class _FakeNvml:
    """NVML's per-process view, stood in by each process's RSS (no GPU here)."""

    def usage(self) -> dict[int, int]:
        import os

        return {
            int(p): b
            for p in os.listdir("/proc")
            if p.isdigit() and (b := monitor.rss_bytes(int(p))) > 0
        }

    def close(self) -> None:
        pass


def test_monitor_with_a_plan_records_a_gpu_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fake: Any = _FakeNvml()
    monkeypatch.setattr(monitor, "_gpu_reader", lambda: fake)
    plan = tmp_path / "plan.json"
    plan.write_text(
        json.dumps(
            {
                "model": "gpt2",
                "gpu": "t4",
                "peak_bytes": 100 * 2**20,
                "device_total_bytes": 150 * 2**20,
                "headroom_wanted_bytes": 2**29,
                "setup": {"precision": "amp-fp16"},
                "micro_batch_size": 4,
                "seq_len": 512,
            }
        )
    )
    hold = "import time; b = bytearray(120 * 2**20); time.sleep(0.4)"
    code, _, err = run_cli(
        ["monitor", "--interval", "0.05", "--plan", str(plan), "--", sys.executable, "-c", hold],
        capsys,
    )
    assert code == 0, err
    (record,) = calibration.load()
    assert record.device == "t4" and record.estimated_bytes == 150 * 2**20
    assert record.measured_bytes >= 120 * 2**20
    assert "recorded" in err


def test_a_file_that_is_not_utf8_is_set_aside_with_one_line(data_dir: Path) -> None:
    import os
    import subprocess

    data_dir.mkdir(parents=True)
    calibration.path().write_bytes(b"garbage\x00\xff{not json\n")
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, "-m", "batchfit", "calibration"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(root / "src")},
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("batchfit: warning: ")
    assert "set aside" in proc.stderr
    assert not calibration.path().exists()
    assert list(data_dir.glob("calibration.jsonl.corrupt-*"))
    calibration.path().write_bytes(b"\xff\n")  # the library warns, as it always did
    with pytest.warns(UserWarning, match="set aside"):
        assert calibration.load() == []


def test_plan_headroom_auto_on_a_corrupt_file_warns_in_one_line(
    data_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data_dir.mkdir(parents=True, exist_ok=True)
    calibration.path().write_text("{broken\n")
    args = ["plan", "gpt2", "--gpu", "t4", "-s", "128", "--global-batch", "8"]
    code, _, err = run_cli([*args, "--headroom", "auto", "--engine", "analytic"], capsys)
    assert code == 0
    lines = [line for line in err.splitlines() if "set aside" in line]
    assert len(lines) == 1 and lines[0].startswith("batchfit: warning:")
    assert "UserWarning" not in err and "Traceback" not in err
    assert list(data_dir.glob("calibration.jsonl.corrupt-*"))
