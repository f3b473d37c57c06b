"""``batchfit gpus MODEL``: for every GPU, the fastest option's largest micro-batch and time."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from batchfit.errors import UsageError
from batchfit.hardware import GpuSpec
from batchfit.memory.estimate import interpolated_sizes, usable_engine
from batchfit.memory.fit import fitting_guess, predict
from batchfit.memory.formulas.analytic import resolve_setup
from batchfit.memory.types import MemoryEstimate
from batchfit.models import ModelInfo
from batchfit.plan._ladder import (
    FUSED_ADAMW,
    OFFLOAD_MARGIN,
    OFFLOADS,
    TIME_TOLERANCE,
    Combo,
    apply,
    ladder,
)
from batchfit.plan._max_micro_batch import (
    DEFAULT_HEADROOM_BYTES,
    beyond_reach,
    fits,
    max_micro_batch,
    max_micro_batch_traced,
    search_budget,
)
from batchfit.spec import TrainingSetup
from batchfit.speed import step_time
from batchfit.workload import Workload


@dataclass(frozen=True)
class FitRow:
    """One GPU of ``batchfit gpus MODEL``: the setup ``FIT_RULE`` chose, its largest micro-batch."""

    gpu: GpuSpec
    precision: str
    max_micro_batch: int
    device_total_bytes: int  # at micro-batch max(1, max_micro_batch)
    techniques: Combo
    engine: str = "trace"  # the one that answered: "analytic" where the trace cannot run it
    note: str = ""  # why this GPU cannot run the setup at all (then nothing else is set)
    # the time model at the largest micro-batch, one GPU, the optimizer step spread over a
    # batch of REFERENCE_BATCH_TOKENS (None: not predicted)
    seconds_per_billion_tokens: float | None = None
    choice: str = ""  # which branch of FIT_RULE chose the row's techniques
    # True: the size and its figure come from each peak moment's line through traced sizes 1
    # and 2 (shared by every GPU of one kind), not from a trace at that size
    from_lines: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "gpu": self.gpu.name,
            "gpu_bytes": self.gpu.memory_bytes,
            "precision": self.precision,
            "max_micro_batch": self.max_micro_batch,
            "device_total_bytes": self.device_total_bytes,
            "techniques": [{"name": t.name, "kind": t.kind} for t in self.techniques],
            "engine": self.engine,
            "note": self.note or None,
            "seconds_per_billion_tokens": self.seconds_per_billion_tokens,
            "choice": self.choice or None,
            "from_lines": self.from_lines,
            "rule": FIT_RULE,
        }


def fit_table(
    model: ModelInfo,
    setup: TrainingSetup,
    gpus: list[GpuSpec],
    *,
    seq_len: int,
    headroom_bytes: int = DEFAULT_HEADROOM_BYTES,
    engine: str = "trace",
) -> list[FitRow]:
    """For every GPU: the fastest exact option at its largest micro-batch (``FIT_RULE``).

    The seed guides' "batch size by model & GPU" tables, computed by ``engine`` (the trace
    engine's figures are those ``estimate`` and ``plan`` give for the same setup).
    """
    engine = usable_engine(engine)[0]
    rows: list[FitRow] = []
    errors: list[UsageError] = []
    # a row's size is read from the histories of two traced sizes where they line up, and
    # one setup's dry runs serve every GPU that runs its kernels in its precision
    with interpolated_sizes():
        for gpu in gpus:
            try:
                rows.append(_row(model, setup, gpu, seq_len, headroom_bytes, engine))
            except UsageError as exc:  # this GPU cannot run the setup (torchtune QLoRA, no bf16)
                errors.append(exc)
                rows.append(FitRow(gpu, "-", 0, 0, (), engine, str(exc).split(":")[0]))
    if errors and len(errors) == len(rows):
        raise errors[0]  # the setup itself is wrong, not one GPU
    return rows


# The rule every row follows, stated under the table and in each row's JSON
FIT_RULE = (
    "each row: the fastest exact option by the time model (the setup as given, or with the "
    "ladder's exact rungs) at its largest micro-batch; CPU offload only when predicted "
    f"{OFFLOAD_MARGIN:.0%} faster; rungs that change training only when nothing exact fits"
)
# a micro-batch past any that fits: the time per token there bounds an option's from below
# (utilisation only grows with the micro-batch), so options that cannot win are not searched
# (the trace engine bounds at twice the formulas' size instead: fewer traced searches)
_BOUND_MICRO = 1 << 16


@dataclass(frozen=True)
class _OnGpu:
    """One row's fixed inputs: the model and setup on one GPU; its options timed and sized."""

    model: ModelInfo
    setup: TrainingSetup
    gpu: GpuSpec
    seq_len: int
    headroom_bytes: int
    engine: str
    seen: dict[Combo, tuple[int, int, MemoryEstimate, bool]] = field(default_factory=dict)
    # each (option, micro-batch) estimated once: ranking by the lines and tracing the row's
    # choice read the same sizes 1 and 2 (with --no-cache too)
    estimates: dict[tuple[Combo, int], MemoryEstimate] = field(default_factory=dict)

    def at(self, combo: Combo, micro: int) -> MemoryEstimate:
        """``combo``'s estimate at ``micro`` without accumulation, by the row's engine."""
        if (combo, micro) not in self.estimates:
            setup = apply(self.setup, combo)
            args = (self.model, setup, self.gpu, micro, self.seq_len, 1, self.headroom_bytes)
            self.estimates[combo, micro] = fits(*args, self.engine)[1]
        return self.estimates[combo, micro]

    def largest(self, combo: Combo) -> int:
        """The largest micro-batch of ``combo`` by the row's engine."""
        return self.sized(combo)[0]

    def sized(self, combo: Combo) -> tuple[int, int, MemoryEstimate, bool]:
        """``combo``'s largest micro-batch, the device total there, the estimate at size 1
        (its setup and engine) and whether the size comes from the lines.

        By the trace engine, from each peak moment's line through traced sizes 1 and 2: the
        same two dry runs serve every GPU with the same cuBLAS workspace and precision, where
        a search would trace each GPU's own sizes; by the formulas, searched."""
        if combo not in self.seen:
            self.seen[combo] = self._size(combo)
        return self.seen[combo]

    def traced(self, combo: Combo) -> tuple[int, int, MemoryEstimate, bool]:
        """``sized``, with the lines' answer traced (stepped down while it does not fit,
        ``fitting_guess``): the figure is ``estimate``'s at the size shown, whose next size
        is not traced (True last). The row's choice only: one or two dry runs per GPU."""
        if self.engine != "trace":
            return self.sized(combo)
        budget = search_budget(self.gpu, self.headroom_bytes)
        guess = fitting_guess(lambda m: self.at(combo, m), budget)
        if guess is None or guess.estimate is None:
            return self.sized(combo)
        size, est = guess.micro_batch_size, guess.estimate
        return size, est.device_total_bytes, est, size > 0

    def _size(self, combo: Combo) -> tuple[int, int, MemoryEstimate, bool]:
        args = (self.model, apply(self.setup, combo), self.gpu)
        if self.engine == "trace":  # a row where nothing fits traces its choice (_row)
            beyond = beyond_reach(*args, self.seq_len, 1, self.headroom_bytes)
            if beyond is not None:
                return 0, beyond.device_total_bytes, beyond, False
        one = self.at(combo, 1)
        if self.engine == "trace":
            budget = search_budget(self.gpu, self.headroom_bytes)
            lines = predict(one, self.at(combo, 2), budget)
            if lines is not None:
                return lines[0], lines[1], one, lines[0] > 0
            best = max_micro_batch_traced(*args, self.seq_len, None, self.headroom_bytes)
        else:
            best = max_micro_batch(*args, self.seq_len, None, self.headroom_bytes)
        return best, self.at(combo, max(best, 1)).device_total_bytes, one, False

    def per_billion(self, combo: Combo, micro: int) -> float:
        """Seconds per 1B tokens at ``micro``, offload penalised by ``OFFLOAD_MARGIN``."""
        try:
            resolved = resolve_setup(self.model, apply(self.setup, combo), "cuda", self.gpu)
        except UsageError:
            return float("inf")  # a rung this model cannot take
        seconds = _per_billion(self.model, resolved, self.gpu, micro, self.seq_len)
        penalty = 1 + OFFLOAD_MARGIN if any(t.name in OFFLOADS for t in combo) else 1.0
        return float("inf") if seconds is None else seconds * penalty

    def bound(self, combo: Combo) -> float:
        """A time ``combo`` cannot beat at any micro-batch that fits."""
        if self.engine != "trace":
            return self.per_billion(combo, _BOUND_MICRO)
        # the formulas' largest micro-batch, doubled: the two engines' sizes differ by far
        # less than 2x (tests/test_plan_estimate_agree.py), so a time there bounds the trace's
        try:
            setup = apply(self.setup, combo)
            micro = max_micro_batch(
                self.model, setup, self.gpu, self.seq_len, None, self.headroom_bytes
            )
        except UsageError:
            return self.per_billion(combo, _BOUND_MICRO)
        return self.per_billion(combo, max(2 * micro, 2))


