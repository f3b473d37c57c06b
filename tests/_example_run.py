"""examples/train_tiny_gpt2.py run once per test run, under ``batchfit monitor`` beside the CPU
estimate of its step: what the example printed is read by ``tests/train/test_examples.py``,
what the monitor measured and recorded of it by ``tests/monitor/test_cpu.py`` (the example
imports torch and transformers and plans before it trains: one run, not one per test file).

The first test that needs it runs it, in its own process; under pytest-xdist the other worker
waits for that run and reads the same folder. Where there is no ``/proc`` (the monitor's
source) the example runs alone, for the example's test.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests._cli import run_captured
from tests._per_run import once_per_run
from tests._tiny import EXAMPLE, TINY_GPT2

# the example as its own test runs it: it plans, trains six steps, and recovers from two
# simulated OOMs (micro-batches of 16 and 8 fail half way through backward, 4 runs)
ARGS = ["--steps", "6", "--oom-above", "4"]

# The command under the monitor: the example, its stdout and stderr kept in files (the
# example's test reads them; the monitor's own notes stay apart), and its own resident peak at
# its end (the kernel's VmHWM, read by the run, not sampled by the monitor). Not getrusage: its
# ru_maxrss also counts the pages the child held before exec, which were the test process's
# (torch, transformers: ~1 GiB).
_WRAPPER = """
import os, runpy, sys
out, example, *args = sys.argv[1:]
for fd, name in ((1, "stdout"), (2, "stderr")):
    os.dup2(os.open(os.path.join(out, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
sys.argv = [example, *args]
try:
    runpy.run_path(example, run_name="__main__")
finally:
    sys.stdout.flush()
    sys.stderr.flush()
    hwm = [l.split()[1] for l in open("/proc/self/status") if l.startswith("VmHWM")]
    open(os.path.join(out, "maxrss"), "w").write(hwm[0])
"""


@dataclass(frozen=True)
class ExampleRun:
    """The run's folder: ``stdout``, ``stderr`` (the example's), ``monitor.json`` and
    ``monitor.err`` (the monitor's stdout and stderr), ``maxrss`` (KiB), ``estimate.json``
    (the plan given to the monitor), ``data/`` (its calibration records)."""

    folder: Path
    exit_code: int  # the monitor's, which is the example's

    def text(self, name: str) -> str:
        return (self.folder / name).read_text()

    @property
    def data_dir(self) -> Path:
        return self.folder / "data"


def example_run(request: pytest.FixtureRequest) -> ExampleRun:
    """This test run's one run of the example (made here if no test made it yet)."""
    out, done = once_per_run(
        request, "train-tiny-gpt2-example", lambda out: {"exit_code": _run(out)}
    )
    assert "error" not in done, done["error"]
    return ExampleRun(out, done["exit_code"])


def _run(out: Path) -> int:
    """The example's exit code, run under the monitor with the estimate of its step."""
    if sys.platform != "linux":
        with open(out / "stdout", "w") as stdout, open(out / "stderr", "w") as stderr:
            args = [sys.executable, str(EXAMPLE), *ARGS]
            return subprocess.run(args, stdout=stdout, stderr=stderr, timeout=120).returncode
    # the step the example runs first: its config (TINY_GPT2, the example's CONFIG, as its
    # --write-config writes it), micro-batch 16 of 32 tokens
    config = out / "config.json"
    config.write_text(json.dumps(TINY_GPT2, indent=2) + "\n")
    code, estimate, err = run_captured(
        ["estimate", str(config), "--device", "cpu", "-b", "16", "-s", "32", "--json"]
    )
    assert code == 0, err
    plan = out / "estimate.json"
    plan.write_text(estimate)
    monitor = ["monitor", "--json", "--interval", "0.5", "--plan", str(plan), "--"]
    command = [sys.executable, "-c", _WRAPPER, str(out), str(EXAMPLE), *ARGS]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BATCHFIT_DATA_DIR", str(out / "data"))
        code, summary, err = run_captured([*monitor, *command])
    (out / "monitor.json").write_text(summary)
    (out / "monitor.err").write_text(err)
    return code
