"""The callbacks take the file `batchfit plan ... --json` wrote as well as a `Plan`: the same
expected peak, the same model check, the same calibration record; a file that is not a plan
is refused in one line naming it; a run on another GPU than the plan's leaves no calibration
record and says why."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("transformers")

import torch

from batchfit import calibration
from batchfit.hardware import get_gpu
from batchfit.integrations import hf
from batchfit.models import resolve_model
from batchfit.plan import Plan, make_plan
from batchfit.spec import TrainingSetup
from tests._tiny import TINY_GPT2, example_gpt2

CONFIG = TINY_GPT2


def _plan(tmp_path: Path, n_embd: int = 64) -> Plan:
    config = tmp_path / f"config-{n_embd}.json"
    config.write_text(json.dumps({**CONFIG, "n_embd": n_embd}))
    return make_plan(
        resolve_model(str(config)),
        get_gpu("t4"),
        TrainingSetup(),
        seq_len=32,
        global_batch=8,
        micro_batch_size=4,
        engine="analytic",
    )


def _plan_file(plan: Plan, path: Path) -> Path:
    """What `batchfit plan ... --json > plan.json` writes (the CLI adds `versions`)."""
    path.write_text(json.dumps({**plan.to_json(), "versions": {"batchfit": "0.1.0"}}))
    return path


def _record_run(callback: Any, peak: int) -> list[calibration.Record]:
    """End a CUDA run of two steps; the calibration file's records."""
    callback._cuda = True  # what on_train_begin sets on a GPU
    callback.history += [
        hf.StepMemory(1, peak + 10, 1.0, 8.0),
        hf.StepMemory(2, peak + 99, 1.0, 8.0),
    ]
    anything: Any = SimpleNamespace()
    callback.on_train_end(anything, SimpleNamespace(is_world_process_zero=True), anything)
    return calibration.load()


def test_a_plan_file_gives_the_same_peak_check_and_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = _plan(tmp_path)
    path = _plan_file(plan, tmp_path / "plan.json")
    from_plan, from_file = hf.PeakMemoryCallback(plan), hf.PeakMemoryCallback(path)
    assert from_file.expected_peak_bytes == from_plan.expected_peak_bytes == plan.peak_bytes
    assert hf.PeakMemoryCallback(str(path)).expected_peak_bytes == plan.peak_bytes

    monkeypatch.setenv("BATCHFIT_DATA_DIR", str(tmp_path / "a"))
    (by_plan,) = _record_run(from_plan, plan.peak_bytes)
    monkeypatch.setenv("BATCHFIT_DATA_DIR", str(tmp_path / "b"))
    (by_file,) = _record_run(from_file, plan.peak_bytes)
    assert by_file.estimated_bytes == by_plan.estimated_bytes == plan.peak_bytes
    assert (by_file.model, by_file.setup, by_file.device) == (
        by_plan.model,
        by_plan.setup,
        by_plan.device,
    )
    assert by_file.device == "t4" and by_file.measured_bytes == plan.peak_bytes + 99

    from_file.check_model_against_plan(example_gpt2())  # the planned model: accepted


def test_a_plan_file_for_another_model_is_refused_naming_both(tmp_path: Path) -> None:
    from transformers import Trainer, TrainingArguments

    path = _plan_file(_plan(tmp_path, n_embd=128), tmp_path / "plan.json")
    args = TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[])
    with pytest.raises(ValueError, match=r"the plan is for .*config-128\.json \(.*\) but the") as e:
        Trainer(model=example_gpt2(), args=args, callbacks=[hf.PeakMemoryCallback(path)])
    assert "\n" not in str(e.value) and "GPT2LMHeadModel" in str(e.value)


def test_a_catalog_plan_file_checks_the_model_by_its_catalog_count(tmp_path: Path) -> None:
    """`plan --json` carries no parameter count: a catalog model's comes from the catalog."""
    plan = make_plan(
        resolve_model("gpt2"), get_gpu("t4"), TrainingSetup(), seq_len=64, global_batch=8,
        engine="analytic",
    )  # fmt: skip
    callback = hf.PeakMemoryCallback(_plan_file(plan, tmp_path / "plan.json"))
    with pytest.raises(ValueError, match=r"the plan is for gpt2 \(124\.4M parameters\)"):
        callback.check_model_against_plan(example_gpt2())


