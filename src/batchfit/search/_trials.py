"""What a search returns: each size it ran (:class:`Trial`) and the choice (:class:`SearchResult`),
both JSON round-trips (results cross the probe's process boundary as JSON)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from batchfit._display import html

Choose = Literal["throughput", "max"]
# Sizes whose throughput is within this fraction of the best count as equally fast.
PLATEAU = 0.02


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
