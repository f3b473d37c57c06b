"""Variable lengths: --lengths FILE[:WEIGHT] and --padding longest|max|packed."""

from __future__ import annotations

import json
import math

import pytest

from batchfit.errors import UsageError
from batchfit.lengths import workload
from tests._cli import run_cli


@pytest.fixture
def files(tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("# one task\n64\n128\n\n96\n")
    long = tmp_path / "long.json"
    long.write_text(json.dumps({"200": 10, "700": 1}))
    return str(short), str(long)


def test_memory_follows_the_longest_sample_not_the_number_of_datasets(files):
    short, long = files
    one = workload([short], "longest", None)
    assert (one.seq_len, one.longest, one.mean, one.samples) == (128, 128, 96.0, 3)
    mixed = workload([short, long], "longest", None)
    assert mixed.seq_len == 700  # the longest sample of any dataset in the mixture
    # a second dataset no longer than the first changes the mean, not the worst micro-batch
    same_longest = workload([short, short], "longest", None)
    assert same_longest.seq_len == one.seq_len
    assert workload([short, long], "longest", 512).seq_len == 512  # truncation
    assert workload([short], "max", 512).seq_len == 512
    packed = workload([short, long], "packed", 1024)
    # every packed row is full: a step takes --seq-len tokens a row; the mean is the data's
    assert (packed.seq_len, packed.tokens_per_sample) == (1024, 1024.0)
    assert packed.mean == pytest.approx((96 + 2700 / 11) / 2)


def test_mixture_weights_move_the_mean(files):
    short, long = files
    even = workload([short, long], "longest", None).mean
    heavy = workload([short, f"{long}:9"], "longest", None).mean
    assert heavy > even


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("", "has no lengths"),
        ("12\nabc\n", "line 2: 'abc' is not a length"),
        ("12\n0\n", "line 2: a length must be positive"),
        ("12\n-5\n", "a length must be positive"),
        ("[1, 2]", "line 1"),
        ('{"12": "x"}', "entry '12'"),
        ('{"12": 3', "not valid JSON"),
    ],
)
def test_bad_length_files_are_one_line_naming_the_line(tmp_path, content, message, capsys):
    path = tmp_path / "bad.txt"
    path.write_text(content)
    with pytest.raises(UsageError, match=message):
        workload([str(path)], "longest", None)
    code, out, err = run_cli(
        ["estimate", "gpt2", "-b", "1", "--lengths", str(path), "--engine", "analytic"], capsys
    )
    assert code == 2 and not out and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--lengths", "/nonexistent/lengths.txt"], "is not a readable file"),
        (["--padding", "packed", "-s", "64"], "--padding needs --lengths"),
        ([], "give --seq-len"),
        (["--lengths", "LENGTHS", "--padding", "packed"], "needs --seq-len"),
        (["--lengths", "LENGTHS", "--padding", "ragged"], "--padding 'ragged' is not one of"),
        (["--lengths", "TOO_LONG"], "more than gpt2's 1024 learned positions"),
    ],
)
def test_cli_length_options_are_checked(tmp_path, args, message, capsys):
    lengths = tmp_path / "l.txt"
    lengths.write_text("100\n")
    too_long = tmp_path / "long.txt"
    too_long.write_text("5000\n")
    args = [{"LENGTHS": str(lengths), "TOO_LONG": str(too_long)}.get(a, a) for a in args]
    code, out, err = run_cli(["estimate", "gpt2", "-b", "1", "--engine", "analytic", *args], capsys)
    assert code == 2 and not out and message in err, err


def test_plan_and_estimate_use_the_worst_micro_batch(files, capsys):
    short, long = files
    base = ["--engine", "analytic", "--json", "--lengths", short, "--lengths", long]
    code, out, err = run_cli(["plan", "gpt2", "--gpu", "t4", "--global-batch", "32", *base], capsys)
    assert code == 0, err
    plan = json.loads(out)
    assert plan["seq_len"] == 700 and plan["lengths"]["seq_len_for_memory"] == 700
    code, out, err = run_cli(["estimate", "gpt2", "-b", "4", *base], capsys)
    est = json.loads(out)
    code, out, err = run_cli(
        ["estimate", "gpt2", "-b", "4", "-s", "700", "--engine", "analytic", "--json"], capsys
    )
    assert est["peak_bytes"] == json.loads(out)["peak_bytes"]


