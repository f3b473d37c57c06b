"""Property: whatever the arguments, the CLI exits 0 or 2; on 2, one line on stderr starting
``batchfit: error:``; never a traceback; with --json, strict JSON on stdout.

Arguments are generated from valid options, bad numbers (nan, inf, 1e400, -1, 0, huge),
markup-like and very long strings and unknown names, and run in-process on the analytic
engine (no probe trials: the probe gets no budget, so it stops at its checks).
"""

import json
import math
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests._cli import run_cli
from tests._tiny import PROBE_GPT2

NUMBERS = [
    "1",
    "8",
    "64",
    "0",
    "-1",
    "nan",
    "inf",
    "-inf",
    "1e400",
    "1e40",
    "1e308",
    "2.5",
    "99999999999999999999",
    "abc",
    "",
]
TEXT = [
    "[/]",
    "[bold red]x",
    "a" * 5000,
    "x" * 300 + "/config.json",
    "gpt2",
    "7B",
    "1e30B",
    "bogus",
    "--",
    "-",
    "~nosuchuser/x",
    "\x00",
    "é[/]",
]
MODELS = ["gpt2", "bert-base-uncased", "llama-3.1-8b", "7B", "350M", "0B", *TEXT]
SIZES = ["0.5GiB", "1GiB", "16GB", "lots", "0", "-1GiB", "1e400", "1e40", "nanGiB", "infGiB"]

_value = st.sampled_from(NUMBERS + TEXT)


def _either(valid: list[str], bad: list[str]) -> st.SearchStrategy[str]:
    """A valid value three times in four, so that a bad one is often the only one."""
    good, worse = st.sampled_from(valid), st.sampled_from(bad)
    return st.integers(0, 3).flatmap(lambda k: worse if k == 0 else good)


MODEL = _either(MODELS[:5], MODELS)
_OPTIONS = {
    "--seq-len": _either(["128", "64"], NUMBERS),
    "--micro-batch": _either(["1", "4"], NUMBERS),
    "--gpu": _either(["t4", "h100-80gb", "rtx-3060"], TEXT),
    "--headroom": _either(["0.5GiB", "1GiB", "16GB"], SIZES),
    "--memory-budget": _either(["1GiB"], SIZES),
    "--global-batch": _either(["64"], NUMBERS),
    "--global-batch-tokens": _either(["32768"], NUMBERS),
    "--base-lr": _either(["3e-4"], NUMBERS),
    "--base-batch": _either(["8"], NUMBERS),
    "--lora-alpha": _either(["16"], NUMBERS),
    "--lora-dropout": _either(["0.1"], NUMBERS),
    "--lora-rank": _either(["8"], NUMBERS),
    "--num-gpus": _either(["2"], NUMBERS),
    "--grad-accum": _either(["2"], NUMBERS),
    "--method": _either(["full", "lora", "qlora"], TEXT),
    "--precision": _either(["bf16", "fp32", "amp-fp16"], TEXT),
    "--optimizer": _either(["adamw", "sgd", "lion"], TEXT),
    "--sharding": _either(["none", "zero3", "fsdp"], TEXT),
    "--offload": _either(["none", "optimizer"], TEXT),
    "--attention": _either(["auto", "eager"], TEXT),
    "--task": _either(["causal-lm", "classification"], TEXT),
    "--lora-targets": _either(["c_attn", ","], TEXT),
    "--device": _either(["cpu", "cuda"], TEXT),
    "--export": _either(["hf", "deepspeed", "accelerate", "lightning"], TEXT),
    "--choose": _either(["max", "throughput"], TEXT),
    "--max-micro-batch": _either(["4"], NUMBERS),
    "--steps-per-trial": _either(["3"], NUMBERS),
    "--dataset-size": _either(["1000"], NUMBERS),
    "--bogus": _value,
}
_SETUP = [
    "--task",
    "--precision",
    "--optimizer",
    "--method",
    "--lora-alpha",
    "--lora-dropout",
    "--lora-rank",
    "--lora-targets",
    "--attention",
    "--grad-ckpt",
]
_PARALLEL = ["--num-gpus", "--sharding", "--offload"]
_COMMANDS = {
    "estimate": [*_SETUP, *_PARALLEL, "--device", "--gpu", "--grad-accum", "--explain", "--json"],
    "plan": [
        *_SETUP,
        *_PARALLEL,
        "--headroom",
        "--base-lr",
        "--base-batch",
        "--export",
        "--global-batch-tokens",
        "--micro-batch",
        "--json",
    ],
    "gpus": [*_SETUP, "--headroom", "--json"],
    "probe": [
        *_SETUP,
        "--choose",
        "--steps-per-trial",
        "--dataset-size",
        "--global-batch",
        "--json",
    ],
    "models": ["--json"],
}
_FLAGS = {"--grad-ckpt", "--explain", "--json"}


