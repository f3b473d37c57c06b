"""``examples/train_tiny_gpt2.py`` runs: it plans, trains, recovers from OOMs, and learns."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_train_tiny_gpt2() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "train_tiny_gpt2.py"),
            "--steps",
            "6",
            "--oom-above",
            "4",
        ],
        env={
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "OMP_NUM_THREADS": "1",
        },
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(
        r"plan on t4: micro-batch \d+ x accumulation \d+ = global batch 32", proc.stdout
    )
    assert "out of memory at micro-batch 16" in proc.stderr
    assert "out of memory at micro-batch 8" in proc.stderr
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", proc.stdout).groups())
    assert last < first
    assert "OOMs recovered in all: 2" in proc.stdout