def test_time_follows_each_micro_batch_s_longest_sample(files):
    short, long = files
    mixed = workload([short, long], "longest", None)
    # one sample a micro-batch computes the mean; more take the expected longest of them,
    # which grows towards the longest sample and never passes it
    assert mixed.timed_length(1) == pytest.approx(mixed.mean)
    grown = [mixed.timed_length(n) for n in (1, 2, 8, 64, 4096)]
    assert grown == sorted(grown) and grown[-1] == pytest.approx(700)
    # by hand: 64, 96, 128 (half the mass), 200 x 10/11 and 700 x 1/11 (the other half)
    below = {64: 1 / 6, 96: 2 / 6, 128: 3 / 6, 200: 3 / 6 + 5 / 11, 700: 1.0}
    cdf = [0.0, *below.values()]
    by_hand = sum(n * (cdf[i + 1] ** 2 - cdf[i] ** 2) for i, n in enumerate(below))
    assert mixed.timed_length(2) == pytest.approx(by_hand)
    # truncated at --seq-len, the longest is the cut
    assert workload([short, long], "longest", 150).timed_length(4096) == pytest.approx(150)
    # packed and padded rows are always --seq-len long
    assert workload([short, long], "packed", 1024).timed_length(8) == 1024.0
    assert workload([short, long], "max", 512).timed_length(8) == 512.0


def test_step_time_reads_the_lengths_a_micro_batch_computes(files, capsys):
    short, long = files
    base = ["gpt2", "--gpu", "a100-80gb", "--engine", "analytic", "--json"]
    lengths = ["--lengths", short, "--lengths", long]
    code, out, err = run_cli(["estimate", *base, "-b", "4", *lengths], capsys)
    assert code == 0, err
    dynamic = json.loads(out)
    timed = dynamic["lengths"]["timed_tokens_per_sample"]
    assert 96 < timed < 700
    # the same step as a fixed length of that many tokens (memory stays at the worst, 700)
    code, out, err = run_cli(["estimate", *base, "-b", "4", "-s", str(round(timed))], capsys)
    fixed = json.loads(out)
    assert dynamic["step_seconds"] == pytest.approx(fixed["step_seconds"])
    code, out, err = run_cli(["estimate", *base, "-b", "4", "-s", "700"], capsys)
    assert dynamic["peak_bytes"] == json.loads(out)["peak_bytes"]
    assert dynamic["step_seconds"] < json.loads(out)["step_seconds"]
    # a plan's alternatives are timed the same way: fewer seconds than at the worst length
    code, out, err = run_cli(["plan", *base, "--global-batch", "32", *lengths], capsys)
    plan = json.loads(out)
    code, out, err = run_cli(["plan", *base, "--global-batch", "32", "-s", "700"], capsys)
    worst = json.loads(out)
    assert plan["micro_batch_size"] == worst["micro_batch_size"]
    assert plan["step_seconds"] < worst["step_seconds"]
    assert plan["lengths"]["timed_tokens_per_sample"] < 700
    # the dataset's tokens a step takes are the samples' mean (padding not counted), and the
    # plan's estimate arguments carry the lengths, so the estimate times the same step
    mean = plan["lengths"]["mean"]
    assert plan["tokens_per_step"] == round(32 * mean)
    args = plan["candidates"][0]["estimate_args"]
    assert args[args.index("--padding") + 1] == "longest" and args.count("--lengths") == 2
    code, out, err = run_cli(["estimate", *args, "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["step_seconds"] == pytest.approx(plan["step_seconds"])
    # --train-tokens counts the dataset's tokens: a step takes 32 x the mean
    run = ["plan", *base, "--global-batch", "32", *lengths, "--train-tokens", "1000000"]
    code, out, err = run_cli(run, capsys)
    assert code == 0, err
    assert json.loads(out)["train_steps"] == math.ceil(1_000_000 / (32 * mean))


def test_a_token_target_needs_fixed_tokens_per_sample(files, capsys):
    short, _ = files
    args = ["plan", "gpt2", "--gpu", "t4", "--global-batch-tokens", "65536", "-s", "1024"]
    code, out, err = run_cli([*args, "--lengths", short, "--engine", "analytic"], capsys)
    assert code == 2 and "dynamic padding" in err
    code, out, err = run_cli(
        [*args, "--lengths", short, "--padding", "packed", "--engine", "analytic", "--json"],
        capsys,
    )
    assert code == 0 and json.loads(out)["tokens_per_step"] == 65536


def test_lengths_messages_name_the_real_problem(tmp_path, capsys):
    lengths = tmp_path / "l.txt"
    lengths.write_text("100\n2000\n")
    code, _, err = run_cli(
        ["estimate", "gpt2", "-b", "2", "--lengths", str(lengths), "--seq-len", "2048"], capsys
    )
    assert code == 2 and "--seq-len 2048 is more than gpt2's 1024" in err
    code, _, err = run_cli(["estimate", "gpt2", "-b", "2", "--lengths", f"{lengths}:abc"], capsys)
    assert code == 2 and "the weight after ':'" in err
