"""``plan --num-gpus auto``: one plan per GPU count up to a
limit, each ranked by the time model, and the count where more GPUs stop paying for
themselves. The analytic engine answers (the trace is not the subject)."""

from __future__ import annotations

import json

import pytest

from batchfit.errors import UsageError
from batchfit.hardware import get_gpu
from batchfit.models import resolve_model
from batchfit.plan import make_plan, make_plan_auto
from batchfit.plan._gpu_count import AUTO_EFFICIENCY, choose, gpu_counts
from batchfit.spec import TrainingSetup
from tests._cli import run_cli

GPT2 = ["gpt2", "--gpu", "a100-80gb", "--seq-len", "1024", "--engine", "analytic"]


def _auto(model: str, gpu: str, max_gpus: int, **kwargs: object):  # type: ignore[no-untyped-def]
    return make_plan_auto(
        resolve_model(model),
        get_gpu(gpu),
        TrainingSetup(),
        max_gpus=max_gpus,
        engine="analytic",
        **kwargs,
    )


def test_counts_are_powers_of_two_then_the_limit() -> None:
    assert gpu_counts(16) == [1, 2, 4, 8, 16]
    assert gpu_counts(12) == [1, 2, 4, 8, 12]
    for bad in (0, -2, 10**6):
        with pytest.raises(UsageError, match="max_gpus"):
            gpu_counts(bad)


def test_each_count_is_the_plan_make_plan_gives_for_it() -> None:
    p = _auto("gpt2", "a100-80gb", 4, seq_len=1024, global_batch=96)
    assert [c.num_gpus for c in p.gpu_counts] == [1, 2, 4]
    for c in p.gpu_counts:
        alone = make_plan(
            resolve_model("gpt2"),
            get_gpu("a100-80gb"),
            TrainingSetup(num_gpus=c.num_gpus),
            seq_len=1024,
            global_batch=96,
            engine="analytic",
        )
        assert (c.micro_batch_size, c.grad_accum_steps) == (
            alone.micro_batch_size,
            alone.grad_accum_steps,
        )
        assert c.step_seconds == pytest.approx(alone.step_seconds)
    chosen = [c for c in p.gpu_counts if c.chosen]
    assert len(chosen) == 1 and chosen[0].num_gpus == p.num_gpus
    assert p.micro_batch_size * p.grad_accum_steps * p.num_gpus == 96


def test_the_pick_is_the_most_gpus_that_keep_the_efficiency() -> None:
    # gpt2 at 96 samples: each GPU's micro-batch shrinks as the count grows, and the time
    # model's utilisation with it; the pick follows the rule on the figures it printed
    p = _auto("gpt2", "a100-80gb", 8, seq_len=1024, global_batch=96, train_tokens=10**9)
    rows = [c for c in p.gpu_counts if c.fits]
    best = max(c.tokens_per_s_per_gpu or 0 for c in rows)
    for c in rows:
        assert c.efficiency == pytest.approx((c.tokens_per_s_per_gpu or 0) / best)
    keep = [c.num_gpus for c in rows if (c.efficiency or 0) >= AUTO_EFFICIENCY]
    assert p.num_gpus == max(keep)
    # the counts it passed over are less efficient: some were (the rule did something)
    assert any((c.efficiency or 1) < AUTO_EFFICIENCY for c in rows)
    assert p.gpu_count_rule and f"{AUTO_EFFICIENCY:.0%}" in p.gpu_count_rule
    # more GPUs never take longer per step in this table, and the run's time shrinks
    seconds = [c.step_seconds or 0 for c in rows]
    assert seconds == sorted(seconds, reverse=True)


def test_a_count_the_batch_does_not_split_over_is_left_out_with_its_reason() -> None:
    p = _auto("gpt2", "a100-80gb", 6, seq_len=1024, global_batch=36)  # 36 % 4 == 0, % 6 == 0
    by_n = {c.num_gpus: c for c in p.gpu_counts}
    assert set(by_n) == {1, 2, 4, 6}
    p = _auto("gpt2", "a100-80gb", 4, seq_len=1024, global_batch=6)  # 6 % 4 != 0
    four = next(c for c in p.gpu_counts if c.num_gpus == 4)
    assert not four.fits and "cannot be split evenly over 4 GPUs" in four.note
    assert p.num_gpus in (1, 2)


def test_no_count_at_all_is_one_line() -> None:
    def never(n: int):  # type: ignore[no-untyped-def]
        raise UsageError(f"nothing on {n}")

    with pytest.raises(UsageError, match="no GPU count to plan on"):
        choose(never, 2)


def test_cli_json_and_table(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", *GPT2, "--global-batch", "96", "--num-gpus", "auto", "--max-gpus", "4"]
    code, out, err = run_cli([*args, "--json"], capsys)
    assert code == 0, err
    data = json.loads(out)
    assert [c["num_gpus"] for c in data["gpu_counts"]] == [1, 2, 4]
    assert sum(c["chosen"] for c in data["gpu_counts"]) == 1
    assert data["num_gpus"] == next(c["num_gpus"] for c in data["gpu_counts"] if c["chosen"])
    assert data["gpu_count_rule"]
    code, out, err = run_cli(args, capsys)
    assert code == 0, err
    assert "GPU counts (--num-gpus auto)" in out and "tokens/s/GPU" in out
    assert "1 GPU: " in out and "eff." in out


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["plan", *GPT2, "--global-batch", "8", "--num-gpus", "two"], "whole number"),
        (["estimate", *GPT2, "-b", "1", "--num-gpus", "auto"], "for `batchfit plan`"),
        (["plan", *GPT2, "--global-batch", "8", "--max-gpus", "4"], "goes with --num-gpus auto"),
        (
            ["plan", *GPT2, "--global-batch", "8", "--num-gpus", "auto", "--max-gpus", "0"],
            "--max-gpus must be",
        ),
    ],
)
def test_bad_input_is_one_line(
    args: list[str], match: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run_cli(args, capsys)
    assert code == 2
    assert match in err and "Traceback" not in err


def test_ddp_is_named_on_several_gpus(capsys: pytest.CaptureFixture[str]) -> None:
    """A plan (or a rung) on several GPUs without sharding says it is DDP."""
    args = ["plan", *GPT2, "--global-batch", "64", "--num-gpus", "4"]
    code, out, err = run_cli([*args, "--json"], capsys)
    assert code == 0, err
    ddp_chosen = json.loads(out)["setup"]["sharding"] in ("none", "ddp")
    code, out, err = run_cli(args, capsys)
    assert code == 0, err
    assert ("sharding: none (DDP" in out) == ddp_chosen
    assert "ddp +" in out  # the rungs (the terminal may fold the rest of the name)
    code, out, err = run_cli(["plan", *GPT2, "--global-batch", "64"], capsys)  # one GPU
    assert code == 0, err
    assert "DDP" not in out and "ddp +" not in out
