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
