"""A plan's searches start from the formulas corrected by what the trace measured on a setup
with the same activations: a rung that changes only the optimizer is found in one traced
size where the formulas alone take three; other activations keep the formulas' seed."""

from __future__ import annotations

from dataclasses import replace

import pytest

from batchfit.hardware import get_gpu
from batchfit.memory.types import MemoryEstimate
from batchfit.models import resolve_model
from batchfit.plan import _max_micro_batch
from batchfit.plan._target import _Target
from batchfit.spec import TrainingSetup

GIB = 1 << 30
BASE = TrainingSetup(grad_ckpt=True)
EIGHT_BIT = replace(BASE, optimizer="adamw-8bit")


@pytest.fixture
def traced(monkeypatch: pytest.MonkeyPatch) -> list[tuple[TrainingSetup, int]]:
    """``fits`` by two laws: the formulas 2 GiB + 0.5 GiB per sample (1 GiB less with 8-bit
    AdamW), the trace 0.1 GiB more per sample than they say. The sizes traced, per setup."""
    calls: list[tuple[TrainingSetup, int]] = []

    def fits(model, setup, gpu, micro, seq_len, accum, headroom, engine="analytic"):
        total = (2 - (setup.optimizer == "adamw-8bit")) * GIB + micro * GIB // 2
        if engine == "trace":
            calls.append((setup, micro))
            total += micro * GIB // 10
        est = MemoryEstimate(
            "m", engine, "cuda", micro, seq_len, setup, {}, total, total, total, 0, 0, "backward"
        )
        return total <= gpu.memory_bytes - headroom, est

    monkeypatch.setattr(_max_micro_batch, "fits", fits)
    return calls


def _target() -> _Target:
    return _Target(resolve_model("gpt2"), get_gpu("t4"), 1024, 64, GIB // 2, "trace")


def test_a_rung_that_changes_only_the_optimizer_is_found_at_once(traced) -> None:
    target = _target()
    assert target.max_micro(BASE) == 20  # (15 - 0.5 - 2) / 0.6: 20.8
    first = len(traced)
    alt = target.alternative((), EIGHT_BIT)
    assert alt.max_micro_batch == 22  # (15 - 0.5 - 1) / 0.6: 22.5
    assert [b for _, b in traced[first:]] == [22]  # the corrected formulas' answer, once


def test_without_a_like_setup_the_formulas_seed_the_search(traced) -> None:
    target = _target()
    target.alternative((), EIGHT_BIT)
    assert traced[0][1] == 27  # the formulas' own answer: 0.5 GiB per sample
    assert target.correction(replace(EIGHT_BIT, loss="chunked")) is None
    assert target.correction(replace(BASE, optimizer="sgd")) is not None


def test_every_kth_layer_is_seeded_by_a_blend_of_every_layer_and_none(traced) -> None:
    target = _target()
    every_2 = replace(BASE, grad_ckpt_every=2)
    target.max_micro(BASE)
    assert target.correction(every_2) is None  # no search without checkpointing yet
    target.max_micro(replace(BASE, grad_ckpt=False))
    blend = target.correction(every_2)
    full, none = target.correction(BASE), target.correction(replace(BASE, grad_ckpt=False))
    assert blend is not None and full is not None and none is not None
    assert blend(20) == pytest.approx((full(20) + none(20)) / 2)
