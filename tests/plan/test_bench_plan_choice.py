"""benchmarks/plan_choice.py: its brute force holds the planner's own choice, and never
reports an option slower than it as the best (two small cases, analytic engine)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "plan_choice.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("plan_choice", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["plan_choice"] = module  # dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("plan_choice", None)


def _cases(bench):
    return [
        bench.Case("tiny-1gpu", "gpt2", "t4", 1, 512, "auto", global_batch=32),
        bench.Case("tiny-2gpu", "gpt2", "a100-40gb", 2, 512, "amp-bf16", global_batch_tokens=16384),
    ]


def test_the_brute_force_holds_the_planner_s_choice(bench):
    rows = [bench.evaluate(c) for c in _cases(bench)]
    for row in rows:
        assert row["chosen_exact"]
        assert row["chosen_in_candidates"], row["case"]["name"]
        # the best is the fastest of a set that holds the choice: never slower than it
        assert row["gap"] >= -1e-9
        assert row["best"]["step_seconds"] <= row["chosen"]["step_seconds"] * (1 + 1e-9)
        assert (
            row["best"]["micro_batch_size"] * row["best"]["grad_accum_steps"]
            == (row["per_gpu_batch"])
        )
        parts = [v for v in row["gap_parts"].values() if v is not None]
        product = 1.0
        for v in parts:
            product *= 1 + v
        assert product == pytest.approx(1 + row["gap"])
    # gpt2 fits a T4 as given: the planner takes the plain setup, fused AdamW is faster
    assert rows[0]["chosen"]["techniques"] == "-"
    table = bench.table(rows)
    assert table.count("\n") == 2 + len(rows)
    summary = bench.summary(rows)
    assert summary["compared"] == 2 and not summary["chosen_missing_from_candidates"]


def test_the_draw_is_fixed(bench):
    a, b = bench.draw_cases(5), bench.draw_cases(5)
    assert a == b and len({c.name for c in a}) == 5
    for c in a:
        per = c.global_batch_tokens // c.seq_len if c.global_batch_tokens else c.global_batch
        assert per % c.num_gpus == 0