def _row(
    model: ModelInfo,
    setup: TrainingSetup,
    gpu: GpuSpec,
    seq_len: int,
    headroom_bytes: int,
    engine: str,
) -> FitRow:
    """One GPU's row by ``FIT_RULE``."""
    row = _OnGpu(model, setup, gpu, seq_len, headroom_bytes, engine)
    # what the framework's config switches on: a rung that needs code is never a row's choice
    runnable = [c for c in ladder(setup, gpu, model) if not any(t.needs for t in c)]
    combos: list[Combo] = [(), *runnable]
    exact = _exact(combos)
    techniques, best, choice = _fastest_exact(row, exact)
    if not best:
        techniques, best, choice = _changes_training(row, combos, exact)
    if best:
        best, total, est, from_lines = row.traced(techniques)
    else:  # nothing fits: the choice's figure at size 1, traced even where it was pruned
        est = row.at(techniques, 1)
        total, from_lines = est.device_total_bytes, False
    return FitRow(
        gpu,
        est.setup.precision,
        best,
        total,
        techniques,
        est.engine,
        seconds_per_billion_tokens=_per_billion(model, est.setup, gpu, best, seq_len),
        choice=choice,
        from_lines=from_lines,
    )


def _exact(combos: list[Combo]) -> list[Combo]:
    """The options that do not change training, fused AdamW added to each that needs more."""
    exact = [c for c in combos if all(t.kind == "exact" for t in c)]
    if (FUSED_ADAMW,) in exact:
        # the ladder tries fused AdamW alone (on a GPU that fits it, nothing more is needed);
        # a row that needs the loss or checkpointing rungs too is timed with it as well
        exact += [
            (FUSED_ADAMW, *c)
            for c in exact
            if c and FUSED_ADAMW not in c and not any(t.name in OFFLOADS for t in c)
        ]
    return exact


