"""An image model of one stack of like layers (ViT, DeiT, DINOv2) is traced at 2 and 3 layers
and extrapolated, as a decoder is: every moment and the allocator's reserve equal the whole
model's dry run. Staged models and stochastic depth (BEiT) are traced whole."""

from __future__ import annotations

from dataclasses import replace

import pytest

from batchfit.hardware import get_gpu
from batchfit.memory.formulas.analytic import resolve_setup
from batchfit.memory.trace import estimate as trace_estimate
from batchfit.memory.trace.stacks import cuttable_vision
from batchfit.models import resolve_model
from batchfit.spec import TrainingSetup
from batchfit.workload import Workload
from tests._tiny import TINY_VIT

# two layers past the traced 2 and 3
DEEP_VIT = {**TINY_VIT, "num_hidden_layers": 5}
# deep enough for a period of two layers traced at 4 and 6
DEEPER_VIT = {**TINY_VIT, "num_hidden_layers": 6}


def _model(tmp_path, config):
    import json

    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return resolve_model(str(path))


@pytest.mark.parametrize(
    "setup",
    [
        TrainingSetup(),
        TrainingSetup(grad_ckpt=True),
        TrainingSetup(method="lora"),
        TrainingSetup(method="lora", grad_ckpt=True, optimizer="adamw-8bit"),
    ],
    ids=["full", "ckpt", "lora", "lora-ckpt-8bit"],
)
def test_a_vit_extrapolated_from_2_and_3_layers_equals_its_whole_dry_run(
    tmp_path, monkeypatch, setup
):
    monkeypatch.setenv("BATCHFIT_NO_CACHE", "1")
    model, gpu = _model(tmp_path, DEEP_VIT), get_gpu("t4")
    resolved = resolve_setup(model, setup, "cuda", gpu)
    assert trace_estimate.trace_depths(model, resolved) == (2, 3)
    work = Workload(micro_batch_size=8, seq_len=64, device="cuda", gpu=gpu, grad_accum_steps=2)
    cut, notes = trace_estimate.traced_result(model, resolved, work, full_depth=False)
    whole, _ = trace_estimate.traced_result(model, resolved, work, full_depth=True)
    assert "traced 2 and 3 layers, extrapolated to 5" in notes
    # every moment of the cut exists whole (whole, a middle layer's are moments of their own)
    at_full = {p.key: p.components for p in whole.phases}
    assert {p.key: p.components for p in cut.phases}.items() <= at_full.items()
    assert (cut.peak.key, cut.peak.total) == (whole.peak.key, whole.peak.total)
    assert cut.reserved_bytes == whole.reserved_bytes > cut.peak.total


def test_the_line_through_1_and_2_layers_would_overcount_lora(tmp_path, monkeypatch):
    """Why 2 and 3: a 1-layer ViT's only layer is both its first and its last, and under
    LoRA its forward ends holding less than a middle layer adds."""
    monkeypatch.setenv("BATCHFIT_NO_CACHE", "1")
    model, gpu = _model(tmp_path, DEEP_VIT), get_gpu("t4")
    resolved = resolve_setup(model, TrainingSetup(method="lora"), "cuda", gpu)
    sizes = trace_estimate._Sizes(8, 64, "cuda", 1 << 20, 2)
    ones, twos = (
        trace_estimate._combine(
            model, resolved, sizes, depths, trace_estimate._dry_runs(model, resolved, sizes, depths)
        )
        for depths in ((1, 2), (2, 3))
    )
    assert ones is not None and twos is not None
    assert ones.peak.total > twos.peak.total


@pytest.mark.parametrize(
    ("changes", "whole"),
    [
        ({}, False),
        ({"drop_path_rate": 0.1}, True),  # BEiT's stochastic depth: layers differ
        ({"drop_path_rate": 0.0}, False),
        ({"model_type": "deit"}, False),
        ({"model_type": "efficientnet"}, True),  # num_hidden_layers its blocks never read
        ({"model_type": "convnext", "depths": [2, 2]}, True),  # stages
    ],
)
def test_which_image_models_are_cut(tmp_path, changes, whole):
    model = _model(tmp_path, DEEP_VIT)
    model = replace(model, config={**model.config, **changes})
    assert cuttable_vision(model) is not whole


def test_on_the_cpu_the_cut_equals_the_whole_dry_run(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHFIT_NO_CACHE", "1")
    model = _model(tmp_path, DEEP_VIT)
    setup = resolve_setup(model, TrainingSetup(method="lora"), "cpu", None)
    work = Workload(micro_batch_size=8, seq_len=64, device="cpu", grad_accum_steps=2)
    cut, notes = trace_estimate.traced_result(model, setup, work, full_depth=False)
    whole, _ = trace_estimate.traced_result(model, setup, work, full_depth=True)
    assert "traced 2 and 3 layers, extrapolated to 5" in notes
    assert (cut.peak.key, cut.peak.total) == (whole.peak.key, whole.peak.total)


def test_a_setup_whose_history_does_not_unroll_is_traced_whole(tmp_path, monkeypatch):
    """Every 2nd layer checkpointed: a period of two layers (traced at 4 and 6), which the
    reserve's unroll does not take."""
    monkeypatch.setenv("BATCHFIT_NO_CACHE", "1")
    model, gpu = _model(tmp_path, DEEPER_VIT), get_gpu("t4")
    setup = resolve_setup(model, TrainingSetup(grad_ckpt_every=2), "cuda", gpu)
    work = Workload(micro_batch_size=4, seq_len=64, device="cuda", gpu=gpu, grad_accum_steps=2)
    _, notes = trace_estimate.traced_result(model, setup, work, full_depth=False)
    assert not any("extrapolated" in note for note in notes)
