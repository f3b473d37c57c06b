"""The disk cache of dry-run results: it answers warm runs without torch and never fails one."""

from __future__ import annotations

import copy
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from batchfit import _cache
from batchfit.hardware import get_gpu
from batchfit.memory.estimate import estimate
from batchfit.memory.trace import estimate as trace_estimate
from batchfit.models import resolve_model
from batchfit.spec import TrainingSetup
from tests._cli import plan_setup_flags, run_cli
from tests._tiny import TINY_GPT2

KEY = {"model": "m", "config": {"n_layer": 2}, "micro": 4}


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHFIT_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("BATCHFIT_NO_CACHE", raising=False)
    return tmp_path


def _files(root: Path) -> list[Path]:
    return sorted(root.glob("ns/*.json"))


def test_roundtrip_and_key_parts(cache_dir):
    assert _cache.load("ns", KEY) is None
    _cache.store("ns", KEY, {"v": 1})
    assert _cache.load("ns", KEY) == {"v": 1}
    assert _cache.load("ns", {**KEY, "micro": 5}) is None


def test_a_version_change_is_a_miss(cache_dir, monkeypatch):
    _cache.store("ns", KEY, {"v": 1})
    versions = dict(_cache._versions())
    monkeypatch.setattr(_cache, "_versions", lambda: {**versions, "torch": "99.0"})
    assert _cache.load("ns", KEY) is None


@pytest.mark.parametrize(
    "content", [b"\x00\xff garbage", b'{"key": "x", "val', b"[1, 2]", b'{"key": 1, "value": {}}']
)
def test_a_corrupt_file_is_ignored_and_rewritten(cache_dir, content, caplog):
    _cache.store("ns", KEY, {"v": 1})
    (path,) = _files(cache_dir)
    path.write_bytes(content)
    with caplog.at_level(logging.INFO, logger="batchfit.cache"):
        assert _cache.load("ns", KEY) is None
    assert "cache:" in caplog.text
    _cache.store("ns", KEY, {"v": 2})
    assert _cache.load("ns", KEY) == {"v": 2}


def test_a_directory_in_place_of_the_file_is_a_miss(cache_dir):
    _cache.store("ns", KEY, {"v": 1})
    (path,) = _files(cache_dir)
    path.unlink()
    path.mkdir()
    assert _cache.load("ns", KEY) is None
    _cache.store("ns", KEY, {"v": 2})  # cannot replace a directory: nothing happens


