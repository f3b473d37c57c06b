"""The search's order: the limit from ``start``, the choice confirmed in a full trial, the
throughput rule; and what a search puts back (:class:`SavedState`)."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any

import torch

from batchfit._memwatch import MemoryWatch
from batchfit._rng import RngState
from batchfit._units import human_bytes
from batchfit.errors import NoFitError
from batchfit.search._fitline import next_size
from batchfit.search._trialrun import TrialRun
from batchfit.search._trials import PLATEAU, Choose, SearchResult, Trial


class SavedState:
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


class Search:
    """One search: its watch, the trials so far, and the bracket they give.

    ``lo`` is the largest size that fitted (0: none yet), ``hi`` the smallest that failed
    (None: none yet, or ``high + 1``). ``clock`` times the steps (a test injects its own).
    """

    def __init__(
        self,
        step_fn: Callable[[Any], Any],
        make_batch: Callable[[int], Any],
        watch: MemoryWatch,
        low: int,
        high: int | None,
        bytes_per_sample: int | None,
        steps_per_trial: int,
        max_trials: int,
        *,
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
        return self.confirm(plateau_choice(self.trials))


def plateau_choice(trials: list[Trial]) -> int:
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
