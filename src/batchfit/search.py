"""Probe: the fastest micro-batch on the real device, in a few real steps.

Every size it reports ran for real. It starts near the limit the estimators predict, fits the
measured peak memory of each trial (affine in the micro-batch) to aim the next one, times only
steady-state steps (not a trial's first, which may allocate optimizer state), and chooses by
throughput: the fastest size, or among sizes within 2% of it, the smaller. The answer is run
again after the last out-of-memory error, so it is confirmed in the state the search leaves.
Model, optimizer, gradients and RNG states are put back in ``finally``.
"""

from __future__ import annotations

import copy
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from batchfit._memwatch import MemoryWatch
from batchfit._oom import is_oom, release_memory

Choose = Literal["throughput", "max"]
# Sizes whose throughput is within this fraction of the best count as equally fast.
PLATEAU = 0.02
# Aim this far below the fitted limit: the fit comes from few points, and fragmentation grows.
MARGIN = 0.05


@dataclass(frozen=True)
class Trial:
    """One size that was run: whether it fitted, its peak memory and its speed."""

    micro_batch_size: int
    ok: bool
    peak_bytes: int | None
    samples_per_s: float | None
    seconds: float
    steps: int
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "micro_batch_size": self.micro_batch_size,
            "ok": self.ok,
            "peak_bytes": self.peak_bytes,
            "samples_per_s": self.samples_per_s,
            "seconds": self.seconds,
            "steps": self.steps,
            "error": self.error,
        }


@dataclass(frozen=True)
class SearchResult:
    """The choice, the largest size that fitted, and every trial, in order."""

    micro_batch_size: int
    max_fitting_micro_batch: int
    trials: tuple[Trial, ...]
    seconds: float
    choose: str
    budget_bytes: int | None = None
    notes: tuple[str, ...] = field(default=())

    @property
    def steps_run(self) -> int:
        return sum(t.steps for t in self.trials)

    @property
    def ooms(self) -> int:
        return sum(not t.ok for t in self.trials)

    def to_json(self) -> dict[str, Any]:
        return {
            "micro_batch_size": self.micro_batch_size,
            "max_fitting_micro_batch": self.max_fitting_micro_batch,
            "trials": [t.to_json() for t in self.trials],
            "seconds": self.seconds,
            "choose": self.choose,
            "budget_bytes": self.budget_bytes,
            "steps_run": self.steps_run,
            "ooms": self.ooms,
            "notes": list(self.notes),
        }


