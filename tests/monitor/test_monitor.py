"""`batchfit monitor`: real child processes, their memory, exit codes, signals and files."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from batchfit import monitor
from tests._cli import run_cli

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
# a child that holds 120 MiB (touched, so resident) for a while
HOLD = "import time; b = bytearray(120 * 2**20); time.sleep({})"


@pytest.fixture(autouse=True)
def data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    # calibration records of these runs go to a folder of the test's, never the user's
    monkeypatch.setenv("BATCHFIT_DATA_DIR", str(tmp_path / "data"))
    return tmp_path / "data"


class _Timeout(BaseException):
    """Raised in a command that ran past its time (not an ``Exception``: the CLI's own error
    handling must not turn it into an exit code)."""


def _monitor(
    capfd: pytest.CaptureFixture[str], *args: str, timeout: int = 60
) -> tuple[int, str, str]:
    """``batchfit monitor ARGS`` in this process: (exit code, stdout, stderr), the command's
    own output included (it writes to the file descriptors, not to ``sys.stdout``); a run
    past ``timeout`` seconds (an output that blocks, as a FIFO's open does) fails."""

    def expire(_signum: int, _frame: object) -> None:
        raise _Timeout(f"batchfit monitor {' '.join(args)} ran past {timeout} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(timeout)
    try:
        return run_cli(["monitor", *args], capfd)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_run_samples_the_childs_memory_and_keeps_its_exit_code() -> None:
    result = monitor.run([PY, "-c", HOLD.format(0.6)], interval=0.05, gpu=False)
    assert result.exit_code == 0
    assert result.source == "rss"
    assert result.peak_bytes >= 120 * 2**20
    assert len(result.samples) >= 3
    data = result.to_json()
    assert data["peak_bytes"] == result.peak_bytes and data["samples"] == len(result.samples)
    assert data["processes"] and data["processes"][0]["command"].startswith(PY)


def test_exit_codes_as_a_shell_gives_them() -> None:
    assert (
        monitor.run([PY, "-c", "import sys; sys.exit(3)"], interval=0.05, gpu=False).exit_code == 3
    )
    killed = monitor.run(
        [PY, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"],
        interval=0.05,
        gpu=False,
    )
    assert killed.exit_code == 128 + signal.SIGKILL
    assert monitor.run(["no-such-command-batchfit"], gpu=False).exit_code == 127


def test_grandchildren_are_counted() -> None:
    code = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {HOLD.format(0.6)!r}])"
    result = monitor.run([PY, "-c", code], interval=0.05, gpu=False)
    assert len(result.process_peaks()) >= 2
    assert result.peak_bytes >= 120 * 2**20


def test_cli_writes_log_plot_and_json(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    log, png = tmp_path / "m.jsonl", tmp_path / "m.png"
    code, out, err = _monitor(
        capfd,
        "--interval",
        "0.05",
        "--log",
        str(log),
        "--plot",
        str(png),
        "--json",
        "--",
        PY,
        "-c",
        HOLD.format(0.5),
    )
    assert code == 0, err
    data = json.loads(out)
    assert data["exit_code"] == 0 and data["peak_bytes"] >= 120 * 2**20
    lines = log.read_text().splitlines()
    assert len(lines) == data["samples"]
    assert json.loads(lines[0]).keys() >= {"seconds", "bytes", "processes"}
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_a_failing_command_still_leaves_log_and_plot(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    log, png = tmp_path / "m.jsonl", tmp_path / "m.png"
    code, _, err = _monitor(
        capfd, "--log", str(log), "--plot", str(png), "--", "no-such-command-batchfit"
    )
    assert code == 127
    assert "command not found" in err
    assert log.exists() and png.exists()
    exit_5 = ("--", PY, "-c", "import sys; sys.exit(5)")
    code, _, _ = _monitor(capfd, "--interval", "0.05", "--log", str(log), *exit_5)
    assert code == 5 and log.read_text()


def test_unwritable_output_is_refused_before_the_command_runs(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    marker = tmp_path / "ran"
    code, _, err = _monitor(
        capfd,
        "--log",
        str(tmp_path / "missing" / "m.jsonl"),
        "--",
        PY,
        "-c",
        f"open({str(marker)!r}, 'w')",
    )
    assert code == 2
    assert err.count("\n") == 1 and "--log" in err
    assert "does not exist" in err
    assert not marker.exists()
    # a file where a folder should be is named as such, not as a missing folder
    (tmp_path / "plan.json").write_text("{}")
    for plot in ("plan.json/x.png", "plan.json/deeper/x.png"):
        code, _, err = _monitor(capfd, "--plot", str(tmp_path / plot), "--", PY, "-c", "pass")
        assert code == 2 and err.count("\n") == 1
        assert "plan.json is a file, not a folder" in err


def test_plan_drift_warns_once(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # the runtime baseline's child faked (322 MiB): tests/monitor/test_cpu.py measures it
    runs = _baseline_child(tmp_path, monkeypatch)
    plan = tmp_path / "plan.json"
    # a GPU plan of 10 MiB with 10 MiB headroom: the 120 MiB child passes it
    figures = {"model": "gpt2", "peak_bytes": 10 * 2**20, "headroom_wanted_bytes": 10 * 2**20}
    plan.write_text(json.dumps({**figures, "gpu": "t4"}))
    hold = ("--", PY, "-c", HOLD.format(0.5))
    code, out, err = _monitor(capfd, "--interval", "0.05", "--plan", str(plan), "--json", *hold)
    assert code == 0
    assert err.count("above the plan for gpt2") == 1
    assert json.loads(out)["drifted_at_seconds"] is not None
    # a CPU estimate counts tensors only: its line starts from what a Python with torch
    # holds (~300 MiB), so the same child stays below it
    plan.write_text(json.dumps(figures))
    code, _, err = _monitor(capfd, "--interval", "0.05", "--plan", str(plan), *hold)
    assert code == 0
    assert "above the plan" not in err
    assert "of runtime: interpreter, torch" in err
    assert "recorded for `batchfit calibration`" in err
    # a test run kept out of the calibration file
    no_record = ("--no-record", "--plan", str(plan))
    code, _, err = _monitor(capfd, *no_record, "--", PY, "-c", HOLD.format(0.2))
    assert code == 0 and "recorded" not in err
    assert len(runs) == 1  # the baseline measured once, then read from the cache


def test_the_command_s_code_survives_a_closed_pipe_and_a_start_failure_says_why(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    shell = f"{PY} -m batchfit monitor --json -- {PY} -c 'import sys; sys.exit(3)' | head -c 1"
    proc = subprocess.run(
        ["bash", "-c", shell + "; exit ${PIPESTATUS[0]}"],
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
        capture_output=True,
        timeout=60,
    )
    assert proc.returncode == 3  # not 0: the reader leaving does not hide the failure
    code, _, err = _monitor(capfd, "--", str(tmp_path))  # a folder: exit 126 and the reason
    assert code == 126 and "cannot run it" in err
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    code, _, err = _monitor(capfd, "--plan", str(bad), "--", PY, "-c", "pass")
    assert code == 2 and "not JSON" in err


def test_sigint_reaches_the_command_and_leaves_no_orphan(tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    code = f"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    proc = subprocess.Popen(
        [PY, "-m", "batchfit", "monitor", "--interval", "0.1", "--", PY, "-c", code],
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 30
    while not pidfile.exists() or not pidfile.read_text():
        assert time.monotonic() < deadline, "the command never started"
        time.sleep(0.05)
    child = int(pidfile.read_text())
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 128 + signal.SIGINT  # the child's KeyboardInterrupt
    time.sleep(0.2)
    assert (
        not Path(f"/proc/{child}").exists()
        or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2]
    )


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ('{"micro_batch_size": 4, "trials": []}', "has no peak_bytes"),  # a probe's JSON
        ('["peak_bytes"]', "has no peak_bytes"),
        ('{"peak_bytes": null}', "has no peak_bytes"),
        ('{"peak_bytes": true}', "peak_bytes is true, not a number of bytes"),
        ('{"peak_bytes": -5}', "peak_bytes is -5, not a number of bytes"),
        ('{"peak_bytes": 5, "device_total_bytes": "x"}', 'device_total_bytes is "x"'),
        ('{"peak_bytes": 5, "headroom_wanted_bytes": 1.5}', "headroom_wanted_bytes is 1.5"),
        ("\udcff", "not JSON"),
    ],
)
def test_a_file_that_is_not_a_plan_is_refused_in_one_line(
    tmp_path: Path, content: str, needle: str
) -> None:
    from batchfit.cli.monitor import read_plan
    from batchfit.errors import UsageError

    path = tmp_path / "plan.json"
    path.write_bytes(content.encode("utf-8", "surrogateescape"))
    with pytest.raises(UsageError, match=needle) as e:
        read_plan(path)
    assert "\n" not in str(e.value)


def _group_alive(pgid: int) -> list[str]:
    """Command lines of the live processes (zombies are dead) in process group ``pgid``."""
    alive = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            alive.append(monitor.command_line(int(entry.name)))
    return alive


def _wait_for(path: Path) -> str:
    deadline = time.monotonic() + 30
    while not path.exists() or not path.read_text().endswith("\n"):
        assert time.monotonic() < deadline, "the command never started"
        time.sleep(0.05)
    return path.read_text()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_reaches_the_whole_group_and_leaves_nothing(
    tmp_path: Path, signum: signal.Signals
) -> None:
    # bash passes neither signal on to the python it runs: only a signal to the group reaches it
    pgfile = tmp_path / "pgid"
    code = (
        f"import os, time; open({str(pgfile)!r}, 'w').write(f'{{os.getpgrp()}}\\n'); time.sleep(60)"
    )
    script = f'{PY} -c "{code}" ; echo done'
    proc = subprocess.Popen(
        [PY, "-m", "batchfit", "monitor", "--interval", "0.1", "--", "bash", "-c", script],
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        pgid = int(_wait_for(pgfile))
        assert pgid != os.getpgrp()  # a group of its own
        sent = time.monotonic()
        proc.send_signal(signum)
        assert proc.wait(timeout=20) == 128 + signum
        assert time.monotonic() - sent < 10
        assert _group_alive(pgid) == []
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def test_what_the_command_leaves_running_is_ended_even_if_it_ignores_sigterm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pidfile = tmp_path / "pid"
    stubborn = (
        "import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        f"open({str(pidfile)!r}, 'w').write(f'{{os.getpid()}}\\n'); time.sleep(60)"
    )
    script = f'{PY} -c "{stubborn}" & while [ ! -s {pidfile} ]; do sleep 0.05; done; exit 4'
    # SIGKILL 0.3 s after the SIGTERM it ignores, not after the full grace
    monkeypatch.setattr(monitor, "end_group", functools.partial(monitor.end_group, grace=0.3))
    started = time.monotonic()
    result = monitor.run(["bash", "-c", script], interval=0.05, gpu=False)
    assert result.exit_code == 4
    assert time.monotonic() - started < 0.3 + 20
    pid = int(pidfile.read_text())
    stat = Path(f"/proc/{pid}/stat")
    assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")


def test_json_stdout_is_the_object_alone(capfd: pytest.CaptureFixture[str]) -> None:
    # the command's own stdout (its file descriptor 1) goes to stderr: stdout is the JSON alone
    step = "print('step 1 loss 2.5', flush=True)"
    code, out, err = _monitor(capfd, "--interval", "0.05", "--json", "--", PY, "-c", step)
    assert code == 0, err
    assert json.loads(out)["exit_code"] == 0
    assert "step 1 loss 2.5" in err


@pytest.mark.parametrize("option", ["--log", "--plot"])
def test_an_output_that_is_not_a_regular_file_is_refused(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], option: str
) -> None:
    marker = tmp_path / "ran"
    fifo = tmp_path / "fifo.png"
    os.mkfifo(fifo)
    run_marker = ("--", PY, "-c", f"open({str(marker)!r}, 'w')")
    targets = [str(fifo), "/dev/full"]
    if Path("/sys").is_dir():  # sysfs takes no new file, not even from root
        targets.append("/sys/batchfit-monitor.png")
    for target in targets:
        code, _, err = _monitor(capfd, option, target, *run_marker, timeout=30)
        assert code == 2, (target, err)
        assert err.count("\n") == 1 and option in err, err
        assert not marker.exists(), target


def test_a_symlinked_output_is_written_through(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    (tmp_path / "real").mkdir()
    png, log = tmp_path / "run.png", tmp_path / "run.jsonl"
    png.symlink_to(tmp_path / "real" / "run.png")
    log.symlink_to(tmp_path / "real" / "run.jsonl")
    outputs = ("--plot", str(png), "--log", str(log))
    # a command that lives past the first sample (one that exits at once may end unsampled)
    short_run = ("--", PY, "-c", "import time; time.sleep(0.2)")
    code, _, err = _monitor(capfd, "--interval", "0.05", *outputs, *short_run)
    assert code == 0, err
    assert png.is_symlink() and log.is_symlink()
    assert (tmp_path / "real" / "run.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "real" / "run.jsonl").read_text()


def test_no_command_and_a_zero_interval_say_what_to_do(capfd: pytest.CaptureFixture[str]) -> None:
    code, _, err = _monitor(capfd)
    assert code == 2 and "give the command after --" in err
    code, _, err = _monitor(capfd, "--interval", "0", "--", PY, "-c", "")
    assert code == 2 and "must be greater than 0" in err


def _baseline_child(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """A cache of the test's own, and the baseline's child faked (330,000 KiB, at once): the
    command lines it was started with."""
    from batchfit.monitor import _runtime

    monkeypatch.setenv("BATCHFIT_CACHE_DIR", str(tmp_path / "cache"))
    runs: list[list[str]] = []

    def child(args: list[str], **_: object) -> subprocess.CompletedProcess[str]:
        runs.append(args)
        return subprocess.CompletedProcess(args, 0, "330000\n", "")

    monkeypatch.setattr(_runtime.subprocess, "run", child)
    return runs


def test_the_runtime_baseline_is_measured_once_per_interpreter_and_its_packages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``monitor --plan`` on the CPU adds what the command's Python holds before its tensors:
    measured by a child that imports torch (seconds), then kept until the interpreter or its
    package folders change."""
    from batchfit.monitor import _runtime

    runs = _baseline_child(tmp_path, monkeypatch)
    prefix = tmp_path / "venv"
    (prefix / "bin").mkdir(parents=True)
    site = prefix / "lib" / "python3.11" / "site-packages"
    site.mkdir(parents=True)
    python = prefix / "bin" / "python"
    python.write_text("")
    assert _runtime.cached_runtime_bytes(str(python)) is None
    assert _runtime.runtime_bytes(str(python)) == 330000 * 1024
    assert _runtime.cached_runtime_bytes(str(python)) == 330000 * 1024 and len(runs) == 1
    (site / "new_package").mkdir()  # pip installed something: measured again
    os.utime(site, ns=(1, 1))
    assert _runtime.cached_runtime_bytes(str(python)) is None


def test_an_interpreter_without_a_package_folder_beside_it_is_measured_every_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pyenv or conda shim (``~/.pyenv/shims/python3``) has no site-packages beside it: its
    packages cannot be stamped, so its baseline is never served from the cache."""
    from batchfit.monitor import _runtime

    _baseline_child(tmp_path, monkeypatch)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    shim = tmp_path / "pyenv" / "shims" / "python3"
    shim.parent.mkdir(parents=True)
    shim.write_text("")
    assert _runtime.runtime_bytes(str(shim)) == 330000 * 1024
    assert _runtime.cached_runtime_bytes(str(shim)) is None
