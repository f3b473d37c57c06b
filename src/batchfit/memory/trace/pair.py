"""The two dry runs of a deep model side by side, on a second core.

A deep model is traced at two depths (``estimate._dry_runs``), and the two dry runs share
nothing: where a second core is free, the shallower runs in a forked copy of this process
while this one runs the deeper. Most of a dry run is fake-tensor dispatch in Python, and
the shallow run costs about what the deep one does (the embeddings, head, loss and optimizer
are in both), so a pair takes about the time of one.

The copy is forked, not spawned, after the first pair ran here: it starts with torch,
transformers and the model's class imported and fake-tensor dispatch warm (a spawned one
would import them again, seconds). One worker serves the whole command.
Whatever goes wrong there (the worker dies, a result does not pickle, the trace itself
raises), the dry run runs here instead, so the answer, or the error, is the one a single
process gives. ``BATCHFIT_TRACE_WORKERS=0`` keeps every dry run in this process.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import replace
from typing import Any

from batchfit import _libc
from batchfit.memory.trace.result import TraceResult

ENV = "BATCHFIT_TRACE_WORKERS"

_pool: ProcessPoolExecutor | None = None
_broken = False
_warm = False  # a pair has run here: the fork inherits its imports and fake-tensor caches


def wanted() -> bool:
    """Whether a dry run may go to the worker: Linux (fork), at least two cores this process
    may run on, and not switched off (``BATCHFIT_TRACE_WORKERS=0``)."""
    if os.environ.get(ENV, "").strip().lower() in ("0", "false", "no", "off"):
        return False
    if sys.platform != "linux" or _broken:
        return False
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return cores >= 2


def _child_setup() -> None:
    """The worker dies with its parent, leaves Ctrl-C to it, and writes nothing: its twin
    dry run here prints the same warnings (and a progress bar's lock may have been held at
    the fork)."""
    _libc.die_with_parent(_libc.libc())
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    os.close(devnull)
    from batchfit.memory.trace import estimate

    estimate.on_dry_run = None


def _traced(model: Any, setup: Any, kw: dict[str, Any]) -> TraceResult:
    from batchfit.memory.trace.hf import trace_once

    # the timeline holds the tracker's live objects; the estimate needs none of it
    return replace(trace_once(model, setup, **kw), timeline=None)


def submit(model: Any, setup: Any, kw: dict[str, Any]) -> Future[TraceResult] | None:
    """``trace_once(model, setup, **kw)`` started in the worker; None where it cannot be."""
    global _pool, _broken, _warm
    if not wanted():
        return None
    if not _warm:  # the first pair runs here: its model class and kernels load once
        _warm = True
        return None
    try:
        if _pool is None:
            import multiprocessing

            context = multiprocessing.get_context("fork")
            _pool = ProcessPoolExecutor(1, mp_context=context, initializer=_child_setup)
        return _pool.submit(_traced, model, setup, kw)
    except Exception:  # no worker (a sandbox without fork, no semaphores): run it here
        _broken = True
        return None


def collect(future: Future[TraceResult] | None, here: Callable[[], TraceResult]) -> TraceResult:
    """The worker's result, or ``here()`` where there is none or it failed (the error a
    single process gives is then raised here)."""
    global _broken
    if future is not None:
        try:
            return future.result()
        except Exception as exc:
            from concurrent.futures.process import BrokenProcessPool

            if isinstance(exc, BrokenProcessPool):
                _broken = True
    return here()


def abandon(future: Future[TraceResult] | None) -> None:
    """Drop a started dry run whose twin failed here."""
    if future is not None:
        with contextlib.suppress(Exception):
            future.cancel()