def test_a_plan_file_whose_model_is_not_here_is_not_checked(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    plan = _plan(tmp_path)
    data = {**plan.to_json(), "model": str(tmp_path / "elsewhere" / "config.json")}
    del data["total_params"]  # a file from before plan --json carried its parameter count
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    callback = hf.PeakMemoryCallback(path)
    with caplog.at_level(logging.INFO, logger="batchfit.integrations.hf"):
        callback.check_model_against_plan(example_gpt2(n_embd=128))  # not refused: not checkable
    assert "the model is not checked against the plan" in caplog.text


def test_a_plan_file_carries_its_parameter_count_so_any_machine_checks_it(
    tmp_path: Path,
) -> None:
    plan = _plan(tmp_path)
    data = {**plan.to_json(), "model": str(tmp_path / "elsewhere" / "config.json")}
    assert data["total_params"] == plan.estimate.total_params
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    callback = hf.PeakMemoryCallback(path)
    with pytest.raises(ValueError, match="elsewhere"):
        callback.check_model_against_plan(example_gpt2(n_embd=128))


@pytest.mark.parametrize(
    ("content", "says"),
    [
        ("not json at all", "is not JSON"),
        ('{"peak_bytes": 5}', "is not a plan's JSON (no setup)"),
        ('{"setup": {}, "model": "gpt2", "gpu": "t4"}', "no micro_batch_size, peak_bytes"),
        (
            '{"setup": {}, "model": "gpt2", "gpu": "t4", "micro_batch_size": 1, "peak_bytes": -1}',
            "peak_bytes is -1, not a whole number",
        ),
    ],
)
def test_a_file_that_is_not_a_plan_is_refused_in_one_line(
    tmp_path: Path, content: str, says: str
) -> None:
    path = tmp_path / "plan.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=re.escape(says)) as e:
        hf.PeakMemoryCallback(path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)
    assert "batchfit plan ... --json" in str(e.value)
    with pytest.raises(ValueError, match="cannot read the plan file"):
        hf.PeakMemoryCallback(tmp_path / "missing.json")


def _run_on(
    monkeypatch: pytest.MonkeyPatch, callback: hf.PeakMemoryCallback, name: str, gib: int
) -> None:
    """``start_run`` on a CUDA device PyTorch names ``name`` (CPU here: the names are faked)."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    props = SimpleNamespace(total_memory=gib * 2**30)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    callback.start_run(torch.device("cuda"), None)


def test_a_run_on_another_gpu_than_the_plans_leaves_no_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("BATCHFIT_DATA_DIR", str(tmp_path / "data"))
    plan = _plan(tmp_path)  # for a T4
    callback = hf.PeakMemoryCallback(_plan_file(plan, tmp_path / "plan.json"))
    _run_on(monkeypatch, callback, "NVIDIA A100-SXM4-40GB", 40)
    with caplog.at_level(logging.INFO, logger="batchfit.integrations.hf"):
        assert _record_run(callback, plan.peak_bytes) == []
    (line,) = [r.getMessage() for r in caplog.records if "calibration" in r.getMessage()]
    assert line == (
        "no calibration record: the plan is for t4 but the run is on a100-40gb "
        "(a plan for this GPU would calibrate it)"
    )

    same = hf.PeakMemoryCallback(plan)
    _run_on(monkeypatch, same, "Tesla T4", 15)  # the plan's GPU: recorded
    (record,) = _record_run(same, plan.peak_bytes)
    assert record.device == "t4"


def test_lightning_takes_a_plan_file_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("lightning")
    from batchfit.integrations import lightning as bl

    monkeypatch.setenv("BATCHFIT_DATA_DIR", str(tmp_path / "data"))
    plan = _plan(tmp_path)
    path = _plan_file(plan, tmp_path / "plan.json")
    callback = bl.PeakMemoryCallback(path)
    assert callback.expected_peak_bytes == plan.peak_bytes
    callback.check_model_against_plan(example_gpt2())
    with pytest.raises(ValueError, match=r"the plan is for .*config-64\.json"):
        callback.check_model_against_plan(example_gpt2(n_embd=128))
    callback._cuda = True
    callback.history.append(bl.StepMemory(1, plan.peak_bytes + 7, 1.0, 8.0))
    callback.on_train_end(SimpleNamespace(is_global_zero=True), SimpleNamespace())
    (record,) = calibration.load()
    assert record.source == "lightning-callback" and record.device == "t4"
    assert (
        record.estimated_bytes == plan.peak_bytes and record.measured_bytes - 7 == plan.peak_bytes
    )
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(ValueError, match="is not JSON"):
        bl.PeakMemoryCallback(bad)
