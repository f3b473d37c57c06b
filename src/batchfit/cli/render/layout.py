"""Output that fits the console's width: lines wrapped between words with a hanging indent,
and tables whose columns break only between words, the least needed left out where the width is
short (``--json`` keeps everything). No computing here, and no console of its own: the caller
passes ``render.out`` or ``render.err``."""

from __future__ import annotations

from dataclasses import dataclass

from rich.cells import cell_len
from rich.console import Console
from rich.table import Table
from rich.text import Text

_KEY_MAX = 40  # a `key: ` further in than this is part of a sentence, not a line's key
_BODY_MIN = 30  # the least room a hanging indent leaves for the text


def wrapped(console: Console, markup: str) -> list[Text]:
    """A line (rich markup) wrapped at the console's width between words; the lines after
    the first start under the text after its ``key: `` (else two spaces in).

    Example:
        >>> from rich.console import Console
        >>> text = "  time: ~3.78 s per optimizer step, 17,316 tokens/s per GPU (predicted)"
        >>> for line in wrapped(Console(width=48), text):
        ...     print(line.plain)
          time: ~3.78 s per optimizer step, 17,316
                tokens/s per GPU (predicted)
    """
    text = Text.from_markup(markup)
    plain, width = text.plain, console.width
    if cell_len(plain) <= width or "\n" in plain:
        return [text]
    lead = len(plain) - len(plain.lstrip(" "))
    colon = plain.find(": ", lead)
    hang = colon + 2 if lead < colon and colon + 2 <= _KEY_MAX else lead + 2
    if width - hang < _BODY_MIN:
        hang = min(lead + 2, max(width - _BODY_MIN, 0))
    head, body = text[:hang], text[hang:]
    lines = [line.copy() for line in body.wrap(console, width - hang)]
    for line in lines:
        line.rstrip()
    return [head + lines[0], *(Text(" " * hang) + line for line in lines[1:])]


def print_line(console: Console, markup: str) -> None:
    """:func:`wrapped`, printed."""
    for line in wrapped(console, markup):
        console.print(line)


@dataclass(frozen=True)
class Column:
    """A table column: its header, its side, and when it is left out.

    ``wrap``: False keeps each cell on one line (figures: ``32 x 2``); headers wrap onto two
    lines at most. ``leave_out``: 0 keeps the column at any width; 1 is left out first on a
    narrow console, then 2, ... ``want``: the width a text column needs to be worth keeping
    (its longest word otherwise); text columns take the room left first."""

    header: str
    right: bool = False
    wrap: bool = True
    leave_out: int = 0
    want: int = 0


def _longest_word(text: str) -> int:
    return max((cell_len(word) for word in text.split()), default=0)


def _header_width(header: str) -> int:
    """The least width that sets a header on two lines at most, broken between words.

    Example:
        >>> _header_width("GiB at that size")
        9
    """
    words = header.split()
    return min(
        (
            max(cell_len(" ".join(words[:i])), cell_len(" ".join(words[i:])))
            for i in range(1, len(words))
        ),
        default=cell_len(header),
    )


def _widths(start: list[int], natural: list[int], grow: list[bool], room: int) -> list[int]:
    """Each column's width: its ``start``, then the room left to the ``grow`` columns (text),
    a cell at a time to the one furthest from its natural width; what they leave goes to the
    others, the nearest to their natural width first (a header on one line)."""
    widths = list(start)
    spare = room - sum(widths)
    while spare > 0:
        gaps = [n - w if g else 0 for n, w, g in zip(natural, widths, grow, strict=True)]
        k = max(range(len(gaps)), key=lambda i: gaps[i])
        if gaps[k] <= 0:
            break
        widths[k] += 1
        spare -= 1
    for k in sorted(range(len(widths)), key=lambda i: natural[i] - widths[i]):
        more = min(max(natural[k] - widths[k], 0), spare)
        widths[k] += more
        spare -= more
    return widths


def fitted_table(
    console: Console, title: str, columns: list[Column], rows: list[list[str] | None]
) -> tuple[Table, list[str]]:
    """A table that fits the console's width without breaking a word: the columns left out in
    their ``leave_out`` order until the rest fit at their ``want`` widths, the rest wrapped
    between words. A row of None starts a section. Returns the table and the names of the
    columns left out."""
    plain = [[Text.from_markup(cell).plain for cell in row] for row in rows if row is not None]
    cells = [[row[k] for row in plain] for k in range(len(columns))]
    natural = [
        max([cell_len(c.header), *(cell_len(x) for x in cells[k])]) for k, c in enumerate(columns)
    ]
    least = [
        max(
            [
                _header_width(c.header),
                *((_longest_word if c.wrap else cell_len)(x) for x in cells[k]),
            ]
        )
        for k, c in enumerate(columns)
    ]
    need = [max(lo, min(c.want, n)) for lo, n, c in zip(least, natural, columns, strict=True)]
    keep = list(range(len(columns)))

    def room() -> int:  # a column's padding and its border take three cells
        return console.width - 3 * len(keep) - 1

    for k in sorted(
        (k for k, c in enumerate(columns) if c.leave_out), key=lambda k: columns[k].leave_out
    ):
        if sum(need[j] for j in keep) <= room():
            break
        keep.remove(k)
    fixed = sum(natural[k] for k in keep) > room()
    start = need if sum(need[k] for k in keep) <= room() else least
    widths = _widths(
        [start[k] for k in keep],
        [natural[k] for k in keep],
        [columns[k].want > 0 for k in keep],
        room(),
    )
    table = Table(title=title, title_justify="left")  # print_table wraps it between words
    for k, width in zip(keep, widths, strict=True):
        c = columns[k]
        table.add_column(
            c.header, justify="right" if c.right else "left", width=width if fixed else None
        )
    for row in rows:
        if row is None:
            table.add_section()
        else:
            table.add_row(*(row[k] for k in keep))
    left_out = [c.header for k, c in enumerate(columns) if k not in keep]
    return table, left_out


def print_table(console: Console, table: Table, left_out: list[str]) -> None:
    """The table, its title wrapped between words above it (rich sets a title on one line
    where the console soft-wraps), and below it the line naming the columns left out."""
    if isinstance(table.title, str):
        print_line(console, f"[{table.title_style or 'table.title'}]{table.title}[/]")
        table.title = None
    console.print(table)
    if left_out:
        them = "them" if len(left_out) > 1 else "it"
        print_line(
            console,
            f"left out at {console.width} columns: {', '.join(left_out)} (a wider terminal or "
            f"--json shows {them})",
        )
