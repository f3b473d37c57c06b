"""``gpus`` and ``plan`` do not trace an option the formulas put far past the card (over
``PRUNE_MARGIN`` at micro-batch 1): it cannot fit by the trace either. A row where nothing
fits still shows its choice traced; a plan's alternative shows the formulas' figure, marked."""

from __future__ import annotations

from dataclasses import replace

import pytest

from batchfit.hardware import get_gpu
from batchfit.models import resolve_model
from batchfit.plan import _fit_table
from batchfit.plan._ladder import LORA
from batchfit.spec import TrainingSetup

GIB = 2**30


@pytest.fixture
def engines(monkeypatch: pytest.MonkeyPatch) -> list[tuple[TrainingSetup, int, str]]:
    """Every (setup, micro-batch, engine) the table estimates."""
    calls: list[tuple[TrainingSetup, int, str]] = []
    real = _fit_table.fits

    def spy(model, setup, gpu, micro, seq, accum, headroom, engine="analytic"):  # type: ignore[no-untyped-def]
        calls.append((setup, micro, engine))
        return real(model, setup, gpu, micro, seq, accum, headroom, engine)

    monkeypatch.setattr(_fit_table, "fits", spy)
    return calls


def test_an_option_far_past_the_card_is_not_traced(engines) -> None:
    gpt2 = resolve_model("gpt2")
    # GPT-2's full AdamW step holds ~2 GiB of weights, gradients and state: far past 1.2 GiB
    small = replace(get_gpu("t4"), memory_bytes=int(1.2 * GIB))
    row = _fit_table._OnGpu(gpt2, TrainingSetup(), small, 256, GIB // 8, "trace")
    assert row.largest(()) == 0
    assert [e for _, _, e in engines if e == "trace"] == []
    # LoRA freezes the weights: within reach, so its lines are traced
    assert row.largest((LORA,)) > 0
    assert {m for _, m, e in engines if e == "trace"} >= {1, 2}


def test_a_row_where_nothing_fits_is_traced_at_size_one(engines) -> None:
    gpt2 = resolve_model("gpt2")
    # 750 MiB to use: LoRA's ~840 MiB by the formulas is within reach (traced, does not
    # fit); every full fine-tuning option (1.8 GiB and up) is not
    small = replace(get_gpu("t4"), memory_bytes=int(1.2 * GIB))
    (row,) = _fit_table.fit_table(
        gpt2, TrainingSetup(), [small], seq_len=256, headroom_bytes=480 * 2**20
    )
    assert row.max_micro_batch == 0 and row.engine == "trace"
    traced = [(s.method, m) for s, m, e in engines if e == "trace"]
    # the adapters' lines, then the row's figure: the setup as given at size 1
    assert {method for method, _ in traced[:-1]} == {"lora", "qlora"}
    assert traced[-1] == ("full", 1) and traced.count(("full", 1)) == 1


def test_a_plan_shows_an_option_far_past_the_card_by_the_formulas_marked(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Llama-3.1-8B on an A100-40GB: full fine-tuning needs over 150 GiB; the plan takes
    ZeRO-2 with CPU offload (the formulas' rung: the trace cannot run it yet), so no dry run
    is needed at all."""
    import json

    from batchfit.memory.trace import hf
    from tests._cli import run_cli

    def no_dry_run(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("traced an option the formulas put far past the card")

    monkeypatch.setattr(hf, "trace_once", no_dry_run)
    args = ["llama-3.1-8b", "--gpu", "a100-40gb", "--seq-len", "4096"]
    code, out, err = run_cli(["plan", *args, "--global-batch-tokens", "1048576"], capsys)
    assert code == 0, err
    assert "fused-adamw (formulas)" in out and "(formulas): not traced" in out
    code, out, err = run_cli(["plan", *args, "--global-batch-tokens", "1048576", "--json"], capsys)
    plan = json.loads(out)
    (fused,) = [a for a in plan["alternatives"] if a["techniques"] == ["fused-adamw"]]
    assert fused["beyond_reach"] and fused["max_micro_batch"] == 0
    assert fused["engine"] == "analytic"
    assert fused["device_total_bytes"] > 1.25 * get_gpu("a100-40gb").memory_bytes
    names = [t["name"] for t in plan["techniques"]]
    assert "zero2" in names and plan["micro_batch_size"] == 8
