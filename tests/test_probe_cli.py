import json

import pytest
import torch

from tests._cli import run_cli

TINY = {
    "model_type": "gpt2",
    "n_layer": 2,
    "n_embd": 64,
    "n_head": 4,
    "vocab_size": 512,
    "n_positions": 256,
    "architectures": ["GPT2LMHeadModel"],
}


@pytest.mark.slow
def test_probe_runs_real_steps_under_a_budget(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY))
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
            "64",
            "--global-batch",
            "96",
            "--json",
        ],
        capsys,
    )
    assert code == 0
    data = json.loads(out)
    ok = {t["micro_batch_size"] for t in data["trials"] if t["ok"]}
    assert data["micro_batch_size"] in ok and data["max_fitting_micro_batch"] in ok
    assert data["plan"]["micro_batch_size"] * data["plan"]["grad_accum_steps"] == 96
    assert {"versions", "seconds", "trials"} <= set(data)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--memory-budget", "10MiB"], "below the"),
        (["--device", "cuda", "--memory-budget", "1GiB"], "no CUDA device"),
        ([], "--memory-budget"),
        (["--memory-budget", "1GiB", "--choose", "fastest"], "--choose"),
        (["--memory-budget", "lots"], "not a size"),
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