def _pair(name: str) -> st.SearchStrategy[list[str]]:
    if name in _FLAGS:
        return st.just([name])
    return _OPTIONS[name].map(lambda v: [name, v])


@st.composite
def argv(draw: st.DrawFn, models: st.SearchStrategy[str]) -> list[str]:
    command = draw(st.sampled_from([*_COMMANDS, "nosuch"]))
    args = [command]
    if command in ("estimate", "plan", "probe") or (command == "gpus" and draw(st.booleans())):
        args.append(draw(models))
    if command == "estimate":
        args += ["--engine", "analytic", "-b", draw(_OPTIONS["--micro-batch"])]
    if command in ("estimate", "plan", "probe") or len(args) == 2:
        args += ["-s", draw(_OPTIONS["--seq-len"])]
    if command == "plan":
        args += ["--gpu", draw(_OPTIONS["--gpu"]), "--global-batch", "64"]
    if command in ("plan", "gpus"):  # the trace engine's dry runs take seconds each
        args += ["--engine", "analytic"]
    if command == "probe":  # no budget and no --max-micro-batch: it stops before any trial
        args += ["--device", "cpu"]
    names = st.sampled_from([*_COMMANDS.get(command, ["--json"]), "--bogus"])
    for name in draw(st.lists(names, max_size=3)):
        args += draw(_pair(name))
    return args


def _check(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(args, capsys)
    assert "Traceback" not in err, (args, err)
    assert code in (0, 2), (args, code, err)
    if code == 2:
        assert err.startswith("batchfit: error:"), (args, err)
        assert len(err.strip().splitlines()) == 1, (args, err)
    if code == 0 and "--json" in args and "--help" not in args:
        json.loads(out, parse_constant=lambda c: pytest.fail(f"{c} in --json output: {args}"))


_SETTINGS = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@_SETTINGS
@given(args=argv(MODEL))
def test_any_arguments_exit_0_or_2_with_one_line(capsys, args):
    _check(args, capsys)


# Bad config.json files: the values are validated where the config is read (batchfit.models).
_BAD = [math.nan, math.inf, -1, 0, 1e300, "12", None, {"a": 1}, 2.5, True, [1]]
_KEYS = ["n_layer", "n_embd", "n_head", "vocab_size", "n_positions"]


@st.composite
def bad_config(draw: st.DrawFn) -> dict:
    config = dict(PROBE_GPT2)  # the probe tests' tiny GPT-2, then spoiled
    for key in draw(st.lists(st.sampled_from(_KEYS), min_size=1, max_size=2, unique=True)):
        config[key] = draw(st.sampled_from(_BAD))
    if draw(st.booleans()):
        config["architectures"] = draw(st.sampled_from(["GPT2LMHeadModel", None, 3, {"x": 1}]))
    return config


@settings(_SETTINGS)
@given(config=bad_config(), args=argv(st.just("CONFIG")))
def test_bad_config_files_exit_0_or_2_with_one_line(tmp_path_factory, capsys, config, args):
    folder = tmp_path_factory.mktemp("cfg")
    path: Path = folder / "config.json"
    path.write_text(json.dumps(config))  # NaN and Infinity as Python's json writes them
    _check([str(path) if a == "CONFIG" else a for a in args], capsys)
