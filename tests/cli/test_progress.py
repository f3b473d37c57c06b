"""The live line while dry runs take seconds: on a terminal each one is named and counted with
the time so far; ``--json`` (and a pipe) get none."""

from __future__ import annotations

import io
import re

import pytest
from rich.console import Console

from batchfit.cli import render
from batchfit.cli.common import _cache_switch
from batchfit.memory.trace import estimate as trace_estimate


def _shown(
    monkeypatch: pytest.MonkeyPatch, *, quiet: bool, terminal: bool = True, width: int = 200
) -> str:
    text = io.StringIO()
    console = Console(file=text, force_terminal=terminal, width=width, highlight=False)
    monkeypatch.setattr(render, "err", console)
    with _cache_switch(False, quiet=quiet) as stage:
        stage("the plan's choice")
        assert trace_estimate.on_dry_run is not None
        trace_estimate.on_dry_run("gpt2, 1 x 1024 tokens, 1 of 12 layers: checkpointing", 1)
        trace_estimate.on_dry_run("gpt2, 1 x 1024 tokens, 2 of 12 layers: checkpointing", 1)
    assert trace_estimate.on_dry_run is None  # put back when the command ends
    return text.getvalue()


def test_each_dry_run_is_named_and_counted_on_a_terminal(monkeypatch):
    shown = _shown(monkeypatch, quiet=False)
    expected = (
        "the plan's choice: dry run 2, 0 s: gpt2, 1 x 1024 tokens, 2 of 12 layers: checkpoint"
    )
    assert expected in shown


def test_a_pair_traced_side_by_side_counts_two(monkeypatch):
    text = io.StringIO()
    monkeypatch.setattr(render, "err", Console(file=text, force_terminal=True, width=200))
    with _cache_switch(False, quiet=False):
        assert trace_estimate.on_dry_run is not None
        trace_estimate.on_dry_run("gpt2, 1 x 1024 tokens, 1 and 2 of 12 layers", 2)
        trace_estimate.on_dry_run("gpt2, 2 x 1024 tokens, 1 and 2 of 12 layers", 2)
    assert "dry runs 3-4, 0 s: gpt2, 2 x 1024 tokens, 1 and 2 of 12 layers" in text.getvalue()


def test_at_80_columns_the_count_shows_and_the_rest_ends_in_an_ellipsis(monkeypatch):
    shown = _shown(monkeypatch, quiet=False, width=80)
    assert "the plan's choice: dry run 2, 0 s: gpt2, 1 x 1024 tokens, 2 of 12 layers" in shown
    assert "…" in shown and "checkpointing" not in shown  # the options, last, are cut
    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", shown).replace("\r", "\n")
    assert all(len(line.rstrip()) <= 80 for line in plain.splitlines())


def test_json_and_pipes_show_no_progress(monkeypatch):
    assert _shown(monkeypatch, quiet=True) == ""
    assert _shown(monkeypatch, quiet=False, terminal=False) == ""


def test_a_dry_run_names_its_setup_and_tokens_or_images_by_the_model_s_task(monkeypatch):
    from batchfit.models import resolve_model
    from batchfit.spec import TrainingSetup

    said: list[str] = []
    monkeypatch.setattr(trace_estimate, "on_dry_run", lambda text, n: said.append(f"{n}: {text}"))
    trace_estimate._announce(resolve_model("gpt2"), TrainingSetup(), 4, 1024, 1)
    trace_estimate._announce(resolve_model("gpt2"), TrainingSetup(), 4, 1024, 2, 1)
    lean = TrainingSetup(grad_ckpt=True, optimizer="adamw-8bit")
    trace_estimate._announce(resolve_model("vit-base-patch16-224"), lean, 32, 224, None)
    assert said == [
        "1: gpt2, 4 x 1024 tokens, 1 of 12 layers",
        "2: gpt2, 4 x 1024 tokens, 1 and 2 of 12 layers",  # a pair, side by side
        "1: vit-base-patch16-224, 32 x 224x224 px images, all layers: checkpointing + adamw-8bit",
    ]


def test_the_seconds_tick_while_a_dry_run_runs(monkeypatch):
    """The line is drawn at each refresh: a dry run of many seconds shows its clock run, not
    the seconds at which it started."""
    import time

    text = io.StringIO()
    monkeypatch.setattr(render, "err", Console(file=text, width=200, highlight=False))
    line = render._Ticking(f"dry run 3, {render.CLOCK} s: gpt2", time.monotonic() - 7.2)
    render.err.print(line)
    clock = [time.monotonic() + 5]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    render.err.print(line)
    assert text.getvalue().splitlines() == ["dry run 3, 7 s: gpt2", "dry run 3, 12 s: gpt2"]


def test_the_first_dry_run_is_named_before_torch_is_imported(tmp_path):
    """The import of torch and transformers (seconds) runs under the first dry run's name and
    clock, not a bare spinner (a fresh interpreter: this one has torch)."""
    import os
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from batchfit.memory.trace import estimate as te\n"
        "class Stop(Exception): pass\n"
        "def said(text, runs):\n"
        "    print('torch' in sys.modules, text)\n"
        "    raise Stop\n"
        "te.on_dry_run = said\n"
        "import batchfit\n"
        "from batchfit.models import resolve_model\n"
        "try:\n"
        "    batchfit.estimate(resolve_model('gpt2'), micro_batch_size=2, seq_len=128,\n"
        "                      gpu=batchfit.get_gpu('t4'))\n"
        "except Stop:\n"
        "    pass\n"
    )
    env = {**os.environ, "BATCHFIT_CACHE_DIR": str(tmp_path), "BATCHFIT_NO_CACHE": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    assert out.stdout.startswith("False gpt2, 2 x 128 tokens, 1 of 12 layers"), out
