"""``estimate`` with the plan's flags gives the plan's time as well as its memory: the step
time counts every micro-step of the optimizer step (``--grad-accum``), as the plan's does."""

from __future__ import annotations

import json

import pytest

from tests._cli import plan_setup_flags, run_cli

ARGS = ["llama-3.2-1b", "--gpu", "h100-80gb", "--seq-len", "2048", "--engine", "analytic"]


def test_estimate_step_counts_the_accumulation(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(["plan", *ARGS, "--global-batch", "512", "--json"], capsys)
    assert code == 0, err
    plan = json.loads(out)
    micro, accum = plan["micro_batch_size"], plan["grad_accum_steps"]
    assert accum > 1  # the case must accumulate to test anything
    flags = ["-b", str(micro), "--grad-accum", str(accum), "--json", *plan_setup_flags(plan)]
    code, out, err = run_cli(["estimate", *ARGS, *flags], capsys)
    assert code == 0, err
    est = json.loads(out)
    assert est["step_seconds"] == pytest.approx(plan["step_seconds"], rel=1e-6)
    assert est["tokens_per_s_per_gpu"] == pytest.approx(plan["tokens_per_s_per_gpu"], rel=1e-6)
    one_flags = ["-b", str(micro), "--json", *plan_setup_flags(plan)]
    code, out, err = run_cli(["estimate", *ARGS, *one_flags], capsys)
    one = json.loads(out)
    # one micro-step and its update, against accum of them and one update
    assert accum * 0.9 * one["step_seconds"] < est["step_seconds"] < accum * one["step_seconds"]