def test_an_unwritable_cache_never_fails(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("BATCHFIT_CACHE_DIR", str(blocker / "cache"))
    _cache.store("ns", KEY, {"v": 1})  # mkdir under a file: OSError, swallowed
    assert _cache.load("ns", KEY) is None


def test_disabled_by_the_switch_and_by_the_environment(cache_dir, monkeypatch):
    with _cache.disabled():
        _cache.store("ns", KEY, {"v": 1})
        assert _cache.load("ns", KEY) is None
    assert not _files(cache_dir)
    _cache.store("ns", KEY, {"v": 1})
    monkeypatch.setenv("BATCHFIT_NO_CACHE", "1")
    assert _cache.load("ns", KEY) is None


def _cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    code = (
        "import sys\n"
        "from batchfit.cli import main\n"
        "code = 0\n"
        "try:\n"
        f"    main({args!r})\n"
        "except SystemExit as e:\n"
        "    code = e.code\n"
        "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH', file=sys.stderr)\n"
        "sys.exit(code)\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600
    )


@pytest.fixture
def tiny_config(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("tiny") / "config.json"
    path.write_text(json.dumps(TINY_GPT2))
    return str(path)


def _json_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> dict:
    code, out, err = run_cli([*args, "--json"], capsys)
    assert code == 0, err
    return dict(json.loads(out))


@pytest.mark.slow
def test_a_warm_plan_needs_no_torch_and_gives_the_same_answer(
    cache_dir, tiny_config, capsys, monkeypatch
):
    """The cold plan runs here (torch is loaded anyway); the warm one in a fresh process,
    where torch would show if anything traced (or if the config file were read again)."""
    args = ["plan", tiny_config, "--gpu", "t4", "--seq-len", "64", "--global-batch", "32"]
    cold = _json_cli(args, capsys)
    env = {**os.environ, "BATCHFIT_CACHE_DIR": str(cache_dir)}
    warm = _cli([*args, "--json"], env)
    assert "NO-TORCH" in warm.stderr.split(), warm.stderr
    assert json.loads(warm.stdout) == cold
    # --no-cache traces again and agrees: the plan's setup, estimated
    runs: list[int] = []
    dry_runs = trace_estimate._dry_runs
    monkeypatch.setattr(trace_estimate, "_dry_runs", lambda *a: runs.append(1) or dry_runs(*a))
    sized = ["-b", str(cold["micro_batch_size"]), "--grad-accum", str(cold["grad_accum_steps"])]
    again = ["estimate", *args[1:6], *sized, *plan_setup_flags(cold), "--no-cache"]
    fresh = _json_cli(again, capsys)
    assert runs  # traced, not read back
    assert fresh["device_total_bytes"] == cold["device_total_bytes"]


@pytest.mark.slow
def test_a_corrupt_cache_never_fails_a_command(cache_dir, tiny_config, capsys):
    args = ["estimate", tiny_config, "--gpu", "t4", "-s", "64", "-b", "2"]
    first = _json_cli(args, capsys)
    stored = list(cache_dir.rglob("*.json"))
    assert stored
    for path in stored:
        path.write_text("{ broken")
    again = _json_cli(args, capsys)
    assert again["device_total_bytes"] == first["device_total_bytes"]


@pytest.mark.slow
def test_a_trace_leaves_the_config_as_it_was_so_the_cache_hits(tmp_path, monkeypatch):
    # transformers added rope_theta to llama-3.2's rope_scaling dict in place: the cache key
    # at store time differed from the one at load time, and every run traced again
    monkeypatch.setenv("BATCHFIT_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("BATCHFIT_NO_CACHE", raising=False)
    info = resolve_model("llama-3.2-1b")
    before = copy.deepcopy(info.config)
    kw = {"micro_batch_size": 1, "seq_len": 128, "gpu": get_gpu("t4"), "engine": "trace"}
    first = estimate(info, TrainingSetup(), **kw)  # type: ignore[arg-type]
    assert info.config == before
    stored = sorted(tmp_path.rglob("*.json"))
    assert stored
    again = estimate(resolve_model("llama-3.2-1b"), TrainingSetup(), **kw)  # type: ignore[arg-type]
    assert sorted(tmp_path.rglob("*.json")) == stored  # a hit: nothing new written
    assert again.peak_bytes == first.peak_bytes


@pytest.mark.slow
def test_what_only_the_planner_reads_shares_the_dry_runs(cache_dir, tiny_config, monkeypatch):
    """A plan's setup and the same setup as its `estimate` line spells it (an explicit loss and
    method, which the planner then keeps; torch.compile) run the same step: one dry run."""
    info, kw = (
        resolve_model(tiny_config),
        {"micro_batch_size": 2, "seq_len": 64, "gpu": get_gpu("t4")},
    )
    runs: list[int] = []
    dry_runs = trace_estimate._dry_runs
    monkeypatch.setattr(trace_estimate, "_dry_runs", lambda *a: runs.append(1) or dry_runs(*a))
    first = estimate(info, TrainingSetup(), engine="trace", **kw)  # type: ignore[arg-type]
    kept = TrainingSetup(keep_loss=True, keep_method=True, compile=True)
    again = estimate(info, kept, engine="trace", **kw)  # type: ignore[arg-type]
    assert len(runs) == 1
    assert again.device_total_bytes == first.device_total_bytes


def test_the_same_config_under_another_path_reads_the_same_dry_runs(
    cache_dir, tiny_config, tmp_path_factory, monkeypatch
):
    """A config file's model is built from its config and task, not its path: a script that
    writes its config.json to a fresh folder each run (the example) reads its dry runs back."""
    other = tmp_path_factory.mktemp("elsewhere") / "config.json"
    other.write_text(Path(tiny_config).read_text())
    kw = {"micro_batch_size": 2, "seq_len": 64, "gpu": get_gpu("t4")}
    runs: list[int] = []
    dry_runs = trace_estimate._dry_runs
    monkeypatch.setattr(trace_estimate, "_dry_runs", lambda *a: runs.append(1) or dry_runs(*a))
    first = estimate(resolve_model(tiny_config), TrainingSetup(), engine="trace", **kw)  # type: ignore[arg-type]
    again = estimate(resolve_model(str(other)), TrainingSetup(), engine="trace", **kw)  # type: ignore[arg-type]
    assert len(runs) == 1
    assert (again.model, again.device_total_bytes) == (str(other), first.device_total_bytes)


@pytest.mark.slow
@pytest.mark.parametrize(("value", "off"), [("1", True), ("yes", True), ("0", False), ("", False)])
def test_any_no_cache_value_but_a_false_one_switches_the_cache_off(monkeypatch, value, off):
    monkeypatch.setenv("BATCHFIT_NO_CACHE", value)
    assert _cache.enabled() is not off


@pytest.mark.slow
def test_a_config_file_described_once_is_read_back_without_torch(cache_dir, tiny_config):
    """Its parameter table and whole config are cached: another question about the file (not
    the same one replayed) resolves it in a fresh process without torch or transformers."""
    here = resolve_model(tiny_config)
    code = (
        "import sys\n"
        "from batchfit.models import resolve_model\n"
        "info = resolve_model(sys.argv[1])\n"
        "print(info.total_params, info.arch.num_layers, 'torch' in sys.modules, "
        "'transformers' in sys.modules)\n"
    )
    env = {**os.environ, "BATCHFIT_CACHE_DIR": str(cache_dir)}
    done = subprocess.run(
        [sys.executable, "-c", code, tiny_config], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    total, layers, torch_loaded, hf_loaded = done.stdout.split()
    assert (int(total), int(layers)) == (here.total_params, here.arch.num_layers)
    assert (torch_loaded, hf_loaded) == ("False", "False")
