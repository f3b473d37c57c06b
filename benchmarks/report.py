"""Regenerate every table section of docs/benchmarks.md from benchmarks/data, running nothing.

Each ``<!-- NAME:start -->`` ... ``<!-- NAME:end -->`` section is rendered from its results file
(``data/NAME_results.json``, see ``_report.py``), except two rendered from a benchmark's own raw
data: ``gpu-sweeps`` (``data/gpu_validate_h100.json``) and ``plan-choice``
(``data/plan_choice.json``). Running it twice changes nothing; on the committed data it
reproduces the committed page.

    python benchmarks/report.py [--check]      # make bench-docs
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))

from _report import DATA, DOC, render_results, replace_section, trailer  # noqa: E402

H100_RAW = "gpu_validate_h100.json"


def _gpu_sweeps() -> str:
    from gpu_validate import sweep_table

    raw = json.loads((DATA / H100_RAW).read_text())
    versions = raw["results"]["context"]["versions"]
    measured = (
        f"on one {versions['gpu']} (CUDA {versions['cuda']}, torch {versions['torch']}, driver "
        f"{versions['driver']}, transformers {versions['transformers']}), 2026-11-26"
    )
    line = trailer(
        H100_RAW,
        "`benchmarks/gpu_validate.py` (its `sweep_table`)",
        measured,
        "not applicable: the time model's GPU coefficients were fitted on these sweeps.",
    )
    return sweep_table(raw) + "\n\n" + line


def _plan_choice() -> str:
    from plan_choice import HELD_OUT, doc_section

    data = json.loads((DATA / "plan_choice.json").read_text())
    line = trailer(
        "plan_choice.json",
        "`benchmarks/plan_choice.py` (its `doc_section`)",
        "by the planner's own time model (no steps run), 2026-11-27",
        HELD_OUT,
    )
    return doc_section(data) + "\n\n" + line


def sections() -> dict[str, str]:
    """Every section's markdown, by name."""
    out = {}
    for path in sorted(DATA.glob("*_results.json")):
        data = json.loads(path.read_text())
        out[data["section"]] = render_results(data)
    out["gpu-sweeps"] = _gpu_sweeps()
    out["plan-choice"] = _plan_choice()
    return out


def render_page(text: str) -> str:
    """``text`` (the page) with every section rendered from the data."""
    for name, body in sections().items():
        text = replace_section(text, name, body)
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is not current")
    args = parser.parse_args()
    text = DOC.read_text()
    page = render_page(text)
    if args.check:
        if page != text:
            print(f"{DOC} differs from benchmarks/data: run `make bench-docs`", file=sys.stderr)
            return 1
        return 0
    if page != text:
        DOC.write_text(page)
        print(f"rewrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
