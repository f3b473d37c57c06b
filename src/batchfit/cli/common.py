"""What the commands share once their options are parsed: the JSON writer, the check that an
output file can be written, and the trace cache switch with its progress line."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import typer

from batchfit._version import versions
from batchfit.errors import UsageError


@contextlib.contextmanager
def _cache_switch(
    no_cache: bool, verbose: bool = False, quiet: bool = False
) -> Iterator[Callable[[str], None]]:
    """The trace cache off for this command when --no-cache is given, its notes on stderr
    with --verbose; each dry run shown as progress on a terminal (they take seconds), unless
    ``quiet`` (--json). Yields the function that names the stage the dry runs belong to
    (shown before each)."""
    # logging, the cache, the trace engine and rich load when a command runs, not for --help
    import logging

    from batchfit import _cache
    from batchfit.cli import render
    from batchfit.memory.trace import estimate as _trace_estimate

    with contextlib.ExitStack() as stack:
        if no_cache:
            stack.enter_context(_cache.disabled())
        if verbose:
            handler = logging.StreamHandler()  # stderr
            handler.setFormatter(logging.Formatter("note: %(message)s"))
            _cache.log.addHandler(handler)
            _cache.log.setLevel(logging.INFO)
            stack.callback(_cache.log.removeHandler, handler)
        # the spinner alone until a stage or a dry run is named (the formulas run none)
        status = stack.enter_context(render.progress("", shown=not quiet))
        stage = [""]
        runs = [0]
        start = time.monotonic()

        def named(text: str, count: int) -> None:
            # how many dry runs so far and for how long (the clock ticks while one runs): a
            # search has no count known ahead; two side by side are counted together
            first = runs[0] + 1
            runs[0] += count
            which = f"s {first}-{runs[0]}" if count > 1 else f" {first}"
            head = f"{stage[0]}: " if stage[0] else ""
            status(f"{head}dry run{which}, {render.CLOCK} s: {text}", start)

        def set_stage(text: str) -> None:
            stage[0] = text
            status(text)

        previous = _trace_estimate.on_dry_run
        _trace_estimate.on_dry_run = named
        stack.callback(setattr, _trace_estimate, "on_dry_run", previous)
        yield set_stage


def _warn(message: str) -> None:
    """One warning line on stderr (a calibration file set aside while it is read)."""
    typer.echo(f"batchfit: warning: {message}", err=True)


def _emit_json(obj: dict[str, Any]) -> None:
    """Print ``obj`` and the versions as one strict JSON object on stdout."""
    try:  # strict JSON: never NaN or Infinity, which JSON readers reject
        text = json.dumps({**obj, "versions": versions()}, indent=2, allow_nan=False)
    except ValueError:
        raise UsageError(
            "a result overflowed to a non-finite number: an input is out of any real range "
            "(e.g. --base-lr); give realistic values"
        ) from None
    print(text)


def _check_output(path: Path, option: str) -> None:
    """Refuse an output file that cannot be written, before any engine or trial runs."""
    folder = path.parent
    if not folder.is_dir():
        # the nearest part of the path that exists says which mistake it is
        above = next((p for p in folder.parents if p.exists()), None)
        if folder.exists() or (above is not None and not above.is_dir()):
            blocker = folder if folder.exists() else above
            raise UsageError(f"{option} {path}: {blocker} is a file, not a folder")
        raise UsageError(f"{option} {path}: the folder {folder} does not exist")
    if path.is_dir():
        raise UsageError(f"{option} {path} is a folder: name a file")
    if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise UsageError(f"{option} {path}: no permission to write there")
