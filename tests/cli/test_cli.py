"""The CLI's contract: JSON and human output of each command, one-line errors with exit 2, and
a fast path that does not import torch."""

import json
import subprocess
import sys

import pytest

from tests._cli import CONTRACT, run_cli
from tests._tiny import TINY_GPT2


@pytest.mark.parametrize("engine", ["analytic", "trace"])
def test_plan_json_contract(capsys, tmp_path, engine):
    # the formulas' question is the README's contract example (8 x 16 x 256 tokens); the
    # trace's, the tiny GPT-2 of examples/train_tiny_gpt2.py (a dry run a second) at 2 x 4 x
    # 64 tokens
    if engine == "trace":
        config = tmp_path / "config.json"
        config.write_text(json.dumps(TINY_GPT2))
        args = ["plan", str(config), "--gpu", "t4", "--seq-len", "64", "--global-batch", "8"]
        args += ["--micro-batch", "4"]
        accum, tokens = 2, 8 * 64
    else:
        args, accum, tokens = [*CONTRACT, "--engine", "analytic"], 8, 32768
    code, out, _ = run_cli([*args, "--json"], capsys)
    assert code == 0
    data = json.loads(out)
    for key in (
        "micro_batch_size",
        "grad_accum_steps",
        "num_gpus",
        "global_batch_size",
        "tokens_per_step",
        "peak_bytes",
        "device_total_bytes",
        "gpu_bytes",
        "headroom_bytes",
        "learning_rate",
        "techniques",
        "warnings",
        "exports",
        "versions",
    ):
        assert key in data, key
    assert data["engine"] == engine
    assert data["grad_accum_steps"] == accum and data["tokens_per_step"] == tokens
    assert data["headroom_bytes"] == data["gpu_bytes"] - data["device_total_bytes"]
    assert set(data["versions"]) == {"batchfit", "torch", "transformers"}


@pytest.mark.parametrize("engine", ["analytic", "trace"])
def test_estimate_json_contract(capsys, engine):
    code, out, _ = run_cli(
        [
            "estimate",
            "llama-3.1-8b",
            "--micro-batch",
            "1",
            "--seq-len",
            "4096",
            "--precision",
            "bf16",
            "--gpu",
            "h100-80gb",
            "--json",
            "--engine",
            engine,
        ],
        capsys,
    )
    assert code == 0
    data = json.loads(out)
    assert set(data["components"]) == {
        "weights",
        "gradients",
        "optimizer_state",
        "activations",
        "other",
    }
    for key in (
        "peak_bytes",
        "reserved_bytes",
        "device_total_bytes",
        "total_params",
        "trainable_params",
        "engine",
        "device",
    ):
        assert key in data
    assert data["engine"] == engine and data["device"] == "cuda:h100-80gb"
    assert data["setup"]["task"] == "causal-lm"
    # the trace also counts buffers (rotary inv_freq: 512 B) as weights
    assert data["components"]["weights"] == pytest.approx(2 * data["total_params"], rel=1e-6)


def test_human_output_shows_formulas(capsys):
    args = ["estimate", "gpt2", "-b", "4", "-s", "512", "--device", "cpu", "--engine", "analytic"]
    code, out, _ = run_cli(args, capsys)
    assert code == 0
    assert "124,439,808 params x 4 B" in out and "peak allocated" in out
    code, out, _ = run_cli([*args[:-1], "trace", "--explain"], capsys)
    assert code == 0 and "trace engine" in out and "(top level: loss and outputs)" in out


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["estimate", "llama-3.1-8", "-b", "1", "-s", "128"], "did you mean"),
        (["plan", "gpt2", "--gpu", "a100", "-s", "128", "--global-batch", "8"], "unknown GPU"),
        (["estimate", "gpt2", "-b", "0", "-s", "128"], "--micro-batch must be a positive"),
        (["estimate", "gpt2", "-b", "abc", "-s", "128"], "valid integer"),
        (["estimate", "gpt2", "-b", "1", "-s", "2048"], "1024 learned positions"),
        (["estimate", "bert-base-uncased", "-b", "1", "-s", "1024"], "512 learned positions"),
        (
            [
                "estimate",
                "gpt2",
                "-b",
                "1",
                "-s",
                "128",
                "--method",
                "qlora",
                "--precision",
                "fp32",
            ],
            "16-bit",
        ),
        (
            ["estimate", "gpt2", "-b", "1", "-s", "128", "--gpu", "t4", "--device", "cpu"],
            "contradict",
        ),
        (
            [
                "plan",
                "gpt2",
                "--gpu",
                "t4",
                "-s",
                "128",
                "--global-batch",
                "8",
                "--headroom",
                "lots",
            ],
            "not a size",
        ),
        (["plan", "gpt2", "--gpu", "t4", "-s", "128"], "exactly one of"),
        (
            ["plan", "gpt2", "--gpu", "t4", "-s", "128", "--global-batch", "8", "--export", "yaml"],
            "--export",
        ),
        (["estimate", "gpt2", "-b", "1", "-s", "128", "--optimizer", "adamz"], "--optimizer"),
        (["estimate", "gpt2", "-b", "1", "-s", "128", "--bogus"], "No such option"),
        (["gpus", "gpt2"], "--seq-len"),
    ],
)
def test_bad_input_exits_2_with_one_line(capsys, args, needle):
    code, out, err = run_cli(args, capsys)
    assert code == 2
    assert needle in err
    assert len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err and out == ""


def test_malformed_config_exits_2(tmp_path, capsys):
    bad = tmp_path / "config.json"
    bad.write_text("{oops")
    code, _, err = run_cli(["estimate", str(bad), "-b", "1", "-s", "64"], capsys)
    assert code == 2 and "not valid JSON" in err


