"""Time learned from the user's runs: a timed calibration record scales the step time that
`plan` and `estimate` print, says so, and can be turned off."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from batchfit import calibration
from batchfit.hardware import get_gpu
from batchfit.models import resolve_model
from batchfit.plan import make_plan
from batchfit.spec import TrainingSetup
from tests._cli import run_cli

PLAN = ["plan", "gpt2", "--gpu", "a100-80gb", "-s", "256", "--global-batch", "32"]
ESTIMATE = ["estimate", "gpt2", "--gpu", "a100-80gb", "-s", "256", "-b", "8"]
FAST = ["--engine", "analytic"]


def _record(model: str, gpu: str, estimated: float, measured: float) -> None:
    calibration.append(
        calibration.Record(
            "hf-callback",
            model,
            "s",
            gpu,
            1,
            1,
            estimated_seconds=estimated,
            measured_seconds=measured,
        )
    )


def test_records_from_runs_scale_the_plans_time(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("BATCHFIT_DATA_DIR", str(tmp_path))
    code, out, err = run_cli([*PLAN, *FAST, "--json"], capsys)
    model = json.loads(out)
    assert model["learned_time"] is None
    assert model["model_step_seconds"] == model["step_seconds"]
    # runs of gpt2 on this GPU measured 1.25x and 1.35x their plans; a bert run, another
    # model, and a T4 run, another GPU, are not counted
    _record("gpt2", "a100-80gb", 2.0, 2.5)
    _record("gpt2", "a100-80gb", 2.0, 2.7)
    _record("bert-base-uncased", "a100-80gb", 1.0, 9.0)
    _record("gpt2", "t4", 1.0, 0.1)
    code, out, err = run_cli([*PLAN, *FAST, "--json"], capsys)
    learned = json.loads(out)
    assert learned["learned_time"] == {"factor": 1.3, "runs": 2, "model": "gpt2", "others": []}
    assert learned["model_step_seconds"] == pytest.approx(model["step_seconds"])
    assert learned["step_seconds"] == pytest.approx(1.3 * model["step_seconds"])
    assert learned["tokens_per_s_per_gpu"] == pytest.approx(model["tokens_per_s_per_gpu"] / 1.3)
    # the same plan otherwise, and every option is scaled alike
    assert learned["micro_batch_size"] == model["micro_batch_size"]
    for a, b in zip(learned["alternatives"], model["alternatives"], strict=True):
        if b["step_seconds"]:
            assert a["step_seconds"] == pytest.approx(1.3 * b["step_seconds"])
    code, out, err = run_cli([*PLAN, *FAST], capsys)
    assert "model x 1.30, from 2 runs of gpt2 on this GPU" in " ".join(out.split())
    code, out, err = run_cli([*PLAN, *FAST, "--json", "--no-learned-time"], capsys)
    assert json.loads(out)["step_seconds"] == pytest.approx(model["step_seconds"])
    # estimate reads the same records
    code, out, err = run_cli([*ESTIMATE, *FAST, "--json"], capsys)
    scaled = json.loads(out)
    code, out, err = run_cli([*ESTIMATE, *FAST, "--json", "--no-learned-time"], capsys)
    alone = json.loads(out)
    assert scaled["step_seconds"] == pytest.approx(1.3 * alone["step_seconds"])
    assert scaled["model_step_seconds"] == pytest.approx(alone["step_seconds"])
    assert scaled["learned_time"]["factor"] == 1.3 and alone["learned_time"] is None
    # bert's own run (9x the model: beyond 4x, another setup than planned) does not count;
    # a model no run trained takes the runs of others once there are three
    code, out, err = run_cli([*ESTIMATE[:1], "bert-base-uncased", *ESTIMATE[2:], *FAST], capsys)
    assert "model x" not in out
    code, out, err = run_cli([*ESTIMATE[:1], "gpt2-medium", *ESTIMATE[2:], *FAST], capsys)
    assert "model x" not in out  # two runs of another model: not enough
    _record("bert-base-uncased", "a100-80gb", 1.0, 1.5)
    code, out, err = run_cli([*ESTIMATE[:1], "gpt2-medium", *ESTIMATE[2:], *FAST], capsys)
    assert code == 0, err
    said = " ".join(out.split())
    assert "model x 1.35, from 3 runs of other models on this GPU (bert-base-uncased, gpt2)" in said


def test_a_plan_records_the_models_own_time(tmp_path: Path, monkeypatch) -> None:
    # a plan already scaled by runs hands the callbacks the model's time, so a new run's
    # record compares with the model, not with the last correction
    monkeypatch.setenv("BATCHFIT_DATA_DIR", str(tmp_path))
    _record("gpt2", "t4", 1.0, 2.0)
    args = dict(seq_len=256, global_batch=16, engine="analytic")
    plain = make_plan(resolve_model("gpt2"), get_gpu("t4"), TrainingSetup(), **args)
    learned = make_plan(
        resolve_model("gpt2"), get_gpu("t4"), TrainingSetup(), learned_time=True, **args
    )
    assert plain.learned_time is None  # the library asks for it explicitly
    assert learned.step_seconds == pytest.approx(2 * (plain.step_seconds or 0))
    assert learned.model_step_seconds == pytest.approx(plain.step_seconds)
    from batchfit.integrations._plan_file import plan_figures

    assert plan_figures(learned).step_seconds == pytest.approx(plain.step_seconds)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(learned.to_json()))
    assert plan_figures(str(path)).step_seconds == pytest.approx(plain.step_seconds)


def test_a_bad_record_is_set_aside_and_a_newer_one_kept(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("BATCHFIT_DATA_DIR", str(tmp_path))
    _record("gpt2", "t4", 1.0, 2.0)
    good = {"source": "x", "model": "m", "setup": "s", "device": "t4"}
    sizes = {"estimated_bytes": 1, "measured_bytes": 1}
    bad = [
        {**good, **sizes, "measured_seconds": -1.0},
        {**good, **sizes, "estimated_seconds": 1e-300, "measured_seconds": 1e300},
        {**good, **sizes, "device": None},
        {**good, **sizes, "torch": None},
        {**good, **sizes, "device": ["t4"]},
    ]
    with open(calibration.path(), "a") as f:
        for record in bad:
            f.write(json.dumps(record) + "\n")
        # a field a newer batchfit writes is left out, the record kept
        f.write(json.dumps({**good, **sizes, "gpu_count": 1}) + "\n")
    warnings: list[str] = []
    records = calibration.load(warn=warnings.append)
    assert len(records) == 2 and len(warnings) == 1 and "5 lines" in warnings[0]


def test_under_json_a_set_aside_line_is_in_the_warnings(tmp_path: Path, monkeypatch, capsys):
    monkeypatch.setenv("BATCHFIT_DATA_DIR", str(tmp_path))
    for command in (ESTIMATE, PLAN):
        _record("gpt2", "a100-80gb", 1.0, 1.1)
        with open(calibration.path(), "a") as f:
            f.write('{"source": "cut off\n')
        code, out, err = run_cli([*command, *FAST, "--json"], capsys)
        assert code == 0 and "batchfit: warning" not in err
        (said,) = [w for w in json.loads(out)["warnings"] if "calibration file" in w]
        assert "could not be read" in said
