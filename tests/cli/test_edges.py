"""The edges a script or a newcomer meets first: `estimate --check`'s exit code, `wrote FILE`
on stderr, absurd batches and runs refused in one line, a plan's repr on one screen, errors
named as the caller spells them (the analytic engine: the rules, not the figures, are tested)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from batchfit import PlanRequest, get_gpu, make_plan, resolve_model
from batchfit.errors import UsageError
from tests._cli import run_cli

T4 = get_gpu("t4")
FAST = ["--engine", "analytic"]


@pytest.fixture(scope="module")
def gpt2():
    return resolve_model("gpt2")


@pytest.mark.parametrize(("micro", "code"), [(1, 0), (64, 1)])
def test_estimate_check_exits_1_only_when_the_step_does_not_fit(micro, code, capsys):
    args = ["estimate", "gpt2", "-b", str(micro), "--seq-len", "1024", "--gpu", "t4", *FAST]
    rc, out, _ = run_cli([*args, "--check"], capsys)
    assert rc == code
    assert ("does not fit" in out) == bool(code)
    rc, out, _ = run_cli([*args, "--check", "--json"], capsys)
    assert rc == code and json.loads(out)["fits"] == (code == 0)


def test_estimate_check_needs_a_gpu(capsys):
    rc, _, err = run_cli(["estimate", "gpt2", "-b", "1", "--seq-len", "128", "--check"], capsys)
    assert rc == 2 and "--check" in err and "--gpu" in err and len(err.splitlines()) == 1


def test_an_export_written_to_a_file_says_so_on_stderr(tmp_path: Path, capsys):
    out_file = tmp_path / "args.json"
    plan = ["plan", "gpt2", "--gpu", "t4", "--seq-len", "256", "--global-batch", "32", *FAST]
    rc, out, err = run_cli([*plan, "--export", "hf", "--out", str(out_file)], capsys)
    assert rc == 0 and out_file.exists()
    assert f"wrote {out_file} (the hf export)" in err
    assert "wrote" not in out  # stdout stays the plan's
    rc, out, err = run_cli([*plan, "--export", "hf", "--out", str(out_file), "--json"], capsys)
    assert rc == 0 and f"wrote {out_file}" in err and json.loads(out)["micro_batch_size"]


def test_a_batch_past_a_million_accumulation_steps_is_refused_before_any_trace(gpt2):
    # the trace engine is asked: the refusal comes from the request, before it runs
    with pytest.raises(UsageError, match="accumulation steps") as caught:
        PlanRequest(gpt2, T4, seq_len=1024, global_batch=10**12)
    assert "global_batch" in str(caught.value) and "--" not in str(caught.value)


def test_a_given_micro_batch_counts_its_accumulation_exactly(gpt2):
    PlanRequest(gpt2, T4, seq_len=128, global_batch=10**6, micro_batch_size=1)
    with pytest.raises(UsageError, match="1,000,001 accumulation steps"):
        PlanRequest(gpt2, T4, seq_len=128, global_batch=10**6 + 1, micro_batch_size=1)


def test_a_run_longer_than_a_thousand_years_is_refused(capsys):
    plan = ["plan", "gpt2", "--gpu", "t4", "--seq-len", "1024", "--global-batch", "64000"]
    rc, _, err = run_cli([*plan, *FAST, "--train-tokens", "1e18"], capsys)
    assert rc == 2 and "years" in err and len(err.splitlines()) == 1
    rc, _, _ = run_cli([*plan, *FAST, "--train-tokens", "1e12"], capsys)
    assert rc == 0


def test_python_errors_name_arguments_and_the_command_names_options(gpt2, capsys):
    with pytest.raises(UsageError) as caught:
        PlanRequest(gpt2, T4, seq_len=1024, global_batch=0)
    assert str(caught.value) == "global_batch must be positive, got 0"
    rc, _, err = run_cli(
        ["plan", "gpt2", "--gpu", "t4", "--seq-len", "8", "--global-batch", "0"], capsys
    )
    assert rc == 2 and "--global-batch must be positive" in err
    # the command restores the Python spelling when it returns
    with pytest.raises(UsageError, match=r"^micro_batch_size must be positive"):
        PlanRequest(gpt2, T4, seq_len=1024, global_batch=8, micro_batch_size=0)


def test_a_plan_reprs_in_one_line_and_prints_in_a_screen(gpt2):
    plan = make_plan(
        PlanRequest(gpt2, T4, seq_len=1024, global_batch=64, engine="analytic", train_tokens=10**9)
    )
    text = repr(plan)
    assert "\n" not in text and len(text) < 300
    assert text.startswith("<Plan gpt2 on 1 x t4: micro-batch")
    assert f"x accumulation {plan.grad_accum_steps} x" in text
    assert len(str(plan).splitlines()) <= 40
    assert str(plan).splitlines()[0] in text
