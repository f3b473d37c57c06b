"""The ``batchfit`` typer app: its root options, and the commands registered in the order
``--help`` lists them. Each command lives in a module of its own (``cli/estimate.py``,
``cli/plan.py``, ...), which parses and checks its options; the library computes and
``cli/render/`` prints. Errors become one line and an exit code in ``cli/__init__.py``."""

from __future__ import annotations

from typing import Annotated

import typer

from batchfit._version import versions
from batchfit.cli import batch_size, calibration, estimate, gpus, models, monitor, plan, probe


def _whole_words_in_help() -> None:
    """``--help`` wraps its text between words only: click's wrapper breaks after a hyphen by
    default, which split option values (``sgd-`` / ``momentum``, ``masked-`` / ``lm``) that a
    reader copies. Where the wrapper is not where this click keeps it, help wraps as before."""
    import importlib

    for name in ("typer._click._textwrap", "click._textwrap"):  # typer's own click, else click
        try:
            wrapper = importlib.import_module(name).TextWrapper
        except (ImportError, AttributeError):
            continue
        # the pattern it splits words by when breaking on hyphens: the one it uses when not
        wrapper.wordsep_re = wrapper.wordsep_simple_re
        return


_whole_words_in_help()

app = typer.Typer(
    name="batchfit",
    help="What a training step needs, the micro-batch that fits, and exact accumulation plans.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)

app.command()(estimate.estimate)
app.command()(plan.plan)
app.command()(models.models)
app.command()(gpus.gpus)


@app.callback(invoke_without_command=True)
def _root(
    version: Annotated[bool, typer.Option("--version", help="Show versions and exit.")] = False,
) -> None:
    if version:
        print(" ".join(f"{k} {v}" for k, v in versions().items()))
        raise typer.Exit(0)


app.command()(probe.probe)
app.command("batch-size")(batch_size.batch_size)
app.command(context_settings={"allow_interspersed_args": False})(monitor.monitor)
app.command()(calibration.calibration)
