"""The live line while dry runs take seconds: on a terminal each one is named and counted with
the time so far; ``--json`` (and a pipe) get none."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from batchfit.cli import render
from batchfit.cli.common import _cache_switch
from batchfit.memory.trace import estimate as trace_estimate


def _shown(monkeypatch: pytest.MonkeyPatch, *, quiet: bool, terminal: bool = True) -> str:
    text = io.StringIO()
    console = Console(file=text, force_terminal=terminal, width=200, highlight=False)
    monkeypatch.setattr(render, "err", console)
    with _cache_switch(False, quiet=quiet) as stage:
        stage("the plan's choice")
        assert trace_estimate.on_dry_run is not None
        trace_estimate.on_dry_run("dry run: gpt2, micro-batch 1 x 1024 tokens, 1 of 12 layers")
        trace_estimate.on_dry_run("dry run: gpt2, micro-batch 1 x 1024 tokens, 2 of 12 layers")
    assert trace_estimate.on_dry_run is None  # put back when the command ends
    return text.getvalue()


def test_each_dry_run_is_named_and_counted_on_a_terminal(monkeypatch):
    shown = _shown(monkeypatch, quiet=False)
    assert "the plan's choice: dry run: gpt2, micro-batch 1 x 1024 tokens, 2 of 12 layers" in shown
    assert "(dry run 2, 0 s)" in shown


def test_json_and_pipes_show_no_progress(monkeypatch):
    assert _shown(monkeypatch, quiet=True) == ""
    assert _shown(monkeypatch, quiet=False, terminal=False) == ""


def test_a_dry_run_names_tokens_or_images_by_the_model_s_task(monkeypatch):
    from batchfit.models import resolve_model

    said: list[str] = []
    monkeypatch.setattr(trace_estimate, "on_dry_run", said.append)
    trace_estimate._announce(resolve_model("gpt2"), 4, 1024, 1)
    trace_estimate._announce(resolve_model("vit-base-patch16-224"), 32, 224, None)
    assert said == [
        "dry run: gpt2, micro-batch 4 x 1024 tokens, 1 of 12 layers",
        "dry run: vit-base-patch16-224, micro-batch 32 x 224x224 px images, all layers",
    ]