class _State:
    """What a probe changes and must put back: weights, optimizer, grads, mode, RNG."""

    def __init__(self, model: torch.nn.Module | None, optimizer: Any | None) -> None:
        self.model, self.optimizer = model, optimizer
        self.weights = copy.deepcopy(model.state_dict()) if model is not None else None
        self.opt_state = copy.deepcopy(optimizer.state_dict()) if optimizer is not None else None
        self.training = model.training if model is not None else None
        self.rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        self.py_rng = random.getstate()

    def restore(self) -> None:
        if self.model is not None and self.weights is not None:
            self.model.load_state_dict(self.weights)
            self.model.zero_grad(set_to_none=True)
            self.model.train(bool(self.training))
        if self.optimizer is not None and self.opt_state is not None:
            self.optimizer.load_state_dict(self.opt_state)
        torch.set_rng_state(self.rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        random.setstate(self.py_rng)


def _fit_limit(points: list[tuple[int, int]], available: int) -> int | None:
    """Largest size whose fitted peak stays within ``available`` bytes.

    Least squares over the sizes that fitted, aimed at the limit itself: an overshoot costs one
    out-of-memory trial, after which the bracket is bisected. With one point the peak is taken
    as proportional to the size (an overestimate of the slope) and ``MARGIN`` is kept, as the
    guess rests on a single measurement.
    """
    if not points:
        return None
    if len(points) == 1:
        n, peak = points[0]
        return math.floor(available * (1 - MARGIN) * n / peak) if peak > 0 else None
    xs = [float(n) for n, _ in points]
    ys = [float(p) for _, p in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    if var == 0:
        return None
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var
    if slope <= 0:
        return None
    return math.floor((available - (my - slope * mx)) / slope)


def find_batch_size(
    step_fn: Callable[[Any], Any],
    make_batch: Callable[[int], Any],
    *,
    device: str | torch.device = "cpu",
    memory_budget: int | None = None,
    low: int = 1,
    high: int | None = None,
    start: int | None = None,
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
        step_fn: runs one full training step on a batch (forward, backward, optimizer step).
        make_batch: returns a batch of the given number of samples.
        device: where the steps run (``"cpu"`` or ``"cuda[:i]"``).
        memory_budget: bytes the training state may take (weights, gradients, optimizer state,
            activations, workspaces). On CUDA it becomes the process's memory fraction; on the
            CPU an OS data-segment limit (``RLIMIT_DATA``): what the process holds now plus the
            budget, minus the bytes of ``model`` and ``optimizer`` already alive. Required on
            the CPU (else the search could exhaust the machine) unless ``high`` bounds it.
        low, high: the range of sizes to consider (``high`` None: no upper bound).
        start: the first size to try, typically an estimate's prediction; default ``low``.
        choose: ``"throughput"`` (fastest; among sizes within 2%, the smaller) or ``"max"``.
        steps_per_trial: real steps per size; the first is not timed.
        model, optimizer: put back exactly as they were when the search returns.
        on_trial: called after each trial (progress bars).
        budget_applied: the caller already set the OS limit on the CPU (the CLI's child process
            does, before the model is built); ``memory_budget`` then only aims the search.
        restore: keep a copy of the model's and optimizer's state and put it back at the end
            (the default). A process that exits after the search passes False: under a memory
            limit the copy would take room the trials need.

    Returns:
        A :class:`SearchResult` whose choice and maximum both ran for real.

    Raises:
        ValueError: bad arguments, or not even ``low`` fits.

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
    begin = time.perf_counter()
    state = _State(model if restore else None, optimizer if restore else None)
    watch = MemoryWatch(
        dev, memory_budget, model=model, optimizer=optimizer, budget_applied=budget_applied
    )
    trials: list[Trial] = []
    notes: list[str] = []
    try:
        with watch:
            lo, hi = 0, (high + 1) if high is not None else None  # fits <= lo < hi fails
            n = max(low, min(start or low, high or start or low))
            while len(trials) < max_trials:
                trial = _run_trial(step_fn, make_batch, n, steps_per_trial, watch)
                trials.append(trial)
                if on_trial is not None:
                    on_trial(trial)
                if trial.ok:
                    lo = max(lo, n)
                else:
                    hi = n if hi is None else min(hi, n)
                n_next = watch.agree_size(_next_size(trials, lo, hi, low, watch.available_bytes))
                if n_next is None or any(t.micro_batch_size == n_next for t in trials):
                    break
                n = n_next
            if lo == 0:
                raise ValueError(
                    f"even a micro-batch of {low} does not fit"
                    + (f" in {memory_budget / 2**30:.2f} GiB" if memory_budget else "")
                )
            choice = _choose(trials, choose)
            choice = _confirm(choice, trials, step_fn, make_batch, steps_per_trial, watch, notes)
        max_fit = max(t.micro_batch_size for t in trials if t.ok)
        return SearchResult(
            choice,
            max_fit,
            tuple(trials),
            time.perf_counter() - begin,
            choose,
            memory_budget,
            tuple(notes),
        )
    finally:
        state.restore()
        release_memory()


def _next_size(
    trials: list[Trial], lo: int, hi: int | None, low: int, available: int | None
) -> int | None:
    """Aim at the fitted limit, inside the bracket (lo fits, hi fails)."""
    if hi is not None and hi <= lo + 1:
        return None
    points = [
        (t.micro_batch_size, t.peak_bytes) for t in trials if t.ok and t.peak_bytes is not None
    ]
    guess = _fit_limit(points, available) if available else None
    if guess is None:
        guess = lo * 2 if hi is None else (lo + hi) // 2  # no usable fit: double / bisect
    if lo == 0:  # nothing fitted yet: halve below the smallest failure
        guess = min(guess, max(low, (hi or 2 * low) // 2))
        return guess if guess < (hi or guess + 1) and guess >= low else None
    guess = max(guess, lo + 1)
    if hi is not None:
        guess = min(guess, hi - 1)
        if not trials[-1].ok:
            # Just failed: the fit overshot, so step at most halfway into the bracket.
            guess = min(guess, max(lo + 1, (lo + hi) // 2))
    return guess if guess > lo else None


def _run_trial(
    step_fn: Callable[[Any], Any],
    make_batch: Callable[[int], Any],
    n: int,
    steps: int,
    watch: MemoryWatch,
) -> Trial:
    start = time.perf_counter()
    error: str | None = None
    timed: list[float] = []
    done = 0
    watch.reset_peak()
    try:
        for i in range(steps):
            batch = make_batch(n)
            t0 = time.perf_counter()
            step_fn(batch)
            watch.synchronize()
            if i > 0:
                timed.append(time.perf_counter() - t0)
            done += 1
            del batch
    except Exception as e:  # re-raised below unless it is an out-of-memory error
        if not is_oom(e):
            raise
        error = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
    # Outside the except block: its traceback no longer holds the failed step's tensors.
    ok = watch.agree(error is None)
    if not ok:
        watch.drop_gradients()
        release_memory()
    peak = watch.peak_bytes() if ok else None
    speed = n * len(timed) / sum(timed) if ok and timed and sum(timed) > 0 else None
    if speed is not None:
        speed = watch.agree_speed(speed)
    return Trial(
        n,
        ok,
        peak,
        speed,
        time.perf_counter() - start,
        done,
        None if ok else (error or "out of memory on another rank"),
    )


def _choose(trials: list[Trial], choose: Choose) -> int:
    ok = [t for t in trials if t.ok]
    if choose == "max" or not any(t.samples_per_s for t in ok):
        return max(t.micro_batch_size for t in ok)
    best: dict[int, float] = {}
    for t in ok:  # a size run twice keeps its better measurement
        best[t.micro_batch_size] = max(best.get(t.micro_batch_size, 0.0), t.samples_per_s or 0.0)
    top = max(best.values())
    return min(n for n, speed in best.items() if speed >= (1 - PLATEAU) * top)


def _confirm(
    choice: int,
    trials: list[Trial],
    step_fn: Callable[[Any], Any],
    make_batch: Callable[[int], Any],
    steps: int,
    watch: MemoryWatch,
    notes: list[str],
) -> int:
    """Run the choice again unless it was the last trial: confirmed after the last OOM."""
    while trials[-1].micro_batch_size != choice or not trials[-1].ok:
        trial = _run_trial(step_fn, make_batch, choice, steps, watch)
        trials.append(trial)
        if trial.ok:
            break
        smaller = [t.micro_batch_size for t in trials if t.ok and t.micro_batch_size < choice]
        notes.append(f"{choice} failed when run again (fragmentation); fell back")
        if not smaller:
            raise ValueError(f"the chosen micro-batch {choice} no longer fits when run again")
        choice = max(smaller)
    return choice
