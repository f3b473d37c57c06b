"""Checkpointing as a dial (--grad-ckpt-every K) in both engines and the time model, and
--compile as a time-only option."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from batchfit.errors import UsageError
from batchfit.hardware import get_gpu
from batchfit.memory.formulas.analytic import estimate_analytic
from batchfit.memory.trace.estimate import estimate_trace, trace_depths
from batchfit.models import resolve_model
from batchfit.spec import TrainingSetup
from batchfit.speed import step_time
from batchfit.workload import Workload
from tests._cli import run_cli

LLAMA = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 4000,
}


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("llama") / "config.json"
    path.write_text(json.dumps(LLAMA))
    return str(path)


def test_the_setup_counts_layers_as_torchtitan_does() -> None:
    assert TrainingSetup(grad_ckpt_every=4).grad_ckpt  # implies checkpointing
    assert TrainingSetup(grad_ckpt_every=1).grad_ckpt_every is None  # every layer
    assert TrainingSetup(grad_ckpt_every=3).checkpointed_layers(8) == 2  # layers 2 and 5
    assert TrainingSetup(grad_ckpt=True).checkpointed_layers(8) == 8
    assert TrainingSetup().checkpointed_layers(8) == 0
    with pytest.raises(UsageError, match="positive integer"):
        TrainingSetup(grad_ckpt_every=0)


def test_the_dry_run_checkpoints_the_chosen_layers(llama: str) -> None:
    import torch

    from batchfit.memory.trace.hf import _build

    with torch.device("meta"):
        net = _build(resolve_model(llama), TrainingSetup(grad_ckpt_every=3), None)
    flags = [layer.gradient_checkpointing for layer in net.model.layers]
    assert flags == [False, False, True, False, False, True, False, False]


def test_both_engines_put_the_dial_between_none_and_all(llama: str) -> None:
    model = resolve_model(llama)
    work = Workload(micro_batch_size=4, seq_len=256, device="cpu")

    def both(**setup: object) -> tuple[int, int]:
        s = TrainingSetup(**setup)  # type: ignore[arg-type]
        return (
            estimate_trace(model, s, work).components["activations"],
            estimate_analytic(model, s, work).components["activations"],
        )

    none, every2, every4, full = (
        both(),
        both(grad_ckpt_every=2),
        both(grad_ckpt_every=4),
        both(grad_ckpt=True),
    )
    for engine in (0, 1):
        assert full[engine] < every2[engine] < every4[engine] < none[engine]
    # the formulas follow the dry run within 15% at each setting
    for pair in (every2, every4):
        assert pair[1] == pytest.approx(pair[0], rel=0.15)


def test_the_trace_extrapolates_over_whole_periods(llama: str) -> None:
    model = resolve_model(llama)
    setup = TrainingSetup(grad_ckpt_every=2)
    assert trace_depths(model, setup) == (2, 4)
    work = Workload(micro_batch_size=2, seq_len=128, device="cpu")
    short = estimate_trace(model, setup, work)
    whole = estimate_trace(model, setup, work, full_depth=True)
    assert short.peak_bytes == pytest.approx(whole.peak_bytes, rel=0.005)


def test_time_pays_for_the_layers_recomputed_and_compile_saves() -> None:
    model, h100 = resolve_model("llama-3.1-8b"), get_gpu("h100-80gb")

    def seconds(**setup: object) -> float:
        t = step_time(
            model,
            TrainingSetup(precision="amp-bf16", **setup),
            h100,  # type: ignore[arg-type]
            micro_batch_size=2,
            seq_len=4096,
        )
        assert t is not None
        return t.step_seconds()

    plain, half, full = seconds(), seconds(grad_ckpt_every=2), seconds(grad_ckpt=True)
    assert plain < half < full
    assert (half - plain) == pytest.approx((full - plain) / 2, rel=0.05)
    assert seconds(compile=True) < plain / 1.1


def test_cli_rejects_a_bad_dial(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = run_cli(
        [
            "estimate",
            "gpt2",
            "-b",
            "1",
            "-s",
            "64",
            "--grad-ckpt-every",
            "0",
            "--engine",
            "analytic",
        ],
        capsys,
    )
    assert code == 2 and "--grad-ckpt-every" in err
    code, _, err = run_cli(
        [
            "estimate",
            "gpt2",
            "-b",
            "1",
            "-s",
            "64",
            "--grad-ckpt-every",
            "40",
            "--engine",
            "analytic",
        ],
        capsys,
    )
    assert code == 0 and "checkpoints no layer" in err
