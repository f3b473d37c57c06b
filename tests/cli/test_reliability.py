"""The CLI's promise under bad input and faults: exit 0 or 2 (130/143 when stopped), one line
on stderr, never a traceback, no file the user did not name."""

import contextlib
import importlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests._cli import run_cli
from tests._tiny import PROBE_GPT2

# children import batchfit from where this process does
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "HF_HUB_OFFLINE": "1"}
PLAN = ["plan", "gpt2", "--gpu", "t4", "-s", "128", "--global-batch", "64", "--engine", "analytic"]
ESTIMATE = ["estimate", "gpt2", "-b", "1", "-s", "64", "--engine", "analytic"]
GPUS = ["gpus", "gpt2", "-s", "64", "--engine", "analytic"]
PROBE = ["probe", "gpt2", "-s", "64", "--device", "cpu", "--memory-budget", "600MiB"]


def _one_line_error(code, out, err, needle=""):
    assert code == 2, (code, err)
    assert err.startswith("batchfit: error:") and needle in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def _config(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(PROBE_GPT2))
    return folder


# --- one options object: --help still lists every option with its help text ---


@pytest.mark.parametrize("command", ["estimate", "plan", "gpus", "probe"])
def test_help_lists_every_setup_option(capsys, command):
    from batchfit.cli.options import _PARALLEL, _SHARED

    code, out, _ = run_cli([command, "--help"], capsys)
    assert code == 0
    flat = " ".join(out.split())
    bare = "".join(out.split())  # help wraps at hyphens: compare without whitespace
    shared = {**_SHARED, **(_PARALLEL if command in ("estimate", "plan") else {})}
    for name, (annotation, _default) in shared.items():
        assert f"--{name.replace('_', '-')} " in flat
        assert "".join(annotation.__metadata__[0].help.split()) in bare


def test_setup_options_reach_the_library_typed(capsys):
    code, out, _ = run_cli(
        [*ESTIMATE, "--method", "lora", "--lora-targets", "c_attn, c_proj", "--json"], capsys
    )
    assert code == 0
    setup = json.loads(out)["setup"]
    assert setup["method"] == "lora" and setup["lora_targets"] == ["c_attn", "c_proj"]
    code, out, err = run_cli([*ESTIMATE, "--sharding", "zero9"], capsys)
    _one_line_error(code, out, err, "--sharding 'zero9' is not one of")


# --- Ctrl-C and SIGTERM ---


@pytest.mark.parametrize(
    ("args", "target"),
    [
        (ESTIMATE, "batchfit.models.resolve_model"),
        (PLAN, "batchfit.models.resolve_model"),
        (GPUS, "batchfit.models.resolve_model"),
        (["gpus"], "batchfit.hardware.all_gpus"),
        (["models"], "batchfit.models.catalog_names"),
        (PROBE, "batchfit.models.resolve_model"),
    ],
)
def test_ctrl_c_exits_130_with_one_line(capsys, monkeypatch, args, target):
    def interrupted(*_args, **_kwargs):
        raise KeyboardInterrupt

    # a module a command imports lazily, first imported while the target is patched, would
    # keep the patched name for the tests after this one
    importlib.import_module("batchfit.search.probe")

    monkeypatch.setattr(target, interrupted)
    code, out, err = run_cli(args, capsys)
    assert code == 130 and err == "batchfit: interrupted\n" and out == ""


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


# The probe the tests below stop, kill or orphan: PROBE_GPT2 at 64 tokens in 600 MiB, sizes up
# to 16 (every size fits: the search times the halved sizes after the first, so the child
# outlives the first trial)
PROBE_CHILD = ["-s", "64", "--device", "cpu", "--memory-budget", "600MiB", "--max-micro-batch"]
PROBE_HIGH = 16


@pytest.fixture(scope="module")
def probe_config(tmp_path_factory):
    """One model folder for those probes: a dry run is cached under the model's path, so the
    children after the first start from its predictions."""
    return _config(tmp_path_factory.mktemp("probe") / "tiny")


