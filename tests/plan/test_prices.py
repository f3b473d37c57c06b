"""The default GPU-hour price table (``catalog/prices.json``): dated, sourced, approximate; a
plan's cost uses it unless ``--gpu-hour-price`` says otherwise."""

import datetime
import json

import pytest

from batchfit import catalog
from batchfit.hardware import all_gpus
from batchfit.plan._prices import gpu_hour_price, price_table
from tests._cli import run_cli

RUN = ["--seq-len", "256", "--global-batch", "32", "--train-tokens", "100000000"]


def _plan(gpu, *extra):
    return ["plan", "gpt2", "--gpu", gpu, *RUN, "--engine", "analytic", *extra]


def test_the_table_is_dated_approximate_and_every_price_has_a_source():
    data = catalog.load("prices")
    assert datetime.date.fromisoformat(data["as_of"]) and data["approximate"] is True
    gpus = [row["gpu"] for row in data["prices"]]
    assert len(gpus) == len(set(gpus)) and set(gpus) <= set(all_gpus())
    for row in data["prices"]:
        assert 0 < row["usd_per_gpu_hour"] < 100, row
        assert "http" in row["source"] or "pricing page" in row["source"], row
    table = price_table()
    assert set(table) == set(gpus)
    assert all(p.source.endswith(f"approximate, as of {data['as_of']}") for p in table.values())


def test_gpus_without_a_confident_price_have_none():
    assert gpu_hour_price(None, "rtx-3060") is None and gpu_hour_price(None, "p100") is None
    assert gpu_hour_price(2.0, "rtx-3060").source == "--gpu-hour-price"


def test_the_plan_costs_at_the_table_price_and_says_whose(capsys):
    code, out, err = run_cli([*_plan("t4"), "--json"], capsys)
    assert code == 0, err
    plan = json.loads(out)
    t4 = price_table()["t4"]
    assert plan["gpu_hour_price"] == t4.usd and plan["price_source"] == t4.source
    hours = plan["train_seconds"] / 3600 * plan["num_gpus"]
    assert plan["cost_usd"] == pytest.approx(hours * t4.usd)
    assert plan["candidates"][0]["cost_usd"] == pytest.approx(plan["cost_usd"])
    code, out, err = run_cli(_plan("t4"), capsys)
    assert code == 0, err
    flat = " ".join(out.split())
    assert f"at ${t4.usd:g}/GPU-hour ({t4.source})" in flat


def test_the_flag_overrides_the_table(capsys):
    code, out, err = run_cli([*_plan("t4", "--gpu-hour-price", "2"), "--json"], capsys)
    assert code == 0, err
    plan = json.loads(out)
    assert plan["gpu_hour_price"] == 2.0 and plan["price_source"] == "--gpu-hour-price"
    hours = plan["train_seconds"] / 3600 * plan["num_gpus"]
    assert plan["cost_usd"] == pytest.approx(2.0 * hours)


def test_a_gpu_without_a_price_has_no_cost_and_says_how_to_add_one(capsys):
    code, out, err = run_cli([*_plan("rtx-3060"), "--json"], capsys)
    assert code == 0, err
    plan = json.loads(out)
    assert plan["train_seconds"] and plan["cost_usd"] is None and plan["price_source"] is None
    code, out, err = run_cli(_plan("rtx-3060"), capsys)
    assert "--gpu-hour-price USD adds the cost" in " ".join(out.split())


@pytest.mark.parametrize("price", ["-1", "0", "nan", "inf", "cheap"])
def test_a_bad_price_exits_2_in_one_line(capsys, price):
    code, out, err = run_cli(_plan("t4", "--gpu-hour-price", price), capsys)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "--gpu-hour-price" in err


@pytest.mark.parametrize("tokens", ["1e400", "1e19", "-10B", "0", "inf", "many"])
def test_a_bad_token_count_exits_2_in_one_line(capsys, tokens):
    args = ["plan", "gpt2", "--gpu", "t4", "--seq-len", "256", "--global-batch", "32"]
    code, out, err = run_cli([*args, "--train-tokens", tokens, "--engine", "analytic"], capsys)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "--train-tokens" in err and "Traceback" not in err
