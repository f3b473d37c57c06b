"""Rendering of ``batchfit probe``: the progress line, the trials table and the plot."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.markup import escape
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from batchfit._units import BYTES_IN_GIB, gib_figure
from batchfit.cli import render
from batchfit.models import ModelInfo
from batchfit.search import SearchResult, Trial
from batchfit.views import plots as _plots

if TYPE_CHECKING:
    from batchfit.search.probe import ProbeReport


@contextlib.contextmanager
def trial_progress(*, quiet: bool) -> Iterator[Callable[[dict[str, Any]], None]]:
    """A progress line on stderr, one update per message of the probe; nothing when ``quiet``.

    The bar is stopped (the cursor shown again) however the block ends: Ctrl-C, SIGTERM."""
    if quiet:
        yield lambda _message: None
        return
    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=render.err,
        transient=True,
    ) as bar:
        task = bar.add_task("probing: building the model, predicting the limit ...", total=None)

        def update(message: dict[str, Any]) -> None:
            if "start" in message:
                bar.update(
                    task, description=f"probing: first trial at micro-batch {message['start']} ..."
                )
                return
            t = Trial.from_json(message["trial"])
            bar.update(
                task,
                description=f"probing: micro-batch {t.micro_batch_size} "
                f"{_verdict(t)}; next trial ...",
            )
            render.err.print(f"  trial: micro-batch {t.micro_batch_size:>5}  {_verdict(t)}")

        yield update


def _verdict(t: Trial) -> str:
    return ("ok" if t.samples_per_s else "measured") if t.ok else "out of memory"


_PROBE_COLUMNS = ("micro-batch", "result", "peak GiB", "% of budget", "samples/s", "tokens/s")


def _trials_table(info: ModelInfo, report: ProbeReport, seq_len: int, budget: int | None) -> Table:
    image = info.task == "image-classification"
    table = Table(
        title=f"{escape(info.name)}, {render.sample_size(seq_len, image)}: real training steps",
        title_justify="left",
    )
    epochs = report.dataset_size is not None
    columns = _PROBE_COLUMNS[:-1] if image else _PROBE_COLUMNS  # images have no tokens
    for col in (*columns, *(("time/epoch",) if epochs else ())):
        table.add_column(
            col,
            justify="left" if col == "result" else "right",
            no_wrap=True,
            min_width=len("measured") if col == "result" else len(col),
        )
    for t in report.result.trials:
        peak, speed = t.peak_bytes, t.samples_per_s
        row = [
            str(t.micro_batch_size),
            "[red]OOM[/]" if not t.ok else _verdict(t),
            gib_figure(peak) if peak else "-",
            f"{100 * peak / budget:.0f}%" if peak and budget else "-",
            f"{speed:,.2f}" if speed else "-",
            *(() if image else (f"{speed * seq_len:,.0f}" if speed else "-",)),
        ]
        if epochs:
            seconds = report.epoch_seconds(t)
            row.append(_duration(seconds) if seconds is not None else "-")
        table.add_row(*row)
    return table


def _plan_line(report: ProbeReport) -> str:
    p, choice = report.plan, report.result.micro_batch_size
    assert p is not None
    why = (
        ""
        if p.micro_batch_size == choice
        else f" (the largest size that ran, up to {choice}, that divides {p.global_batch_size})"
    )
    return (
        f"for a global batch of {p.global_batch_size}: micro-batch "
        f"{p.micro_batch_size} x accumulation {p.grad_accum_steps}{why}"
    )


def probe_table(
    info: ModelInfo, report: ProbeReport, seq_len: int, budget: int | None, plot: Path | None
) -> None:
    out, r = render.out, report.result
    out.print(_trials_table(info, report, seq_len, budget))
    out.print(
        f"choice: micro-batch [bold]{r.micro_batch_size}[/] ({r.choose}); "
        f"largest that fitted: {r.max_fitting_micro_batch}; "
        f"{r.steps_run} real steps, {r.ooms} out-of-memory, {r.seconds:.1f} s"
    )
    if any(t.ok and not t.samples_per_s for t in r.trials):
        out.print("measured: one step for its peak memory only, not timed")
    if report.plan is not None:
        out.print(_plan_line(report))
    for note in (*r.notes, *report.notes):
        out.print(f"note: {note}", markup=False)
    if plot is not None:
        out.print(f"wrote {plot}", markup=False)


def _duration(seconds: float) -> str:
    hours, rest = divmod(int(seconds), 3600)
    return f"{hours}h {rest // 60:02d}m" if hours else f"{rest // 60}m {rest % 60:02d}s"


def probe_plot(result: SearchResult, path: Path, budget: int | None) -> None:
    """Throughput and peak memory against the micro-batch (matplotlib, the `plot` extra)."""
    plt = _plots.pyplot()
    from matplotlib.ticker import MaxNLocator  # matplotlib (the `plot` extra) loads to draw only

    ok = sorted(
        (t.micro_batch_size, t.samples_per_s or 0.0, t.peak_bytes or 0)
        for t in result.trials
        if t.ok
    )
    failed = sorted({t.micro_batch_size for t in result.trials if not t.ok})
    fig, speed_ax = plt.subplots(figsize=(7, 4))
    timed = [(n, s) for n, s, _ in ok if s > 0]  # a size only measured has no speed
    speed_ax.plot([n for n, _ in timed], [s for _, s in timed], "o-", color="tab:blue")
    speed_ax.set_ylim(bottom=0)  # a few percent must not look like a cliff
    chosen = [s for n, s in timed if n == result.micro_batch_size]
    if chosen:
        speed_ax.plot([result.micro_batch_size], [max(chosen)], "*", color="black", markersize=14)
    speed_ax.set_xlabel("micro-batch")
    speed_ax.set_ylabel("samples/s", color="tab:blue")
    mem_ax = speed_ax.twinx()
    mem_ax.plot([n for n, _, _ in ok], [p / BYTES_IN_GIB for _, _, p in ok], "s--", color="tab:red")
    mem_ax.set_ylim(bottom=0)
    if budget:
        mem_ax.axhline(budget / BYTES_IN_GIB, color="tab:red", linestyle="-.", label="budget")
        mem_ax.legend(loc="lower center")
    speed_ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    for n in failed:
        speed_ax.axvline(n, color="grey", linestyle=":")
    mem_ax.set_ylabel("peak GiB", color="tab:red")
    speed_ax.set_title(
        f"choice {result.micro_batch_size} (star), largest that fitted "
        f"{result.max_fitting_micro_batch}" + (" (grey dotted: out of memory)" if failed else "")
    )
    _plots.save(fig, path)