def test_rotary_overlong_sequence_is_a_warning(capsys):
    code, _, err = run_cli(["estimate", "llama-2-7b", "-b", "1", "-s", "8192"], capsys)
    assert code == 0 and "rope scaling" in err


def test_models_and_gpus_list(capsys):
    code, out, _ = run_cli(["models", "--json"], capsys)
    assert code == 0 and len(json.loads(out)["models"]) >= 30
    code, out, _ = run_cli(["gpus", "--json"], capsys)
    assert code == 0 and len(json.loads(out)["gpus"]) >= 20
    gpus = ["gpus", "bert-base-uncased", "--seq-len", "512", "--engine", "analytic", "--json"]
    code, out, _ = run_cli(gpus, capsys)
    rows = json.loads(out)["gpus"]
    assert code == 0 and all("max_micro_batch" in r for r in rows)


def test_export_to_file(tmp_path, capsys):
    target = tmp_path / "args.json"
    args = [*CONTRACT, "--export", "hf", "--out", str(target), "--engine", "analytic", "--json"]
    code, out, _ = run_cli(args, capsys)
    assert code == 0
    exports = json.loads(out)["exports"]
    assert exports["hf"] == str(target) and set(exports) == {"hf", "launch"}
    args = json.loads(target.read_text())["training_arguments"]
    assert args["per_device_train_batch_size"] == 16
    assert args["gradient_accumulation_steps"] == 8


@pytest.mark.slow
def test_fast_path_does_not_import_torch():
    # the analytic engine on a catalog model must not import torch (a warm trace
    # cache neither: tests/test_cache.py).
    code = (
        "import sys\n"
        "from batchfit.cli import main\n"
        "try:\n"
        f"    main({[*CONTRACT, '--engine', 'analytic', '--json']!r})\n"
        "except SystemExit:\n"
        "    pass\n"
        "bad = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
        "sys.stderr.write(repr(bad))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stderr.strip() == "[]"


@pytest.mark.slow
def test_python_dash_m_entry_point():
    result = subprocess.run(
        [sys.executable, "-m", "batchfit", "--version"], capture_output=True, text=True
    )
    assert result.returncode == 0 and result.stdout.startswith("batchfit 0.1.0")


@pytest.mark.slow
def test_headroom_zero_is_allowed_and_more_than_the_card_is_one_line(capsys):
    base = ["plan", "gpt2", "--gpu", "t4", "--seq-len", "256", "--global-batch", "8"]
    code, out, err = run_cli([*base, "--engine", "analytic", "--headroom", "0", "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["headroom_bytes"] > 0
    code, out, err = run_cli([*base, "--engine", "analytic", "--headroom", "20GiB"], capsys)
    assert code == 2 and not out
    assert "--headroom 20GiB is all of t4's" in err and len(err.strip().splitlines()) == 1


def test_gpus_refuses_a_headroom_no_gpu_has(capsys):
    code, out, err = run_cli(["gpus", "gpt2", "-s", "512", "--headroom", "500GiB"], capsys)
    assert code == 2 and not out
    assert err.startswith("batchfit: error: --headroom 500GiB is all of the largest GPU's")
    assert len(err.strip().splitlines()) == 1


def test_models_table_shows_no_vocabulary_for_image_models(capsys):
    code, out, _ = run_cli(["models"], capsys)
    assert code == 0
    row = next(line for line in out.splitlines() if "convnext-tiny-224" in line)
    assert " 0 " not in row and "1/1" not in row


def test_errors_name_what_the_user_gave(tmp_path, capsys):
    code, _, err = run_cli(
        ["estimate", "resnet-50", "--gpu", "t4", "-b", "8", "--method", "lora"], capsys
    )
    assert code == 2 and "default targets" in err and "--lora-targets q_proj" not in err
    lengths = tmp_path / "l.txt"
    lengths.write_text("10\n20\n2000\n")
    code, _, err = run_cli(["estimate", "gpt2", "-b", "2", "--lengths", str(lengths)], capsys)
    assert code == 2 and "line 3" in err
    hist = tmp_path / "h.json"
    hist.write_text(json.dumps({"100": 2.5}))
    code, _, err = run_cli(["estimate", "gpt2", "-b", "2", "--lengths", str(hist)], capsys)
    assert code == 2 and "sample count" in err


def test_one_optimizer_step_is_singular(capsys):
    args = ["plan", "gpt2", "--gpu", "rtx-3060", "--seq-len", "256"]
    args += ["--global-batch-tokens", "32768", "--train-tokens", "32768", "--engine", "analytic"]
    code, out, _ = run_cli(args, capsys)
    assert code == 0
    assert "1 optimizer step," in out and "1 optimizer steps" not in out


def test_a_plan_for_another_task_names_it_and_its_estimate_line_asks_for_it(capsys):
    """RoBERTa's config is a masked LM: a plan for classification says so on its first line, and
    the `estimate` line that gives its figures carries `--task` (without it, estimate answers
    for the masked LM's head, 95 GiB where the plan says 14)."""
    args = ["--gpu", "t4", "--global-batch", "256", "--seq-len", "512", "--engine", "analytic"]
    code, out, err = run_cli(["plan", "roberta-base", "--task", "classification", *args], capsys)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("roberta-base (classification) on 1 x t4")
    assert "`batchfit estimate ... --task classification -b " in out.replace("\n", " ")
    code, out, err = run_cli(["plan", "roberta-base", *args], capsys)
    assert code == 0 and out.splitlines()[0].startswith("roberta-base on 1 x t4"), err
