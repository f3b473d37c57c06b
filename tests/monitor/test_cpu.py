"""`batchfit monitor` on the CPU: the kernel's high-water mark, shared pages counted once across
a process tree, and a calibration record against a CPU estimate."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from batchfit import calibration, monitor
from tests._cli import run_cli
from tests._example_run import example_run

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="monitor reads /proc")
MIB = 2**20


@pytest.fixture(autouse=True)
def data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("BATCHFIT_DATA_DIR", str(tmp_path / "data"))
    return tmp_path / "data"


def _wait_for(path: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} never came"
        time.sleep(0.01)


def _waiting_for(path: Path) -> str:
    """Python lines that wait until ``path`` exists (the test's word to go on)."""
    return f"import os, time\nwhile not os.path.exists({str(path)!r}): time.sleep(0.01)\n"


def test_a_peak_between_two_samples_is_not_missed(tmp_path: Path) -> None:
    # 300 MiB held, then freed, while the sampler waits (the first sample's callback holds it
    # until the command has freed them): the next sample's VmHWM keeps them
    go, freed, seen = tmp_path / "go", tmp_path / "freed", tmp_path / "seen"
    spike = (
        _waiting_for(go)
        + f"b = b'x' * (300 * 2**20); del b; open({str(freed)!r}, 'w').close()\n"
        + _waiting_for(seen)
    )

    def on_sample(_sample: monitor.Sample, _result: monitor.MonitorResult) -> None:
        if not go.exists():
            go.touch()
            _wait_for(freed)
        elif freed.exists():
            seen.touch()  # a sample after the peak: the command may end

    result = monitor.run(
        [sys.executable, "-c", spike], interval=0.05, gpu=False, on_sample=on_sample
    )
    assert result.exit_code == 0 and seen.exists()
    assert max(s.total_bytes for s in result.samples) < 200 * MIB  # the samples missed it
    assert result.peak_bytes >= 300 * MIB
    assert max(result.process_peaks().values()) >= 300 * MIB


def test_a_small_command_is_not_given_batchfits_own_memory() -> None:
    # the child shares this process's pages between fork and exec: its ru_maxrss counts them
    result = monitor.run(
        [sys.executable, "-c", "import time; time.sleep(0.6)"], interval=0.1, gpu=False
    )
    assert result.peak_bytes < 100 * MIB


def test_growth_after_the_last_sample_is_kept_when_it_is_the_commands(tmp_path: Path) -> None:
    # the command outgrows this process's own high-water mark after the first sample, then
    # exits before the next: only its ru_maxrss (reaped with wait4) can tell, and it cannot be
    # ours
    ours = monitor.rss_bytes(os.getpid(), "VmHWM")
    size = ours + 300 * MIB
    go = tmp_path / "go"
    grow = _waiting_for(go) + f"b = b'x' * {size}\n"
    result = monitor.run(
        [sys.executable, "-c", grow], interval=30.0, gpu=False, on_sample=lambda *_: go.touch()
    )
    assert result.exit_code == 0
    assert max(s.total_bytes for s in result.samples) < 200 * MIB  # sampled before it grew
    assert result.peak_bytes >= size


def test_pages_a_forked_worker_shares_count_once(tmp_path: Path) -> None:
    # a parent touches 200 MiB, then forks: each process's RSS holds the 200 MiB, PSS half;
    # both live until a sample has seen the two of them
    seen = tmp_path / "seen"
    fork = (
        "import os, time; b = b'x' * (200 * 2**20); pid = os.fork()\n"
        + _waiting_for(seen)
        + "if pid: os.waitpid(pid, 0)\n"
    )

    def on_sample(sample: monitor.Sample, _result: monitor.MonitorResult) -> None:
        if len(sample.processes) == 2:
            seen.touch()

    result = monitor.run(
        [sys.executable, "-c", fork], interval=0.05, gpu=False, on_sample=on_sample
    )
    assert result.exit_code == 0
    both = [s for s in result.samples if len(s.processes) == 2]
    assert both, "the sampler never saw the forked worker"
    rss_sum = max(sum(s.processes.values()) for s in both)
    counted = max(s.total_bytes for s in both)
    assert rss_sum > 400 * MIB
    assert 200 * MIB < counted < 280 * MIB  # the shared 200 MiB once, two small runtimes


@pytest.mark.slow
def test_monitor_of_the_example_matches_its_own_rss_and_records_it(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    # examples/train_tiny_gpt2.py under `monitor --json --interval 0.5 --plan` with the CPU
    # estimate of its step (micro-batch 16 of 32 tokens); the run reports its own resident
    # peak at its end (the kernel's VmHWM), which the monitor's must match
    run = example_run(request)
    err = run.text("monitor.err")
    assert run.exit_code == 0, err + run.text("stderr")[-3000:]
    summary = json.loads(run.text("monitor.json"))
    independent = int(run.text("maxrss")) * 1024  # KiB on Linux
    assert summary["peak_bytes"] == pytest.approx(independent, rel=0.03)
    monkeypatch.setenv("BATCHFIT_DATA_DIR", str(run.data_dir))  # where the run recorded
    (record,) = calibration.load()
    assert record.device == "cpu" and record.source == "monitor"
    estimate = json.loads(run.text("estimate.json"))["device_total_bytes"]
    assert record.estimated_bytes > estimate + 100 * MIB  # the estimate plus torch's runtime
    assert record.measured_bytes == pytest.approx(independent, rel=0.03)
    assert "recorded for `batchfit calibration`" in err
    # the plan's line and its drift limit start from the runtime baseline, measured once (or
    # kept from an earlier measurement of this interpreter)
    assert err.count("measuring what") <= 1
    assert "above the plan" not in err


def test_a_gpu_plan_measured_as_rss_says_why_there_is_no_record(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"model": "gpt2", "gpu": "t4", "peak_bytes": 2**30}))
    code, _, err = run_cli(
        [
            "monitor",
            "--interval",
            "0.05",
            "--plan",
            str(plan),
            "--",
            sys.executable,
            "-c",
            "import time; time.sleep(0.2)",
        ],
        capsys,
    )
    assert code == 0
    assert "no calibration record: the plan is for a GPU (t4)" in err
    assert calibration.load() == []


def test_cpu_records_never_set_a_gpu_headroom() -> None:
    cpu = [calibration.Record("monitor", "m", "s", "cpu", 100, 150) for _ in range(6)]
    gpu = [calibration.Record("monitor", "m", "s", "t4", 100, 104) for _ in range(6)]
    assert calibration.auto_headroom(cpu + gpu, "a100-80gb").fraction == pytest.approx(0.04)
    assert calibration.auto_headroom(cpu, "t4").records == 0
    assert calibration.auto_headroom(cpu + gpu, "cpu").fraction == pytest.approx(0.5)
