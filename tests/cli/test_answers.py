"""The same question from the command line again replays what it printed: the same output
and exit code, without torch, transformers or typer; anything its answer depends on changed,
it is computed again."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from batchfit.cli import _answers

# prints which of the heavy modules the run imported, after the command's own output
_RUN = (
    "import sys\n"
    "from batchfit.cli import main\n"
    "code = 0\n"
    "try:\n"
    "    main()\n"
    "except SystemExit as e:\n"
    "    code = e.code or 0\n"
    "heavy = [m for m in ('torch', 'transformers', 'typer') if m in sys.modules]\n"
    "print('IMPORTED=' + ','.join(heavy), file=sys.stderr)\n"
    "sys.exit(code)\n"
)


def _batchfit(args: list[str], cache: Path, cwd: Path) -> tuple[int, str, str, str]:
    """(exit code, stdout, stderr without the last line, the heavy modules imported)."""
    env = {**os.environ, "BATCHFIT_CACHE_DIR": str(cache)}
    env.pop("BATCHFIT_NO_CACHE", None)
    done = subprocess.run(
        [sys.executable, "-c", _RUN, *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )
    err, _, imported = done.stderr.rstrip("\n").rpartition("\n")
    if not imported.startswith("IMPORTED="):  # the only line on stderr
        err, imported = "", done.stderr.strip()
    return done.returncode, done.stdout, err, imported.removeprefix("IMPORTED=")


@pytest.mark.slow
def test_a_repeated_plan_prints_the_same_without_importing_the_cli(tmp_path):
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("300\n900\n" * 50)
    args = ["plan", "gpt2", "--gpu", "t4", "--seq-len", "1024", "--lengths", "lengths.txt"]
    args += ["--global-batch", "32", "--engine", "analytic"]  # the trace's answer: the same way
    cold = _batchfit(args, tmp_path / "cache", tmp_path)
    warm = _batchfit(args, tmp_path / "cache", tmp_path)
    assert cold[0] == 0 and "typer" in cold[3]
    assert warm[:3] == cold[:3]
    assert warm[3] == ""  # none of torch, transformers, typer
    # the file changes: the question is new
    lengths.write_text("1000\n" * 100)
    changed = _batchfit(args, tmp_path / "cache", tmp_path)
    assert "typer" in changed[3] and changed[1] != cold[1]


@pytest.mark.slow
def test_an_estimate_that_does_not_fit_replays_its_exit_code(tmp_path):
    args = ["estimate", "gpt2", "--gpu", "t4", "-s", "64", "-b", "100000", "--check"]
    args += ["--engine", "analytic"]
    cold = _batchfit(args, tmp_path / "cache", tmp_path)
    warm = _batchfit(args, tmp_path / "cache", tmp_path)
    assert cold[0] == 1 and warm[:3] == cold[:3] and warm[3] == ""


@pytest.mark.slow
def test_bad_input_and_no_cache_are_not_kept(tmp_path):
    bad = ["plan", "gpt2", "--gpu", "no-such-gpu", "--seq-len", "128", "--engine", "analytic"]
    assert _batchfit(bad, tmp_path / "cache", tmp_path)[0] == 2
    fresh = ["plan", "gpt2", "--gpu", "t4", "--seq-len", "64", "--global-batch", "8"]
    fresh += ["--engine", "analytic", "--no-cache"]
    assert _batchfit(fresh, tmp_path / "cache", tmp_path)[0] == 0
    assert not (tmp_path / "cache" / _answers.NAMESPACE).exists()


def test_the_key_names_what_the_answer_depends_on(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("100\n200\n")
    args = ["plan", "gpt2", "--gpu", "t4", f"--lengths={lengths}"]
    first = _answers.key(args)
    assert first is not None and str(lengths) in first["files"]
    os.utime(lengths, ns=(1, 1))
    assert _answers.key(args) != first
    monkeypatch.setenv("COLUMNS", "80")
    assert _answers.key(args)["env"]["COLUMNS"] == "80"
    assert _answers.key(["plan", "gpt2", "--gpu", "t4"])["cwd"] == str(tmp_path)


@pytest.mark.parametrize(
    "args",
    [
        ["probe", "gpt2"],
        ["models"],
        ["plan", "gpt2", "--help"],
        ["plan", "gpt2", "--export", "hf"],
        ["plan", "gpt2", "--report=page.html"],
        ["estimate", "gpt2", "-b", "1", "--timeline", "t.html"],
        ["plan", "gpt2", "--no-cache"],
        ["plan", "gpt2", "-v"],
        ["estimate", "my_model.py:Net", "-b", "1"],
        ["plan", "some-org/some-model", "--gpu", "t4"],  # a hub id, not a folder here
        ["plan", "gpt2", "--lengths", "-"],
    ],
)
def test_commands_that_write_read_stdin_or_load_code_are_always_computed(args, tmp_path):
    os.chdir(tmp_path)
    assert _answers.key(args) is None


def test_the_progress_line_is_not_kept(capsys):
    kept: list[list[str]] = []
    tee = _answers._Tee(sys.stderr, "stderr", kept)
    tee.write("before\n")
    with tee.hold():
        tee.write("\rdry run 3 ...")
    tee.write("after\n")
    assert kept == [["stderr", "before\nafter\n"]]
    assert "dry run 3" in capsys.readouterr().err  # shown, only not kept
