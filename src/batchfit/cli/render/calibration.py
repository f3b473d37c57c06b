"""Rendering of ``batchfit calibration``: the records' count, the table of measured over
estimated by GPU and torch version, and what ``--headroom auto`` takes from them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.table import Table

from batchfit.calibration import Headroom
from batchfit.cli import render


def calibration(path: Path, records: int, rows: list[dict[str, Any]], headroom: Headroom) -> None:
    out = render.out
    out.print(f"calibration records: {records} in {path}")
    if rows:
        table = Table(title="measured / estimated - 1", title_justify="left")
        for column in ("device", "torch", "records", "median", "p90", "p99", "worst"):
            table.add_column(column, justify="left" if column in ("device", "torch") else "right")
        for r in rows:
            table.add_row(
                r["device"],
                r["torch"],
                str(r["records"]),
                *(f"{r[k]:+.1%}" for k in ("median", "p90", "p99", "worst")),
            )
        out.print(table)
    out.print(f"plan --headroom auto (GPU records): {headroom.fraction:.1%} ({headroom.why})")


def step_time(rows: list[dict[str, Any]]) -> None:
    """The runs that timed their steps: what ``plan`` and ``estimate`` scale their time by."""
    if not rows:
        return
    table = Table(title="step time: measured / predicted", title_justify="left")
    for column in ("device", "model", "runs", "median", "counted"):
        table.add_column(column, justify="left" if column in ("device", "model") else "right")
    for r in rows:
        table.add_row(
            r["device"], r["model"], str(r["runs"]), f"x {r['median']:.2f}", str(r["counted"])
        )
    render.out.print(table)
    render.out.print(
        "plan and estimate scale their time on a GPU by its runs of the model (else of other "
        "models, from 3 runs); a run over 4x off the model is not counted"
    )
