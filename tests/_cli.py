"""Run the CLI in-process for tests: (exit code, stdout, stderr)."""

from __future__ import annotations

import pytest

from batchfit.cli import main

# The README's contract example: 8 accumulation steps of 16 x 256 tokens = 32768 per step.
CONTRACT = [
    "plan",
    "gpt2",
    "--gpu",
    "rtx-3060",
    "--seq-len",
    "256",
    "--global-batch-tokens",
    "32768",
    "--micro-batch",
    "16",
]


def run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(args)
        raise SystemExit(0)
    captured = capsys.readouterr()
    return int(exc.value.code or 0), captured.out, captured.err
