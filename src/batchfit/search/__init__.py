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

Here: the arguments, the search's order (:class:`_Search`) and the throughput rule. The next
size's arithmetic is in ``_fitline.py``; one trial's steps (a batch of another size than
asked refused, an OOM caught, peak and speed measured) in ``_trialrun.py``.
"""

from __future__ import annotations

import copy
import numbers
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch

from batchfit._batchnorm import batchnorm_warning, has_batchnorm
from batchfit._display import html
from batchfit._memwatch import MemoryWatch
from batchfit._oom import release_memory
from batchfit._rng import RngState
from batchfit._units import human_bytes
from batchfit.errors import NoFitError
from batchfit.search._fitline import next_size
from batchfit.search._trialrun import TrialRun

Choose = Literal["throughput", "max"]
# Sizes whose throughput is within this fraction of the best count as equally fast.
PLATEAU = 0.02
# Budgets from 1 byte to 4 EiB, beyond any machine: the CPU's OS limit (what the process holds
# plus the budget) must stay a 64-bit count.
_MAX_BUDGET_BYTES = 2**62


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

    def _repr_html_(self) -> str:
        """Jupyter's view: the trials, the choice, the notes."""
        return html("probe", self.to_json())

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

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Trial:
        """The trial of :meth:`to_json` (results cross the probe's process boundary as JSON)."""
        return cls(
            micro_batch_size=int(data["micro_batch_size"]),
            ok=bool(data["ok"]),
            peak_bytes=data["peak_bytes"],
            samples_per_s=data["samples_per_s"],
            seconds=float(data["seconds"]),
            steps=int(data["steps"]),
            error=data.get("error"),
        )


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

    def _repr_html_(self) -> str:
        """Jupyter's view: the trials, the choice, the notes."""
        return html("probe", self.to_json())

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

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SearchResult:
        """The result of :meth:`to_json`; ``steps_run`` and ``ooms`` follow from the trials."""
        return cls(
            micro_batch_size=int(data["micro_batch_size"]),
            max_fitting_micro_batch=int(data["max_fitting_micro_batch"]),
            trials=tuple(Trial.from_json(t) for t in data["trials"]),
            seconds=float(data["seconds"]),
            choose=str(data["choose"]),
            budget_bytes=data.get("budget_bytes"),
            notes=tuple(data.get("notes", ())),
        )


class _State:
    """What a probe changes and must put back: weights, optimizer, grads, mode, RNG."""

    def __init__(self, model: torch.nn.Module | None, optimizer: Any | None) -> None:
        self.model, self.optimizer = model, optimizer
        self.weights = copy.deepcopy(model.state_dict()) if model is not None else None
        self.opt_state = copy.deepcopy(optimizer.state_dict()) if optimizer is not None else None
        self.training = model.training if model is not None else None
        self.rng = RngState.capture()

    def restore(self) -> None:
        if self.model is not None and self.weights is not None:
            self.model.load_state_dict(self.weights)
            self.model.zero_grad(set_to_none=True)
            self.model.train(bool(self.training))
        if self.optimizer is not None and self.opt_state is not None:
            self.optimizer.load_state_dict(self.opt_state)
        self.rng.restore()