def _fastest_exact(row: _OnGpu, exact: list[Combo]) -> tuple[Combo, int, str]:
    """The fastest exact option that fits, at its largest micro-batch; ((), 0, ...) where
    none fits. Options whose bound cannot come within ``TIME_TOLERANCE`` of the best found
    are not searched."""
    # ladder position -> (penalised seconds per 1B tokens, micro-batch) of each searched
    found: dict[int, tuple[float, int]] = {}
    bounds = {k: row.bound(c) for k, c in enumerate(exact)}
    for k in sorted(bounds, key=lambda k: (bounds[k], k)):
        best_seen = min((sec for sec, _ in found.values()), default=float("inf"))
        if bounds[k] > best_seen * (1 + TIME_TOLERANCE):
            break  # no option left can come within the tolerance of the best found
        if found and best_seen == float("inf"):
            break  # the time model does not apply: the first that fits, in ladder order
        micro = row.largest(exact[k])
        if micro:
            found[k] = (row.per_billion(exact[k], micro), micro)
    if not found:
        return (), 0, "nothing fits"
    fastest = min(sec for sec, _ in found.values())
    # within the time model's resolution, the simplest: the setup as given, then the
    # earliest rung of the ladder (fewest techniques, cheapest in time)
    k = min(k for k, (sec, _) in found.items() if sec <= fastest * (1 + TIME_TOLERANCE))
    return exact[k], found[k][1], "fastest exact"


def _changes_training(
    row: _OnGpu, combos: list[Combo], exact: list[Combo]
) -> tuple[Combo, int, str]:
    """Where nothing exact fits: the first rung that changes training and fits."""
    for combo in combos:
        if combo in exact:
            continue
        micro = row.largest(combo)
        if micro:
            return combo, micro, "changes training: nothing exact fits"
    return (), 0, "nothing fits"


# One consistent setup per row: the optimizer step spread over a 1M-token global batch
REFERENCE_BATCH_TOKENS = 1 << 20


def _per_billion(
    model: ModelInfo, setup: TrainingSetup, gpu: GpuSpec, micro_batch_size: int, seq_len: int
) -> float | None:
    """Seconds one GPU takes for a billion tokens at ``micro_batch_size`` (``batchfit.speed``)."""
    if not micro_batch_size or model.task == "image-classification":
        return None
    workload = Workload(micro_batch_size=micro_batch_size, seq_len=seq_len, gpu=gpu)
    t = step_time(model, setup, gpu, workload=workload)
    if t is None:
        return None
    per_token = t.micro_seconds / t.tokens_per_micro_step
    return 1e9 * (per_token + t.optimizer_seconds / REFERENCE_BATCH_TOKENS)
