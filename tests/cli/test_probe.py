"""``batchfit probe``: real steps under a budget, its table and plot, and the plan it reports."""

import json

import pytest
import torch

from tests._cli import run_cli
from tests._tiny import PROBE_GPT2


@pytest.mark.slow
def test_probe_runs_real_steps_under_a_budget(tmp_path, capsys):
    # sizes up to 16 (the steps of 64 take seconds); the plan's 96 is 6 x 16 or a smaller split
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(PROBE_GPT2))
    code, out, _ = run_cli(
        [
            "probe",
            str(cfg),
            "--seq-len",
            "64",
            "--device",
            "cpu",
            "--memory-budget",
            "600MiB",
            "--max-micro-batch",
            "16",
            "--global-batch",
            "96",
            "--dataset-size",
            "1000",
            "--json",
        ],
        capsys,
    )
    assert code == 0
    data = json.loads(out)
    ok = {t["micro_batch_size"] for t in data["trials"] if t["ok"]}
    assert data["micro_batch_size"] in ok and data["max_fitting_micro_batch"] in ok
    assert data["plan"]["micro_batch_size"] * data["plan"]["grad_accum_steps"] == 96
    assert data["plan"]["micro_batch_size"] in ok  # a size that ran
    assert {"versions", "seconds", "trials"} <= set(data) and data["dataset_size"] == 1000
    timed = [t for t in data["trials"] if t["samples_per_s"]]
    assert timed and all(t["epoch_seconds"] == 1000 / t["samples_per_s"] for t in timed)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--memory-budget", "10MiB"], "below the"),
        (["--device", "cuda", "--memory-budget", "1GiB"], "no CUDA device"),
        ([], "--memory-budget"),
        (["--memory-budget", "1GiB", "--choose", "fastest"], "--choose"),
        (["--memory-budget", "lots"], "not a size"),
        (["--memory-budget", "1GiB", "--plot", "/nonexistent/dir/p.png"], "does not exist"),
    ],
)
def test_probe_bad_input_exits_2(capsys, args, needle):
    if "cuda" in args and torch.cuda.is_available():
        pytest.skip("a GPU is present")
    base = ["probe", "gpt2", "--seq-len", "64"]
    if "--device" not in args:
        base += ["--device", "cpu"]
    code, out, err = run_cli([*base, *args], capsys)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1 and out == ""


def _trial(n, ok, peak, speed, steps):
    from batchfit.search import Trial

    return Trial(n, ok, peak, speed, 1.0, steps, None if ok else "out of memory")


def _result():
    from batchfit.search import SearchResult

    trials = (
        _trial(8, True, 3 << 30, 2.0, 2),
        _trial(10, True, 4 << 30, None, 1),
        _trial(11, False, None, None, 0),
        _trial(10, True, 4 << 30, 2.5, 3),
    )
    return SearchResult(10, 10, trials, 30.0, "max")


def test_probe_table_and_plot_mark_measured_sizes(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from batchfit.cli.render import probe as render
    from batchfit.models import resolve_model
    from batchfit.search import probe as _probe

    result = _result()
    plot = tmp_path / "probe.png"
    render.probe_plot(result, plot, 5 << 30)
    report = _probe.report(result, global_batch=None, dataset_size=1000)
    render.probe_table(resolve_model("gpt2"), report, 256, 5 << 30, plot)
    out = capsys.readouterr().out
    assert "measured " in out and "OOM" in out
    assert "measured: one step for its peak memory only" in out
    assert "640" in out  # 2.5 samples/s x 256 tokens
    assert plot.stat().st_size > 1000


def test_report_plans_accumulation_from_sizes_that_ran():
    from batchfit.search import probe as _probe

    result = _result()  # ran: 8 and 10 (chosen); 11 did not fit
    plan = _probe.report(result, global_batch=40, dataset_size=None).plan
    assert (plan.micro_batch_size, plan.grad_accum_steps, plan.global_batch_size) == (10, 4, 40)
    plan = _probe.report(result, global_batch=16, dataset_size=None).plan
    assert (plan.micro_batch_size, plan.grad_accum_steps) == (8, 2)
    report = _probe.report(result, global_batch=7, dataset_size=1000)
    assert report.plan is None and "no size that ran divides --global-batch 7" in report.notes[0]
    data = report.to_json()
    assert [t["epoch_seconds"] for t in data["trials"]] == [500.0, None, None, 400.0]
    assert data["notes"] == list(report.notes) and "plan" not in data
    assert json.loads(json.dumps(data)) == data


def test_check_budget_refuses_less_than_one_step():
    from batchfit.errors import UsageError
    from batchfit.models import resolve_model
    from batchfit.search import probe as _probe
    from batchfit.spec import TrainingSetup

    info, setup = resolve_model("gpt2"), TrainingSetup()
    _probe.check_budget(info, setup, 64, "cpu", None)
    _probe.check_budget(info, setup, 64, "cpu", 64 << 30)
    with pytest.raises(UsageError, match="memory_budget 10 MiB is below the"):
        _probe.check_budget(info, setup, 64, "cpu", 10 << 20)


def test_search_result_round_trips_through_json():
    from batchfit.search import SearchResult

    result = _result()
    assert SearchResult.from_json(json.loads(json.dumps(result.to_json()))) == result


def test_a_misspelt_model_is_named_before_a_missing_budget(capsys):
    code, _, err = run_cli(["probe", "gpt3", "--device", "cpu", "--seq-len", "32"], capsys)
    assert code == 2
    assert "unknown model 'gpt3'" in err and "--memory-budget" not in err
