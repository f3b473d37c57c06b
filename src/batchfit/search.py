"""Probe: the fastest micro-batch on the real device, in a few real steps.

Every size it reports ran for real. It starts near the limit the estimators predict and
measures each size's peak memory in one steady step (two for the first size that fits: its
first step may allocate the optimizer state). The next size comes from the measured peaks,
affine in the micro-batch (the largest measured peak plus the estimate's bytes per sample for
each sample more; least squares without an estimate), and the search stops when that says one
sample more would not fit. The largest size that
fitted then runs ``steps_per_trial`` steps in a row, the last trial extended or, after an
out-of-memory error, run again; the choice is run again only if an out-of-memory error came
after its last full trial, so it is confirmed in the state the search leaves. Only steps
after a trial's first are timed. ``choose="throughput"`` also times halved sizes while they
stay within 2% of the best and takes the smallest of the equally fast. Model, optimizer,
gradients and RNG states are put back in ``finally``.
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
from batchfit._units import human_bytes

Choose = Literal["throughput", "max"]
# Sizes whose throughput is within this fraction of the best count as equally fast.
PLATEAU = 0.02
# Aim this far below the limit on a one-point guess without an estimate: it rests on one
# measurement and an assumed slope.
MARGIN = 0.05
# And this far below it on a trusted fit: the measured peak is resident memory (CPU) or
# allocated memory (CUDA), while the limit counts address space or reserved blocks.
FIT_MARGIN = 0.01
# Without an estimate's bytes per sample, a trial goes at most this many times beyond the
# largest size that fitted.
GROWTH = 4


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


def _fit_limit(
    points: list[tuple[int, int]], available: int, per_sample: int | None
) -> tuple[int, bool] | None:
    """Largest size whose fitted peak stays within ``available`` bytes, and whether to trust it.

    With the estimator's bytes per sample (``per_sample``): the measured peak of the largest
    size that fitted plus ``per_sample`` for each sample more (near the limit the measured
    offset matters, and a slope fitted through close sizes is mostly noise). Without: least
    squares through two or more sizes; through one, the peak taken as proportional to the size
    (an overestimate of the slope) less ``MARGIN``, a guess not trusted to say that the next
    size would fail. Aimed ``FIT_MARGIN`` below the limit: an overshoot costs one
    out-of-memory trial, after which the bracket is bisected.
    """
    if not points:
        return None
    room = available * (1 - FIT_MARGIN)
    if per_sample:
        n, peak = max(points)
        return n + math.floor((room - peak) / per_sample), True
    if len(points) == 1:
        n, peak = points[0]
        return (math.floor(available * (1 - MARGIN) * n / peak), False) if peak > 0 else None
    xs = [float(n) for n, _ in points]
    ys = [float(p) for _, p in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    if var == 0:
        return None
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var
    if slope <= 0:
        return None
    return math.floor((room - (my - slope * mx)) / slope), True


class _Run:
    """A trial being run: steps can be added to it until it is recorded."""

    def __init__(self, n: int, watch: MemoryWatch) -> None:
        self.n, self.watch = n, watch
        self.begin = time.perf_counter()
        self.timed: list[float] = []
        self.done = 0
        self.peak: int | None = None
        self.error: str | None = None
        watch.reset_peak()

    @property
    def ok(self) -> bool:
        return self.error is None

    def steps(
        self, step_fn: Callable[[Any], Any], make_batch: Callable[[int], Any], k: int
    ) -> None:
        """Run ``k`` more steps; every step after the trial's first is timed."""
        error: str | None = None
        try:
            for _ in range(k):
                batch = make_batch(self.n)
                t0 = time.perf_counter()
                step_fn(batch)
                self.watch.synchronize()
                if self.done > 0:
                    self.timed.append(time.perf_counter() - t0)
                self.done += 1
                del batch
        except Exception as e:  # re-raised below unless it is an out-of-memory error
            if not is_oom(e):
                raise
            error = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        # Outside the except block: its traceback no longer holds the failed step's tensors.
        if not self.watch.agree(error is None):
            self.error = error or "out of memory on another rank"
            self.watch.drop_gradients()
            release_memory()
            return
        self.peak = self.watch.peak_bytes()

    def trial(self) -> Trial:
        speed = None
        if self.ok and self.timed and sum(self.timed) > 0:
            speed = self.watch.agree_speed(self.n * len(self.timed) / sum(self.timed))
        return Trial(
            self.n,
            self.ok,
            self.peak if self.ok else None,
            speed,
            time.perf_counter() - self.begin,
            self.done,
            self.error,
        )


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

    def record(run: _Run) -> None:
        trials.append(run.trial())
        if on_trial is not None:
            on_trial(trials[-1])

    try:
        with watch:
            lo, hi = 0, (high + 1) if high is not None else None  # fits <= lo < hi fails
            n = max(low, min(start or low, high or start or low))
            run: _Run | None = None
            settled = False  # a step has run, so lazily created state (optimizer) exists
            exhausted = False  # max_trials ended the search
            while len(trials) < max_trials:
                # A size's memory needs one steady step: two for the first size that fits.
                run = _Run(n, watch)
                run.steps(step_fn, make_batch, 1 if settled else 2)
                settled = settled or run.ok
                if run.ok:
                    lo = max(lo, n)
                else:
                    hi = n if hi is None else min(hi, n)
                points = [
                    (t.micro_batch_size, t.peak_bytes)
                    for t in trials
                    if t.ok and t.peak_bytes is not None
                ]
                if run.ok and run.peak is not None:
                    points.append((n, run.peak))
                proposal = _next_size(
                    points, lo, hi, low, watch.available_bytes, bytes_per_sample, run.ok
                )
                n_next = watch.agree_size(proposal)
                if (
                    n_next is None
                    or n_next == n
                    or any(t.micro_batch_size == n_next for t in trials)
                ):
                    break
                record(run)
                run = None
                n = n_next
            else:
                exhausted = True
            if lo == 0:
                if run is not None:
                    record(run)
                where = f" in {human_bytes(memory_budget)}" if memory_budget else ""
                if min(t.micro_batch_size for t in trials) > low:
                    raise ValueError(
                        f"no size fitted{where} in {len(trials)} trials (the smallest tried: "
                        f"{min(t.micro_batch_size for t in trials)}); start lower"
                    )
                raise ValueError(f"even a micro-batch of {low} does not fit{where}")
            if exhausted:
                untried = f"between {lo} and {hi}" if hi is not None else f"above {lo}"
                notes.append(
                    f"stopped after max_trials={max_trials} trials: sizes {untried} were not tried"
                )
            # The largest size that fitted runs for steps_per_trial steps: the last trial is
            # extended when it is that size, else it is run again (after the last OOM).
            if run is not None and run.ok and run.n == lo:
                run.steps(step_fn, make_batch, steps_per_trial - run.done)
            if run is not None:
                record(run)
            confirm = (record, step_fn, make_batch, steps_per_trial, watch, notes)
            choice = _confirm(lo, trials, *confirm)
            if choose == "throughput":
                _time_smaller(choice, trials, *confirm[:-1])
                choice = _confirm(_choose(trials, choose), trials, *confirm)
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
    points: list[tuple[int, int]],
    lo: int,
    hi: int | None,
    low: int,
    available: int | None,
    per_sample: int | None,
    last_ok: bool,
) -> int | None:
    """Aim at the fitted limit, inside the bracket (lo fits, hi fails); None: stop."""
    if hi is not None and hi <= lo + 1:
        return None
    fit = _fit_limit(points, available, per_sample) if available else None
    if lo == 0:  # nothing fitted yet: halve below the smallest failure
        guess = max(low, (hi or 2 * low) // 2)
        return guess if guess < (hi or guess + 1) else None
    if fit is None:
        guess = lo * 2 if hi is None else (lo + hi) // 2  # no usable fit: double / bisect
    else:
        guess, trusted = fit
        if guess <= lo:
            if trusted:
                return None  # the fit says the next size would not fit
            guess = lo + 1  # an untrusted guess: one size more gives a second point
    if per_sample is None:
        # without an estimate, peaks measured at close sizes can fit an almost flat line:
        # never extrapolate it further than GROWTH times the largest size that ran
        guess = min(guess, GROWTH * lo)
    if hi is not None:
        guess = min(guess, hi - 1)
        if not last_ok:
            # Just failed: the fit overshot, so step at most halfway into the bracket.
            guess = min(guess, max(lo + 1, (lo + hi) // 2))
    return guess if guess > lo else None


def _time_smaller(
    largest: int,
    trials: list[Trial],
    record: Callable[[_Run], None],
    step_fn: Callable[[Any], Any],
    make_batch: Callable[[int], Any],
    steps: int,
    watch: MemoryWatch,
) -> None:
    """Time halved sizes below the largest while they stay within ``PLATEAU`` of the best."""
    n = largest // 2
    while n >= 1 and not any(t.micro_batch_size == n and t.samples_per_s for t in trials):
        run = _Run(n, watch)
        run.steps(step_fn, make_batch, steps)
        record(run)
        best = max(t.samples_per_s or 0.0 for t in trials if t.ok)
        if not run.ok or (trials[-1].samples_per_s or 0.0) < (1 - PLATEAU) * best:
            return
        n //= 2


def _choose(trials: list[Trial], choose: Choose) -> int:
    """The largest size, or the fastest among those timed (then run in full if it was not)."""
    ok = [t for t in trials if t.ok]
    timed = [t for t in ok if t.samples_per_s]
    if choose == "max" or not timed:
        return max(t.micro_batch_size for t in ok)
    best: dict[int, float] = {}
    for t in timed:  # a size run twice keeps its better measurement
        best[t.micro_batch_size] = max(best.get(t.micro_batch_size, 0.0), t.samples_per_s or 0.0)
    top = max(best.values())
    return min(n for n, speed in best.items() if speed >= (1 - PLATEAU) * top)


def _confirm(
    choice: int,
    trials: list[Trial],
    record: Callable[[_Run], None],
    step_fn: Callable[[Any], Any],
    make_batch: Callable[[int], Any],
    steps: int,
    watch: MemoryWatch,
    notes: list[str],
) -> int:
    """Run the choice again unless it ran ``steps`` steps after the last OOM."""

    def confirmed() -> bool:
        for t in reversed(trials):
            if not t.ok:
                return False
            if t.micro_batch_size == choice and t.steps >= steps:
                return True
        return False

    while not confirmed():
        run = _Run(choice, watch)
        run.steps(step_fn, make_batch, steps)
        record(run)
        if run.ok:
            break
        smaller = [t.micro_batch_size for t in trials if t.ok and t.micro_batch_size < choice]
        notes.append(f"{choice} failed when run again (fragmentation); fell back")
        if not smaller:
            raise ValueError(f"the chosen micro-batch {choice} no longer fits when run again")
        choice = max(smaller)
    return choice
