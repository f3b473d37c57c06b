"""Probe: the fastest micro-batch on the real device, in a few real steps.

Every size it reports ran for real. It starts near the limit the estimators predict and
measures each size's peak memory in one steady step (two for the first size that fits: its
first step may allocate the optimizer state). The next size comes from the measured peaks,
affine in the micro-batch (the largest measured peak plus the estimate's bytes per sample for
each sample more; least squares without an estimate), and the search stops when that says one
sample more would not fit. The largest size that fitted then runs ``steps_per_trial`` steps
in a row, the last trial extended or, after an out-of-memory error, run again; the choice is
run again only if an out-of-memory error came after its last full trial, so it is confirmed
in the state the search leaves. Only steps after a trial's first are timed.
``choose="throughput"`` also times halved sizes while they stay within 2% of the best and
takes the smallest of the equally fast. Model, optimizer, gradients and RNG states are put
back in ``finally``.

Here: the arguments. The search's order and the throughput rule are in ``_order.py``, the
trials and the result in ``_trials.py``, the next size's arithmetic in ``_fitline.py``, one
trial's steps (a batch of another size than asked refused, an OOM caught, peak and speed
measured) in ``_trialrun.py``.
"""

from __future__ import annotations

import contextlib
import numbers
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import torch

from batchfit._batchnorm import batchnorm_warning, has_batchnorm
from batchfit._memwatch import MemoryWatch
from batchfit._oom import release_memory
from batchfit.search._order import SavedState, Search
from batchfit.search._trials import PLATEAU, Choose, SearchResult, Trial

__all__ = ["PLATEAU", "Choose", "SearchResult", "Trial", "find_batch_size"]

# Budgets from 1 byte to 4 EiB, beyond any machine: the CPU's OS limit (what the process holds
# plus the budget) must stay a 64-bit count.
_MAX_BUDGET_BYTES = 2**62


def find_batch_size(
    step_fn: Callable[[Any], Any],
    make_batch: Callable[[int], Any],
    *,
    device: str | torch.device = "cpu",
    memory_budget: int | None = None,
    low: int = 1,
    high: int | None = None,
    start: int | None = None,
    bytes_per_sample: int | None = None,
    choose: Choose = "throughput",
    steps_per_trial: int = 3,
    max_trials: int = 8,
    model: torch.nn.Module | None = None,
    optimizer: Any | None = None,
    on_trial: Callable[[Trial], None] | None = None,
    budget_applied: bool = False,
    restore: bool = True,
) -> SearchResult:
    """Find the fastest micro-batch that trains on ``device``, in a few real steps.

    Args:
        step_fn: one full training step on a batch (forward, backward, optimizer step), as
            your loop writes it: keeping the outputs through ``backward()`` rather than only
            the loss (HF Trainer, Lightning) adds one logits tensor to the peak (``--loop`` in
            the CLI, ``TrainingSetup.loop`` for the estimate you pass as ``start``).
        make_batch: a batch of exactly the given number of samples along dim 0 (a list: its
            length); a batch of another size (a short dataset) is refused, never reported.
        device: where the steps run (``"cpu"`` or ``"cuda[:i]"``).
        memory_budget: bytes the training state may take (weights, gradients, optimizer state,
            activations, workspaces): on CUDA the process's memory fraction; on the CPU an OS
            limit (``RLIMIT_DATA``): what the process holds now plus the budget, minus the bytes
            of ``model`` and ``optimizer`` already alive. Required on the CPU unless ``high``.
        low, high: the range of sizes to consider (``high`` None: no upper bound).
        start: the first size to try, typically an estimate's prediction; default ``low``.
        bytes_per_sample: the estimate's peak bytes per sample more: each next size is the
            largest measured peak plus this per sample (else a least-squares line).
        choose: ``"throughput"`` (fastest; among sizes within 2%, the smaller) or ``"max"``.
        steps_per_trial: real steps for the chosen size and each timed one (the first is not
            timed); a size only measured for memory runs one steady step.
        max_trials: trials spent looking for the limit (the choice's full run and the timed
            smaller sizes come on top); reaching it is said in the notes.
        model, optimizer: put back exactly as they were when the search returns.
        on_trial: called after each trial (progress bars).
        budget_applied: the caller already set the OS limit on the CPU (the CLI's child does,
            before the model is built); ``memory_budget`` then only aims the search.
        restore: copy the model's and optimizer's state and put it back at the end (default);
            False in a process that exits after the search (under a limit the copy takes room).

    Returns:
        A :class:`SearchResult` whose choice and maximum both ran for real.

    Raises:
        NoFitError: not even ``low`` fits (a ``UsageError``, so a ``ValueError``).
        ValueError: bad arguments.
        TypeError: a ``memory_budget`` that is not a whole number of bytes.

    Example:
        >>> import torch
        >>> net = torch.nn.Linear(64, 64)
        >>> opt = torch.optim.SGD(net.parameters(), lr=0.1)
        >>> def step(x):
        ...     opt.zero_grad(set_to_none=True)
        ...     net(x).square().mean().backward()
        ...     opt.step()
        >>> result = find_batch_size(step, lambda n: torch.randn(n, 64), high=8,
        ...                          model=net, optimizer=opt, steps_per_trial=2)
        >>> result.max_fitting_micro_batch, result.micro_batch_size in (1, 2, 4, 8)
        (8, True)
    """
    memory_budget = _checked_budget(memory_budget)
    dev, first = _check_arguments(device, memory_budget, low, high, start, choose, steps_per_trial)
    watch = _watch(dev, memory_budget, model, optimizer, budget_applied)
    search = Search(
        step_fn, make_batch, watch, low, high, bytes_per_sample, steps_per_trial, max_trials
    )
    search.on_trial = on_trial
    with _restored(model, optimizer, restore), watch:
        result = search.result(first, choose, memory_budget)
    return _with_batchnorm_note(result, model)


