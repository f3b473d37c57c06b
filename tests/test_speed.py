"""The step-time model (``batchfit.speed``, issue #13's first part) against the H100 sweeps it
was calibrated on, and its contract in estimate/plan JSON."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from batchfit.hardware import get_gpu
from batchfit.models import resolve_model
from batchfit.spec import TrainingSetup
from batchfit.speed import step_time
from tests._cli import run_cli

MEASURED = Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "gpu_validate_h100.json"
H100 = get_gpu("h100-80gb")


def _sweep_points() -> list[tuple[str, int, str, int, bool, float]]:
    raw = json.loads(MEASURED.read_text())
    points = []
    for key, res in raw["results"].items():
        if key.startswith("sweep"):
            for p in res["points"]:
                median = statistics.median(p["step_seconds"])
                points.append(
                    (res["model"], res["seq"], res["precision"], p["micro"], p["grad_ckpt"], median)
                )
    return points


@pytest.mark.parametrize(
    ("model", "seq", "precision", "micro", "ckpt", "measured"), _sweep_points()
)
def test_calibration_sweeps_within_20_percent(model, seq, precision, micro, ckpt, measured):
    setup = TrainingSetup(precision=precision, grad_ckpt=ckpt).resolved(
        device="cuda", bf16_supported=True
    )
    predicted = step_time(resolve_model(model), setup, H100, micro_batch_size=micro, seq_len=seq)
    assert predicted is not None
    assert predicted.step_seconds() == pytest.approx(measured, rel=0.2)


def test_the_model_moves_the_right_way():
    info = resolve_model("llama-3.2-1b")

    def seconds(**fields: object) -> float:
        setup = TrainingSetup(precision="amp-bf16", **fields)  # type: ignore[arg-type]
        t = step_time(info, setup, H100, micro_batch_size=4, seq_len=2048)
        assert t is not None
        return t.step_seconds()

    assert seconds(grad_ckpt=True) > seconds()  # recompute
    assert seconds(method="lora") < seconds()  # no weight gradients, tiny optimizer step
    t = step_time(info, TrainingSetup(precision="amp-bf16"), H100, micro_batch_size=4, seq_len=2048)
    assert t is not None and t.step_seconds(8) == pytest.approx(
        8 * t.micro_seconds + t.optimizer_seconds
    )
    slow = step_time(
        info, TrainingSetup(precision="amp-bf16"), get_gpu("a10"), micro_batch_size=4, seq_len=2048
    )
    assert slow is not None and slow.step_seconds() > t.step_seconds()


def test_no_prediction_where_the_model_does_not_apply():
    vit = resolve_model("vit-base-patch16-224")
    assert (
        step_time(vit, TrainingSetup(precision="amp-bf16"), H100, micro_batch_size=8, seq_len=224)
        is None
    )
    gpt2 = resolve_model("gpt2")
    ddp = TrainingSetup(precision="amp-bf16", num_gpus=2, sharding="ddp")
    assert step_time(gpt2, ddp, H100, micro_batch_size=8, seq_len=512) is None


def _json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, object]:
    code, out, err = run_cli([*args, "--engine", "analytic", "--json"], capsys)
    assert code == 0, err
    data: dict[str, object] = json.loads(out)
    return data


def test_estimate_and_plan_json_carry_the_time(capsys):
    workload = ("gpt2", "-s", "512")
    est = _json(capsys, "estimate", *workload, "-b", "8", "--gpu", "a100-40gb")
    assert est["step_seconds"] > 0 and est["tokens_per_s_per_gpu"] > 0 and 0 < est["mfu"] < 1
    plan = _json(capsys, "plan", *workload, "--gpu", "a100-40gb", "--global-batch", "64")
    assert plan["step_seconds"] > est["step_seconds"]  # accumulation: several micro-steps
    cpu = _json(capsys, "estimate", *workload, "-b", "8", "--device", "cpu")
    assert cpu["step_seconds"] is None  # no GPU, no prediction