def _child_loading_torch(pid: int, timeout: float = 120) -> int:
    """The probe child of ``pid`` once it loads torch's library: it runs
    ``batchfit.search.probe``, and its parent is past starting it, reading its lines."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for child in _children(pid):
            with contextlib.suppress(OSError):
                if b"libtorch" in Path(f"/proc/{child}/maps").read_bytes():
                    return child
        time.sleep(0.02)
    raise AssertionError(f"no probe child of {pid} loaded torch in {timeout} s")


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_sigterm_stops_the_bar_ends_the_child_and_exits_143(probe_config):
    """SIGTERM once the bar is drawn and the trials' child runs: the bar is stopped (the
    cursor shown again), the child killed and reaped, one line, exit 143."""
    cfg = probe_config
    args = ["probe", str(cfg), *PROBE_CHILD, str(PROBE_HIGH)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "batchfit", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**ENV, "TTY_COMPATIBLE": "1", "COLUMNS": "100"},
    )
    try:
        child = _child_loading_torch(proc.pid)  # the bar starts before the child
        seen = b""
        while b"\x1b[?25l" not in seen:  # the bar hid the cursor
            chunk = proc.stderr.read1(4096)
            assert chunk, seen
            seen += chunk
        assert _children(proc.pid) == [child]
        proc.send_signal(signal.SIGTERM)
        rest = proc.stderr.read()
        assert proc.wait(timeout=60) == 143
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stderr = (seen + rest).decode()
    assert stderr.rstrip().endswith("batchfit: terminated")
    assert stderr.rfind("\x1b[?25h") > stderr.rfind("\x1b[?25l") >= 0  # the cursor shows
    # killed and reaped by the parent (run_child's finally), or, where the command ended before
    # that (seen about once in ten loaded runs: the child still importing torch, orphaned,
    # its parent 1), ended by its own check that its parent is gone once its imports finish
    deadline = time.monotonic() + 30
    while Path(f"/proc/{child}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{child}").exists()


# --- the probe's child ---


def _probe_spec(cfg: Path) -> dict:
    """The spec ``batchfit probe CFG PROBE_CHILD`` gives its child (choosing the largest size,
    two steps a trial): of ``probe_config``, the same predictions (dry runs, cached)."""
    from batchfit.search import probe as _probe
    from batchfit.spec import TrainingSetup

    setup = TrainingSetup(task="causal-lm")
    return _probe.make_spec(str(cfg), setup, "cpu", 64, 600 << 20, "max", PROBE_HIGH, 2)


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_child_killed_by_the_kernel_is_one_line(probe_config, monkeypatch):
    from batchfit.errors import UsageError
    from batchfit.search import probe as _probe

    spec = _probe_spec(probe_config)
    started = subprocess.Popen

    def killed_at_start(*args, **kwargs):
        """The child, SIGKILLed as the kernel's out-of-memory killer would, once started."""
        proc = started(*args, **kwargs)
        os.kill(proc.pid, signal.SIGKILL)
        return proc

    monkeypatch.setattr(subprocess, "Popen", killed_at_start)
    with pytest.raises(UsageError, match=r"killed by signal 9 \(out of memory\?\)"):
        _probe.run_child(spec, lambda _message: None)


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="prctl and /proc")
def test_child_dies_with_its_parent(probe_config):
    # A subreaper adopts the orphan, so its end can be waited for: SIGKILL from the kernel
    # (PR_SET_PDEATHSIG) when the parent is killed, not the end of its trials. No budget: the
    # child skips the predictions (dry runs) and says its first size as soon as it is set up.
    spec = {**_probe_spec(probe_config), "memory_budget": None}
    parent = textwrap.dedent(
        f"""
        import json, os, signal, sys
        from pathlib import Path
        from batchfit.search import probe as _probe
        def die(_message):
            me = os.getpid()
            print(Path(f"/proc/{{me}}/task/{{me}}/children").read_text().split()[0], flush=True)
            os.kill(me, signal.SIGKILL)
        _probe.run_child(json.loads({json.dumps(json.dumps(spec))}), die)
        """
    )
    reaper = textwrap.dedent(
        f"""
        import ctypes, os, subprocess, sys
        ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
        p = subprocess.Popen([sys.executable, "-c", {parent!r}], stdout=subprocess.PIPE)
        child = int(p.stdout.readline())
        p.wait()
        _, status = os.waitpid(child, 0)
        print(os.WTERMSIG(status) if os.WIFSIGNALED(status) else -os.WEXITSTATUS(status))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", reaper], capture_output=True, text=True, env=ENV, timeout=120
    )
    assert result.stdout.strip() == str(int(signal.SIGKILL)), result.stderr


@pytest.mark.parametrize(
    "message",
    ["even a micro-batch of 1 does not fit in 1 GiB", "the chosen micro-batch 4 no longer fits"],
)
def test_probe_nothing_fits_is_a_nofit_error_on_every_device(monkeypatch, tmp_path, message):
    # the CUDA path runs probe() in this process: the search's NoFitError must arrive as one
    # (one line, exit 2); any other ValueError is a bug and keeps its type and traceback
    from batchfit.errors import NoFitError
    from batchfit.search import probe as _probe

    raised: list[Exception] = [NoFitError(message), ValueError(message)]

    def nothing_fits(*_args, **_kwargs):
        raise raised.pop(0)

    monkeypatch.setattr("batchfit.search.find_batch_size", nothing_fits)
    spec = _probe_spec(_config(tmp_path / "tiny"))
    spec.update(memory_budget=None, high=2)
    with pytest.raises(NoFitError, match=message):
        _probe.probe(spec, lambda _message: None)
    with pytest.raises(ValueError, match=message) as bug:
        _probe.probe(spec, lambda _message: None)
    assert not isinstance(bug.value, NoFitError)


def test_probe_child_lets_bugs_raise(monkeypatch):
    from batchfit.errors import UsageError
    from batchfit.search import probe as _probe

    monkeypatch.setattr(sys, "argv", ["_probe", "{}"])
    monkeypatch.setattr(_probe, "_die_with_parent", lambda: None)

    def bug(*_args):
        raise ValueError("a bug")

    monkeypatch.setattr(_probe, "probe", bug)
    with pytest.raises(ValueError, match="a bug"):
        _probe.main()

    def user(*_args):
        raise UsageError("bad input")

    monkeypatch.setattr(_probe, "probe", user)
    _probe.main()  # the user's error is the child's last line, for the parent to print


# --- user text is data ---


@pytest.mark.parametrize("name", ["a[/]b", "[bold red]x"])
@pytest.mark.parametrize("command", [ESTIMATE, PLAN, GPUS])
def test_markup_in_paths_is_printed_as_written(tmp_path, capsys, name, command):
    cfg = _config(tmp_path / name)
    code, out, err = run_cli([command[0], str(cfg), *command[2:]], capsys)
    assert code == 0, err
    assert name in out


@pytest.mark.parametrize("name", ["a[/]b", "[bold red]x"])
def test_markup_in_the_probe_table_is_printed_as_written(tmp_path, capsys, name):
    from batchfit.cli.render import probe as render
    from batchfit.models import resolve_model
    from batchfit.search import probe as _probe
    from tests.cli.test_probe import _result

    info = resolve_model(str(_config(tmp_path / name)))
    report = _probe.report(_result(), global_batch=7, dataset_size=None)
    render.probe_table(info, report, 64, None, tmp_path / name / "p.png")
    out = capsys.readouterr().out
    assert out.count(name) == 2  # the title and the plot's path


@pytest.mark.parametrize("name", ["a[/]b", "[bold red]x"])
def test_markup_in_probe_errors_is_one_line(tmp_path, capsys, name):
    cfg = _config(tmp_path / name)
    code, out, err = run_cli(
        ["probe", str(cfg), "-s", "64", "--device", "cpu", "--memory-budget", "1MiB"], capsys
    )
    _one_line_error(code, out, err, "below the")


# --- numbers ---


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        ([*PLAN, "--headroom", "1e400"], "--headroom"),
        ([*PLAN, "--headroom", "1e40"], "--headroom"),
        ([*GPUS, "--headroom", "1e400"], "--headroom"),
        ([*PROBE[:-1], "1e400"], "--memory-budget"),
        ([*PROBE[:-1], "1e40"], "--memory-budget"),
        ([*ESTIMATE, "--method", "lora", "--lora-alpha", "nan"], "--lora-alpha"),
        ([*ESTIMATE, "--method", "lora", "--lora-dropout", "inf"], "--lora-dropout"),
        ([*PLAN, "--base-lr", "inf", "--base-batch", "8"], "--base-lr"),
        ([*PLAN, "--base-lr", "-nan", "--base-batch", "8"], "--base-lr"),
    ],
)
def test_non_finite_and_absurd_numbers_are_one_line(capsys, args, needle):
    code, out, err = run_cli(args, capsys)
    _one_line_error(code, out, err, needle)


def test_json_is_strict_when_a_result_overflows(capsys):
    # the planner refuses a rate that overflows when scaled, in one line naming it
    args = [*PLAN, "--base-lr", "1e308", "--base-batch", "1", "--json"]
    code, out, err = run_cli(args, capsys)
    _one_line_error(code, out, err, "overflows")
    # and whatever else overflows never reaches stdout as NaN/Infinity: one line instead
    from batchfit.cli import common as app
    from batchfit.errors import UsageError

    with pytest.raises(UsageError, match="non-finite"):
        app._emit_json({"peak_bytes": float("inf")})


# --- output ---


def _cli(args, **kwargs):
    return subprocess.run(
        [sys.executable, "-m", "batchfit", *args], env=ENV, capture_output=True, **kwargs
    )


@pytest.mark.slow
@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_full_disk_is_one_line_and_exit_2():
    with open("/dev/full", "w") as full:
        result = subprocess.run(
            [sys.executable, "-m", "batchfit", "models"], env=ENV, stdout=full, stderr=-1
        )
    assert result.returncode == 2
    assert (
        result.stderr.decode()
        == "batchfit: error: cannot write the output: No space left on device\n"
    )


@pytest.mark.slow
def test_closed_stdout_is_one_line_and_exit_2():
    result = subprocess.run(
        [sys.executable, "-m", "batchfit", "models"],
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=-1,
        preexec_fn=lambda: os.close(1),
    )
    assert result.returncode == 2 and result.stderr.decode().count("\n") == 1
    assert result.stderr.startswith(b"batchfit: error: stdout is closed")


@pytest.mark.slow
@pytest.mark.parametrize("args", [["models", "--json"], ["models"], ["gpus"]])
def test_broken_pipe_exits_quietly(args):
    # JSON goes through print(); tables through rich, whose own handler exits 1
    proc = subprocess.Popen(
        [sys.executable, "-m", "batchfit", *args],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    proc.stdout.close()  # the reader is gone before the first write: `| head -0`
    err = proc.stderr.read()
    assert proc.wait() == 0 and err == b""


def test_plot_and_out_are_checked_before_any_trial(tmp_path, capsys, monkeypatch):
    from batchfit.search import probe as _probe

    def no_trials(*_args, **_kwargs):
        raise AssertionError("a trial ran before the outputs were checked")

    monkeypatch.setattr(_probe, "run_child", no_trials)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # not installed
    code, out, err = run_cli([*PROBE, "--plot", str(tmp_path / "p.png")], capsys)
    _one_line_error(code, out, err, "needs matplotlib")
    monkeypatch.delitem(sys.modules, "matplotlib")
    code, out, err = run_cli([*PROBE, "--plot", str(tmp_path)], capsys)
    _one_line_error(code, out, err, "is a folder")

    def no_engine(*_args, **_kwargs):
        raise AssertionError("the engine ran before --out was checked")

    monkeypatch.setattr("batchfit.plan.make_plan", no_engine)
    code, out, err = run_cli([*PLAN, "--export", "hf", "--out", str(tmp_path)], capsys)
    _one_line_error(code, out, err, "is a folder")


def test_export_writes_only_the_file_named(tmp_path, capsys):
    mine = tmp_path / "ds_config.json"
    mine.write_text("mine")
    target = tmp_path / "train.json"
    args = [*PLAN, "--sharding", "zero2", "--num-gpus", "2", "--export", "hf"]
    code, _, err = run_cli([*args, "--out", str(target)], capsys)
    assert code == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds_config.json", "train.json"]
    assert mine.read_text() == "mine"
    json.loads(target.read_text())


def test_a_model_path_the_os_refuses_is_one_line(capsys):
    code, out, err = run_cli(["estimate", "a" * 5000, "-b", "1", "-s", "64"], capsys)
    _one_line_error(code, out, err, "File name too long")
    assert len(err) < 300  # the name is shortened