def _watch(
    device: torch.device,
    memory_budget: int | None,
    model: torch.nn.Module | None,
    optimizer: Any | None,
    budget_applied: bool,
) -> MemoryWatch:
    """The search's memory watch: the budget applied, the peaks measured."""
    return MemoryWatch(
        device, memory_budget, model=model, optimizer=optimizer, budget_applied=budget_applied
    )


@contextlib.contextmanager
def _restored(
    model: torch.nn.Module | None, optimizer: Any | None, restore: bool
) -> Iterator[None]:
    """Put back what the search changed (when ``restore``), then give memory back."""
    state = SavedState(model if restore else None, optimizer if restore else None)
    try:
        yield
    finally:
        state.restore()
        release_memory()


def _with_batchnorm_note(result: SearchResult, model: torch.nn.Module | None) -> SearchResult:
    """The result, with a note when a BatchNorm model's chosen micro-batch is small."""
    batchnorm = batchnorm_warning(result.micro_batch_size)
    if batchnorm and model is not None and has_batchnorm(model):
        return replace(result, notes=(*result.notes, batchnorm))
    return result


def _check_arguments(
    device: str | torch.device,
    memory_budget: int | None,
    low: int,
    high: int | None,
    start: int | None,
    choose: str,
    steps_per_trial: int,
) -> tuple[torch.device, int]:
    """The device to search on and the first size, once the arguments are known to be usable."""
    if low < 1 or (high is not None and high < low):
        raise ValueError(f"need 1 <= low <= high, got low={low}, high={high}")
    if steps_per_trial < 2:
        raise ValueError("steps_per_trial must be at least 2: the first step is not timed")
    if choose not in ("throughput", "max"):
        raise ValueError(f"choose must be 'throughput' or 'max', got {choose!r}")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "device 'cuda': no CUDA device is visible (use device='cpu' with a memory_budget)"
        )
    if dev.type == "cpu" and memory_budget is None and high is None:
        raise ValueError("on the CPU give memory_budget (an OS limit is set) or a high bound")
    return dev, max(low, min(start or low, high or start or low))


def _checked_budget(budget: object) -> int | None:
    """``memory_budget`` as an ``int`` of bytes, refused up front when it cannot be one."""
    if budget is None:
        return None
    if isinstance(budget, bool) or not isinstance(budget, numbers.Integral):
        raise TypeError(
            f"memory_budget must be a whole number of bytes, got {budget!r}: "
            "give an int, e.g. memory_budget=16 * 2**30 for 16 GiB"
        )
    value = int(budget)
    if not 0 < value < _MAX_BUDGET_BYTES:
        raise ValueError(
            f"memory_budget must be between 1 and 2**62 bytes, got {value}: "
            "give the bytes the training state may take, e.g. 16 * 2**30 for 16 GiB"
        )
    return value
