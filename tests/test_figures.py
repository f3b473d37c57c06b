"""Every figure the docs quote comes from benchmarks/data.

A page quotes a figure by writing it and, right after it, ``<!-- fig:NAME -->``;
``benchmarks/figures.py`` computes NAME from the data. These tests scan README.md and every
docs/*.md and fail when the number written before a marker differs from the computed figure (at
the precision written; the sign is not compared), when a marker names no known figure, or when
the data does not give the figure. They also check that docs/benchmarks.md's tables are the ones
``benchmarks/report.py`` renders from the data.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import figures  # noqa: E402

MARKER = re.compile(r"<!--\s*fig:([A-Za-z0-9_]+)\s*-->")
NUMBER = re.compile(r"[-+−]?\d+(?:,\d{3})*(?:\.\d+)?")


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def written_matches(written: str, value: float) -> bool:
    """Whether ``value`` printed at ``written``'s precision is ``written`` (sign not compared)."""
    digits = written.lstrip("+-−").replace(",", "")
    decimals = len(digits.split(".")[1]) if "." in digits else 0
    return f"{abs(value):.{decimals}f}" == digits


def problems(text: str, page: str, lookup: Callable[[str], float | None]) -> list[str]:
    """What is wrong with the quoted figures of one page (``lookup`` raises KeyError for a name
    it does not know and returns None where the data does not give the figure)."""
    found = []
    previous_end = 0
    for marker in MARKER.finditer(text):
        name = marker.group(1)
        where = f"{page}:{text.count(chr(10), 0, marker.start()) + 1} fig:{name}"
        numbers = NUMBER.findall(text[previous_end : marker.start()])
        previous_end = marker.end()
        try:
            value = lookup(name)
        except KeyError:
            found.append(f"{where}: no such figure in benchmarks/figures.py")
            continue
        if value is None:
            found.append(f"{where}: the data does not give this figure")
        elif not numbers:
            found.append(f"{where}: no number written before the marker")
        elif not written_matches(numbers[-1], value):
            found.append(f"{where}: the page says {numbers[-1]}, the data gives {value:g}")
    return found


def test_the_checker_accepts_a_figure_at_the_precision_written() -> None:
    lookup = {"a_pct": 17.34, "b_mib": 758.0, "c_x": 4.333}.__getitem__
    text = (
        "median 17.3% <!-- fig:a_pct -->, worst -758 MiB\n<!-- fig:b_mib --> and 4.33x "
        "<!--fig:c_x-->"
    )
    assert problems(text, "page", lookup) == []


def test_the_checker_catches_a_figure_that_differs_from_the_data() -> None:
    lookup = {"a_pct": 17.34}.__getitem__
    assert problems("median 25% <!-- fig:a_pct -->", "page", lookup) == [
        "page:1 fig:a_pct: the page says 25, the data gives 17.34"
    ]
    assert problems("median 17.4% <!-- fig:a_pct -->", "page", lookup) != []


def test_the_checker_catches_an_unknown_name_missing_data_and_no_number() -> None:
    lookup = {"known": None, "other": 1.0}.__getitem__
    found = problems(
        "x 1 <!-- fig:unknown --> y 2 <!-- fig:known --> <!-- fig:other -->", "page", lookup
    )
    assert found == [
        "page:1 fig:unknown: no such figure in benchmarks/figures.py",
        "page:1 fig:known: the data does not give this figure",
        "page:1 fig:other: no number written before the marker",
    ]


def test_every_quoted_figure_in_the_docs_matches_the_data() -> None:
    found = []
    for page in pages():
        found += problems(page.read_text(), str(page.relative_to(ROOT)), figures.value)
    assert found == [], "\n".join(found)


@pytest.mark.parametrize("name", sorted(figures.FIGURES))
def test_every_figure_is_given_by_the_committed_data(name: str) -> None:
    assert figures.value(name) is not None, figures.FIGURES[name].source


def test_the_benchmarks_page_is_the_one_rendered_from_the_data() -> None:
    import report

    text = report.DOC.read_text()
    assert report.render_page(text) == text, "run `make bench-docs`"
