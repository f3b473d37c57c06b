"""A benchmark's results as data, and its table section of docs/benchmarks.md rendered from them.

Every table section of the page lies between ``<!-- NAME:start -->`` and ``<!-- NAME:end -->``
and is rendered from ``benchmarks/data/NAME_results.json`` (``-`` in NAME read as ``_``) by
``benchmarks/report.py``. A script that measures writes that file with :func:`write_section`,
which then rewrites its section, so the page and the data never disagree.

A results file holds the section as blocks: ``{"text": ...}`` (markdown between tables, kept as
written) and ``{"table": {"header": [...], "align": [...], "rows": [[...], ...]}}`` (cells as
printed, so a regenerated page is byte-identical), plus ``script`` (what produced it, markdown),
``measured`` (when and on what) and ``held_out`` (which cases were fixed before any result was
seen, and which the code was debugged on).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "benchmarks.md"
DATA = ROOT / "benchmarks" / "data"
HEADER = "# Benchmarks\n"

_ALIGN = {"---": "left", "---:": "right", ":---": "left", ":---:": "center"}
_MARK = {"left": "---", "right": "---:", "center": ":---:"}


def results_path(name: str) -> Path:
    """The results file of section ``name``."""
    return DATA / f"{name.replace('-', '_')}_results.json"


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip()[1:-1].split(" | ")]


def parse_body(body: str) -> list[dict[str, Any]]:
    """Split a section's markdown into text blocks and tables (a run of lines starting "|")."""
    blocks: list[dict[str, Any]] = []
    lines = body.rstrip("\n").split("\n")
    i = 0
    while i < len(lines):
        if lines[i].startswith("|") and i + 1 < len(lines) and lines[i + 1].startswith("|---"):
            header = _cells(lines[i])
            align = [_ALIGN[c] for c in lines[i + 1].strip()[1:-1].split("|")]
            i += 2
            rows = []
            while i < len(lines) and lines[i].startswith("|"):
                rows.append(_cells(lines[i]))
                i += 1
            blocks.append({"table": {"header": header, "align": align, "rows": rows}})
        else:
            start = i
            while i < len(lines) and not (
                lines[i].startswith("|") and i + 1 < len(lines) and lines[i + 1].startswith("|---")
            ):
                i += 1
            blocks.append({"text": "\n".join(lines[start:i])})
    return blocks


def render_table(table: dict[str, Any]) -> str:
    """A markdown table from its header, alignment and rows of printed cells."""
    head = "| " + " | ".join(table["header"]) + " |"
    marks = "|" + "|".join(_MARK[a] for a in table["align"]) + "|"
    rows = ["| " + " | ".join(row) + " |" for row in table["rows"]]
    return "\n".join([head, marks, *rows])


def render_blocks(blocks: list[dict[str, Any]]) -> str:
    """The section's markdown, the inverse of :func:`parse_body`."""
    parts = [render_table(b["table"]) if "table" in b else b["text"] for b in blocks]
    return "\n".join(parts)


def trailer(file: str, source: str, measured: str, held_out: str) -> str:
    """The line under every table section: where its numbers live and which cases were held out."""
    return (
        f"*Data:* `benchmarks/data/{file}`, from {source}; measured {measured}. "
        f"*Held out:* {held_out}"
    )


def render_results(data: dict[str, Any]) -> str:
    """Section markdown from a results file: its blocks, then the data and held-out line."""
    file = results_path(data["section"]).name
    line = trailer(file, data["script"], data["measured"], data["held_out"])
    return render_blocks(data["blocks"]).rstrip("\n") + "\n\n" + line


def replace_section(text: str, name: str, body: str) -> str:
    """``text`` with section ``name`` replaced by ``body`` (appended when it has no markers)."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    block = f"{start}\n{body.rstrip()}\n{end}"
    if start in text and end in text:
        before, rest = text.split(start, 1)
        after = rest.split(end, 1)[1]
        return before + block + after
    return text.rstrip() + "\n\n" + block + "\n"


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` to a temporary name and rename it, so no reader sees half a file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(data, indent=1, ensure_ascii=False, allow_nan=False) + "\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def write_section(name: str, body: str, held_out: str | None = None) -> None:
    """Save section ``name``'s results (``body`` as blocks) and rewrite it in the page.

    ``held_out`` says which cases were fixed before any result was seen and which the code was
    debugged on; without it the results file keeps what it said before.
    """
    path = results_path(name)
    old = json.loads(path.read_text()) if path.exists() else {}
    script = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "?"
    data = {
        "section": name,
        "script": f"`benchmarks/{script}`",
        "measured": (
            f"{datetime.date.today().isoformat()} on {platform.machine()}, "
            f"{os.cpu_count()} CPU cores, Python {platform.python_version()}"
        ),
        "held_out": held_out or old.get("held_out", "cases not marked held out."),
        "blocks": parse_body(body),
    }
    DATA.mkdir(exist_ok=True)
    write_json(path, data)
    text = DOC.read_text() if DOC.exists() else HEADER
    DOC.write_text(replace_section(text, name, render_results(data)))
