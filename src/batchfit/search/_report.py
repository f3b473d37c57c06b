"""What ``batchfit probe`` reports on top of the search: an accumulation plan for a global
batch from a size that ran, and the time per epoch."""

from __future__ import annotations

import dataclasses
from typing import Any

from batchfit.search._trials import SearchResult, Trial


@dataclasses.dataclass(frozen=True)
class AccumulationPlan:
    """A global batch as a micro-batch that ran times accumulation steps."""

    micro_batch_size: int
    grad_accum_steps: int
    global_batch_size: int

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class ProbeReport:
    """What ``batchfit probe`` reports: the search, and what the options asked on top of it."""

    result: SearchResult
    plan: AccumulationPlan | None = None
    dataset_size: int | None = None
    notes: tuple[str, ...] = ()

    def epoch_seconds(self, trial: Trial) -> float | None:
        """Time for one pass over ``dataset_size`` samples at the trial's speed."""
        if self.dataset_size is None or not trial.samples_per_s:
            return None
        return self.dataset_size / trial.samples_per_s

    def to_json(self) -> dict[str, Any]:
        data = self.result.to_json()
        data["notes"] = [*data["notes"], *self.notes]
        if self.plan is not None:
            data["plan"] = self.plan.to_json()
        if self.dataset_size is not None:
            data["dataset_size"] = self.dataset_size
            for row, trial in zip(data["trials"], self.result.trials, strict=True):
                row["epoch_seconds"] = self.epoch_seconds(trial)
        return data


def report(
    result: SearchResult, *, global_batch: int | None, dataset_size: int | None
) -> ProbeReport:
    """The probe's report: an accumulation plan for ``global_batch`` from a size that ran (the
    largest up to the choice that divides it), or a note saying there is none."""
    if global_batch is None:
        return ProbeReport(result, dataset_size=dataset_size)
    ran = {t.micro_batch_size for t in result.trials if t.ok}
    divides = [n for n in ran if n <= result.micro_batch_size and global_batch % n == 0]
    if not divides:
        note = (
            f"no size that ran divides --global-batch {global_batch}; for a plan: "
            f"`batchfit plan MODEL --global-batch {global_batch} --micro-batch N`"
        )
        return ProbeReport(result, dataset_size=dataset_size, notes=(note,))
    micro = max(divides)
    plan = AccumulationPlan(micro, global_batch // micro, global_batch)
    return ProbeReport(result, plan=plan, dataset_size=dataset_size)
