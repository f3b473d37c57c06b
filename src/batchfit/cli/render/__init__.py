"""Rendering for people: rich tables on stdout, warnings on stderr. No computing here.

This module holds the two consoles and the lines every command prints the same way; each
command's tables live in a module of their own (``render.plan``, ``render.probe``, ...). Those
modules print through ``render.out`` and ``render.err`` as attributes, looked up at each call,
so that :func:`on_stderr` moves a whole answer to stderr.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
import time
from collections.abc import Iterator
from typing import Protocol

from rich.console import Console
from rich.markup import escape

from batchfit.cli import _answers
from batchfit.cli.render.layout import print_line


class _Console(Console):
    """rich's Console, except that a reader closing the pipe (``| head``) raises
    ``BrokenPipeError`` for ``cli.main`` to end quietly with 0; rich's own exits with 1."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        raise BrokenPipeError(errno.EPIPE, "Broken pipe")


def _width(stream: object) -> int | None:
    """A terminal's own width (None: rich asks it); 160 columns for a pipe or a file, where
    rich's 80 cut each technique name of a table over a dozen lines. ``COLUMNS`` decides
    where it is set."""
    isatty = getattr(stream, "isatty", None)
    if (isatty is not None and isatty()) or os.environ.get("COLUMNS"):
        return None
    return PIPE_WIDTH


PIPE_WIDTH = 160
# soft_wrap: rich never cuts a line; `line` wraps each between words (tables fit the width).
out = _Console(highlight=False, soft_wrap=True, width=_width(sys.stdout))
err = _Console(stderr=True, highlight=False, soft_wrap=True, width=_width(sys.stderr))


class Status(Protocol):
    """A live line's update: its text, and where the text has ``CLOCK``, the
    ``time.monotonic()`` its seconds count from."""

    def __call__(self, text: str, since: float | None = None) -> None: ...


# where a live line's text shows the seconds, ticking at each refresh
CLOCK = "\x00"


@contextlib.contextmanager
def progress(what: str, shown: bool = True) -> Iterator[Status]:
    """A one-line status on stderr while ``what`` runs, on a terminal only (and only when
    ``shown``); yields the function that updates it."""
    if not shown or not err.is_terminal:
        yield lambda _text, _since=None: None
        return
    # redrawn in place, so not part of the answer a repeated question replays
    with _answers.hold(), err.status(what) as status:

        def update(text: str, since: float | None = None) -> None:
            status.update(_Ticking(text, since))

        yield update


class _Ticking:
    """A live line's text, drawn at each refresh: with ``since`` (a ``time.monotonic()``),
    ``CLOCK`` in it is the seconds since then, so a dry run of many seconds shows its clock
    running. One line, cut with an ellipsis at the terminal's width (the count comes
    first; the spinner and a space take two columns)."""

    def __init__(self, text: str, since: float | None) -> None:
        self.text, self.since = text, since

    def __rich__(self) -> str:
        text = self.text
        if self.since is not None:
            text = text.replace(CLOCK, f"{time.monotonic() - self.since:.0f}")
        room = max(err.width - 2, 2)
        return escape(text if len(text) <= room else text[: room - 1] + "…")


def line(markup: str) -> None:
    """One line of an answer (rich markup) on stdout, wrapped at the width between words, the
    lines after the first under the text after its ``key: ``."""
    print_line(out, markup)


def note(text: str) -> None:
    """One line about the inputs, before the answer (user text escaped)."""
    line(escape(text))


def wrote(path: object, what: str) -> None:
    """``wrote FILE (what)`` on stderr, after a file option's file is written: stdout stays the
    answer's."""
    err.print(f"wrote {path} ({what})", markup=False, highlight=False)


def warn(warnings: tuple[str, ...] | list[str]) -> None:
    """Each warning on stderr, one line each (user text escaped)."""
    for w in warnings:
        print_line(err, f"[yellow]warning:[/] {escape(w)}")


@contextlib.contextmanager
def on_stderr() -> Iterator[None]:
    """Print what would go to stdout on stderr instead (stdout kept for one file's text)."""
    global out
    kept, out = out, err
    try:
        yield
    finally:
        out = kept


def sample_size(size: int, image: bool) -> str:
    """One sample's size as the options spell it: ``seq 512`` or ``image 224 px``."""
    return f"image {size} px" if image else f"seq {size}"