class _Search:
    """One search: its watch, the trials so far, and the bracket they give.

    ``lo`` is the largest size that fitted (0: none yet), ``hi`` the smallest that failed
    (None: none yet, or ``high + 1``). ``clock`` times the steps (a test injects its own).
    """

    def __init__(
        self,
        step_fn: Callable[[Any], Any],
        make_batch: Callable[[int], Any],
        watch: MemoryWatch,
        *,
        low: int,
        high: int | None,
        bytes_per_sample: int | None,
        steps_per_trial: int,
        max_trials: int,
        on_trial: Callable[[Trial], None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.step_fn, self.make_batch, self.watch = step_fn, make_batch, watch
        self.low, self.per_sample = low, bytes_per_sample
        self.steps_per_trial, self.max_trials = steps_per_trial, max_trials
        self.on_trial, self.clock = on_trial, clock
        self.trials: list[Trial] = []
        self.notes: list[str] = []
        self.lo, self.hi = 0, (high + 1 if high is not None else None)
        self.settled = False  # a step has run, so lazily created state (optimizer) exists
        self.begin = clock()

    def result(self, start: int, choose: Choose, budget: int | None) -> SearchResult:
        """Search from ``start``: the limit, then the choice, each confirmed in a full trial."""
        self.settle(self.find_limit(start), budget)
        choice = self.confirm(self.lo)
        if choose == "throughput":
            choice = self.fastest(choice)
        return SearchResult(
            choice,
            max(t.micro_batch_size for t in self.trials if t.ok),
            tuple(self.trials),
            self.clock() - self.begin,
            choose,
            budget,
            tuple(self.notes),
        )

    # --- running and recording sizes -------------------------------------------------------
    def run(self, n: int, k: int) -> TrialRun:
        """Run ``k`` steps of size ``n`` (not yet recorded: the run may be extended)."""
        run = TrialRun(n, self.watch, self.clock)
        run.steps(self.step_fn, self.make_batch, k)
        return run

    def record(self, run: TrialRun) -> None:
        peak = run.peak if run.ok else None
        trial = Trial(run.n, run.ok, peak, run.samples_per_s(), run.seconds(), run.done, run.error)
        self.trials.append(trial)
        if self.on_trial is not None:
            self.on_trial(self.trials[-1])

    def measure(self, n: int) -> TrialRun:
        """A size's memory, in one steady step (two for the first size that fits)."""
        run = self.run(n, 1 if self.settled else 2)
        self.settled = self.settled or run.ok
        if run.ok:
            self.lo = max(self.lo, n)
        else:
            self.hi = n if self.hi is None else min(self.hi, n)
        return run

    # --- the limit -------------------------------------------------------------------------
    def next_size(self, last: TrialRun) -> int | None:
        """The size after ``last`` that all ranks agree on; None: the limit is found."""
        points = [
            (t.micro_batch_size, t.peak_bytes)
            for t in self.trials
            if t.ok and t.peak_bytes is not None
        ]
        if last.ok and last.peak is not None:
            points.append((last.n, last.peak))
        proposal = next_size(
            points,
            self.lo,
            self.hi,
            self.low,
            self.watch.available_bytes,
            self.per_sample,
            last.ok,
        )
        n = self.watch.agree_size(proposal)
        if n is None or n == last.n or any(t.micro_batch_size == n for t in self.trials):
            return None
        return n

    def find_limit(self, start: int) -> TrialRun | None:
        """Measure sizes from ``start`` toward the limit; the last run, when not yet recorded.

        None: ``max_trials`` ended the search (every run recorded)."""
        run: TrialRun | None = None
        n = start
        while len(self.trials) < self.max_trials:
            run = self.measure(n)
            following = self.next_size(run)
            if following is None:
                return run
            self.record(run)
            run, n = None, following
        return run

    def settle(self, last: TrialRun | None, budget: int | None) -> None:
        """Raise when nothing fitted; else give the largest size that fitted its full trial.

        The last run is extended when it is that size; otherwise that size runs again (after
        the last OOM) when the choice is confirmed."""
        if self.lo == 0:
            if last is not None:
                self.record(last)
            raise self.no_fit(budget)
        if last is None:
            untried = (
                f"between {self.lo} and {self.hi}" if self.hi is not None else f"above {self.lo}"
            )
            self.notes.append(
                f"stopped after max_trials={self.max_trials} trials: sizes {untried} were not tried"
            )
            return
        if last.ok and last.n == self.lo:
            last.steps(self.step_fn, self.make_batch, self.steps_per_trial - last.done)
        self.record(last)

    def no_fit(self, budget: int | None) -> NoFitError:
        where = f" in {human_bytes(budget)}" if budget else ""
        smallest = min(t.micro_batch_size for t in self.trials)
        if smallest > self.low:
            return NoFitError(
                f"no size fitted{where} in {len(self.trials)} trials (the smallest tried: "
                f"{smallest}); start lower"
            )
        return NoFitError(f"even a micro-batch of {self.low} does not fit{where}")

    # --- the choice ------------------------------------------------------------------------
    def confirm(self, choice: int) -> int:
        """Run the choice again unless it ran ``steps_per_trial`` steps after the last OOM."""
        while not self.confirmed(choice):
            run = self.run(choice, self.steps_per_trial)
            self.record(run)
            if run.ok:
                break
            smaller = [
                t.micro_batch_size for t in self.trials if t.ok and t.micro_batch_size < choice
            ]
            self.notes.append(f"{choice} failed when run again (fragmentation); fell back")
            if not smaller:
                raise NoFitError(f"the chosen micro-batch {choice} no longer fits when run again")
            choice = max(smaller)
        return choice

    def confirmed(self, choice: int) -> bool:
        for t in reversed(self.trials):
            if not t.ok:
                return False
            if t.micro_batch_size == choice and t.steps >= self.steps_per_trial:
                return True
        return False

    def fastest(self, largest: int) -> int:
        """Time halved sizes below ``largest`` while they stay within ``PLATEAU`` of the best;
        the smallest of the equally fast, confirmed."""
        n = largest // 2
        while n >= 1 and not any(t.micro_batch_size == n and t.samples_per_s for t in self.trials):
            run = self.run(n, self.steps_per_trial)
            self.record(run)
            best = max(t.samples_per_s or 0.0 for t in self.trials if t.ok)
            if not run.ok or (self.trials[-1].samples_per_s or 0.0) < (1 - PLATEAU) * best:
                break
            n //= 2
        return self.confirm(_plateau_choice(self.trials))


def _plateau_choice(trials: list[Trial]) -> int:
    """The smallest size within ``PLATEAU`` of the fastest (the largest when none was timed)."""
    ok = [t for t in trials if t.ok]
    timed = [t for t in ok if t.samples_per_s]
    if not timed:
        return max(t.micro_batch_size for t in ok)
    best: dict[int, float] = {}
    for t in timed:  # a size run twice keeps its better measurement
        best[t.micro_batch_size] = max(best.get(t.micro_batch_size, 0.0), t.samples_per_s or 0.0)
    top = max(best.values())
    return min(n for n, speed in best.items() if speed >= (1 - PLATEAU) * top)


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
        step_fn: runs one full training step on a batch (forward, backward, optimizer step),
            written as your training loop writes it: whether it keeps the model's outputs
            through ``backward()`` (a hand loop's ``out = model(**batch); out.loss.backward()``)
            or only the loss (HF Trainer, Lightning: ``loss = model(**batch).loss``) changes
            the peak by one logits tensor (``--loop keep-outputs`` / ``trainer`` in the CLI,
            ``TrainingSetup.loop`` for the estimate you pass as ``start``).
        make_batch: returns a batch of exactly the given number of samples, along dim 0 of
            each tensor (a list: its length); a batch of another size (a dataset shorter than
            the size asked) is refused, never reported.
        device: where the steps run (``"cpu"`` or ``"cuda[:i]"``).
        memory_budget: bytes the training state may take (weights, gradients, optimizer state,
            activations, workspaces). On CUDA it becomes the process's memory fraction; on the
            CPU an OS data-segment limit (``RLIMIT_DATA``): what the process holds now plus the
            budget, minus the bytes of ``model`` and ``optimizer`` already alive. Required on
            the CPU (else the search could exhaust the machine) unless ``high`` bounds it.
        low, high: the range of sizes to consider (``high`` None: no upper bound).
        start: the first size to try, typically an estimate's prediction; default ``low``.
        bytes_per_sample: the estimate's peak memory per sample more: each next size is the
            largest measured peak plus this per sample (without it, a least-squares line
            through the measured peaks).
        choose: ``"throughput"`` (fastest; among sizes within 2%, the smaller) or ``"max"``.
        steps_per_trial: real steps for the chosen size and each timed one (the first is not
            timed); a size only measured for memory runs one steady step.
        max_trials: trials spent looking for the limit; the full run of the choice and the
            timing of smaller sizes come on top. Reaching it is said in the notes.
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
        NoFitError: not even ``low`` fits (a ``UsageError``, so a ``ValueError``), on every
            device.
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
    dev = _check_arguments(device, memory_budget, low, high, choose, steps_per_trial)
    watch = MemoryWatch(
        dev, memory_budget, model=model, optimizer=optimizer, budget_applied=budget_applied
    )
    search = _Search(
        step_fn,
        make_batch,
        watch,
        low=low,
        high=high,
        bytes_per_sample=bytes_per_sample,
        steps_per_trial=steps_per_trial,
        max_trials=max_trials,
        on_trial=on_trial,
    )
    state = _State(model if restore else None, optimizer if restore else None)
    try:
        with watch:
            first = max(low, min(start or low, high or start or low))
            result = search.result(first, choose, memory_budget)
    finally:
        state.restore()
        release_memory()
    batchnorm = batchnorm_warning(result.micro_batch_size)
    if batchnorm and model is not None and has_batchnorm(model):
        result = replace(result, notes=(*result.notes, batchnorm))
    return result


def _check_arguments(
    device: str | torch.device,
    memory_budget: int | None,
    low: int,
    high: int | None,
    choose: str,
    steps_per_trial: int,
) -> torch.device:
    """The device to search on, once the arguments are known to be usable."""
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
    return dev


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
