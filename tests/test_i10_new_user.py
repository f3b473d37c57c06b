"""Defects a new user found in issue #10's work (each test failed before its fix)."""

from __future__ import annotations

import copy
import json

import pytest

from batchfit import _cache
from batchfit.hardware import get_gpu
from batchfit.memory.estimate import estimate
from batchfit.models import resolve_model
from batchfit.plan import fit_table, make_plan
from batchfit.spec import TrainingSetup
from tests._cli import run_cli
from tests.models.test_i10_bart import BART_BASE

pytestmark = pytest.mark.slow


def test_a_trace_leaves_the_config_as_it_was_so_the_cache_hits(tmp_path, monkeypatch):
    # transformers added rope_theta to llama-3.2's rope_scaling dict in place: the cache key
    # at store time differed from the one at load time, and every run traced again
    monkeypatch.setenv("BATCHFIT_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("BATCHFIT_NO_CACHE", raising=False)
    info = resolve_model("llama-3.2-1b")
    before = copy.deepcopy(info.config)
    kw = {"micro_batch_size": 1, "seq_len": 128, "gpu": get_gpu("t4"), "engine": "trace"}
    first = estimate(info, TrainingSetup(), **kw)  # type: ignore[arg-type]
    assert info.config == before
    stored = sorted(tmp_path.rglob("*.json"))
    assert stored
    again = estimate(resolve_model("llama-3.2-1b"), TrainingSetup(), **kw)  # type: ignore[arg-type]
    assert sorted(tmp_path.rglob("*.json")) == stored  # a hit: nothing new written
    assert again.peak_bytes == first.peak_bytes


def test_unequal_encoder_and_decoder_depths_are_traced_whole(tmp_path):
    def peak(encoder: int, decoder: int) -> tuple[int, int, int]:
        cfg = {**BART_BASE, "encoder_layers": encoder, "decoder_layers": decoder}
        path = tmp_path / f"{encoder}-{decoder}.json"
        path.write_text(json.dumps(cfg))
        info = resolve_model(str(path))
        est = estimate(
            info,
            TrainingSetup(precision="fp32"),
            micro_batch_size=2,
            seq_len=128,
            device="cpu",
            engine="trace",
        )
        return est.components["weights"], info.total_params, est.peak_bytes

    weights, params, short_decoder = peak(6, 1)
    assert weights == pytest.approx(4 * params, rel=0.001)  # the model it was asked about
    _, _, equal = peak(6, 6)
    assert short_decoder < equal


def test_rows_the_trace_cannot_run_say_the_analytic_engine_answered(capsys):
    info = resolve_model("llama-3.2-1b")
    rows = fit_table(info, TrainingSetup(), [get_gpu("t4")], seq_len=2048)
    (row,) = rows
    assert any(t.name.startswith(("zero", "qlora")) for t in row.techniques)
    assert row.engine == "analytic" and row.to_json()["engine"] == "analytic"
    code, out, _ = run_cli(["gpus", "llama-3.2-1b", "--seq-len", "2048"], capsys)
    assert code == 0 and "(analytic)" in out


def test_the_largest_micro_batch_does_not_depend_on_the_global_batch():
    # at micro-batch m below the per-GPU batch a plan accumulates: the largest size that fits
    # is the same for every global batch it is below
    info = resolve_model("bert-base-uncased", "classification")
    t4 = get_gpu("t4")
    sizes = {
        make_plan(
            info, t4, TrainingSetup(), seq_len=512, global_batch=g, engine="analytic"
        ).max_micro_batch
        for g in (128, 256, 512)  # above the largest size: no cap
    }
    assert len(sizes) == 1


def test_headroom_zero_is_allowed_and_more_than_the_card_is_one_line(capsys):
    base = ["plan", "gpt2", "--gpu", "t4", "--seq-len", "256", "--global-batch", "8"]
    code, out, err = run_cli([*base, "--engine", "analytic", "--headroom", "0", "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["headroom_bytes"] > 0
    code, out, err = run_cli([*base, "--engine", "analytic", "--headroom", "20GiB"], capsys)
    assert code == 2 and not out
    assert "--headroom 20GiB is all of t4's" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(("value", "off"), [("1", True), ("yes", True), ("0", False), ("", False)])
def test_any_no_cache_value_but_a_false_one_switches_the_cache_off(monkeypatch, value, off):
    monkeypatch.setenv("BATCHFIT_NO_CACHE", value)
    assert _cache.enabled() is not off
