"""One figure for one thing: each alternative's largest micro-batch is ``estimate``'s verdict,
and its ``estimate_args`` reproduce its figure."""

from __future__ import annotations

import json

import pytest

from tests._cli import run_cli


def _json(args: list[str], capsys: pytest.CaptureFixture[str]) -> dict:
    code, out, err = run_cli([*args, "--json"], capsys)
    assert code == 0, err
    return dict(json.loads(out))


def _with_micro(args: list[str], micro: int) -> list[str]:
    i = args.index("--micro-batch")
    return [*args[: i + 1], str(micro), *args[i + 2 :]]


def _check_alternatives(plan: dict, capsys: pytest.CaptureFixture[str]) -> int:
    """Every alternative's largest micro-batch fits by ``estimate`` with its own arguments and
    the next size does not (unless the per-GPU batch capped the search); the count checked."""
    wanted = plan["headroom_wanted_bytes"]
    per_gpu = plan["global_batch_size"] // plan["num_gpus"]
    checked = 0
    for alt in plan["alternatives"]:
        largest, args = alt["max_micro_batch"], alt["estimate_args"]
        if not largest:
            continue
        est = _json(["estimate", *args], capsys)
        assert est["micro_batch_size"] == largest, alt["techniques"]
        assert est["device_total_bytes"] == alt["device_total_bytes"], alt["techniques"]
        assert est["headroom_bytes"] >= wanted, alt["techniques"]
        if largest < per_gpu:
            over = _json(["estimate", *_with_micro(args, largest + 1)], capsys)
            assert over["headroom_bytes"] < wanted, (alt["techniques"], largest)
        checked += 1
    for row in plan["candidates"]:
        if row["chosen"]:
            est = _json(["estimate", *row["estimate_args"]], capsys)
            assert est["device_total_bytes"] == plan["device_total_bytes"]
    return checked


def test_each_alternative_s_largest_micro_batch_is_estimate_s_verdict_analytic(capsys):
    args = ["plan", "llama-3.2-1b", "--gpu", "h100-80gb", "--num-gpus", "8", "--seq-len", "4096"]
    plan = _json([*args, "--global-batch", "512", "--engine", "analytic"], capsys)
    sharded = {a["techniques"][-1] for a in plan["alternatives"] if a["techniques"]}
    assert {"fsdp", "zero3"} <= sharded
    assert _check_alternatives(plan, capsys) >= 4


GPT2_T4 = ["plan", "gpt2", "--gpu", "t4", "--seq-len", "1024", "--global-batch", "64"]


@pytest.mark.slow
def test_each_alternative_s_largest_micro_batch_is_estimate_s_verdict_traced(capsys):
    plan = _json([*GPT2_T4, "--alternatives", "traced"], capsys)
    assert plan["engine"] == "trace"
    assert not any(alt["from_lines"] for alt in plan["alternatives"])
    assert _check_alternatives(plan, capsys) >= 2


@pytest.mark.slow
def test_by_default_an_alternative_is_traced_at_its_size_but_not_the_next(capsys):
    """The default sizes the alternatives by their peak moments' lines, traced there (marked
    ``from_lines``: the size after it was not traced): ``estimate`` at the size shown gives
    its figure and fits; the plan's own choice is confirmed as before."""
    plan = _json(GPT2_T4, capsys)
    wanted = plan["headroom_wanted_bytes"]
    guessed = [alt for alt in plan["alternatives"] if alt["from_lines"]]
    assert guessed and all(alt["engine"] == "trace" for alt in guessed)
    for alt in guessed:
        est = _json(["estimate", *alt["estimate_args"]], capsys)
        assert est["micro_batch_size"] == alt["max_micro_batch"], alt["techniques"]
        assert est["device_total_bytes"] == alt["device_total_bytes"], alt["techniques"]
        assert est["headroom_bytes"] >= wanted, alt["techniques"]
    for row in plan["candidates"]:
        if row["chosen"]:
            est = _json(["estimate", *row["estimate_args"]], capsys)
            assert est["device_total_bytes"] == plan["device_total_bytes"]
