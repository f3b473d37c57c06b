"""Run the CLI in-process for tests: (exit code, stdout, stderr)."""

from __future__ import annotations

import contextlib
import io

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


def run_captured(args: list[str]) -> tuple[int, str, str]:
    """``run_cli`` without ``capsys`` (a module's fixture runs once, before any test's
    capture): stdout and stderr redirected while the command runs."""
    out, err = io.StringIO(), io.StringIO()
    with (
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
        pytest.raises(SystemExit) as exc,
    ):
        main(args)
        raise SystemExit(0)
    return int(exc.value.code or 0), out.getvalue(), err.getvalue()


def plan_setup_flags(plan: dict) -> list[str]:
    """The ``estimate`` flags of a ``plan --json``'s setup: what its techniques set (the time
    model may take a rung even where the setup as given fits: fused AdamW, a lean loss)."""
    setup = plan["setup"]
    every = setup["grad_ckpt_every"]
    flags = ["--grad-ckpt-every", str(every)] if every else []
    flags += ["--grad-ckpt"] if setup["grad_ckpt"] and not every else []
    for flag, key in (
        ("--loss", "loss"),
        ("--method", "method"),
        ("--precision", "precision"),
        ("--optimizer-impl", "optimizer_impl"),
        ("--sharding", "sharding"),
        ("--offload", "offload"),
    ):
        flags += [flag, str(setup[key])]
    return flags
