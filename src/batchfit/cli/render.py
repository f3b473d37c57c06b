"""Rendering for people: rich tables on stdout, warnings on stderr. No computing here."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from batchfit._units import BYTES_IN_GIB, gib, gib_figure, human_count
from batchfit.errors import UsageError
from batchfit.hardware import GpuSpec
from batchfit.memory.types import COMPONENTS, MemoryEstimate
from batchfit.models import ModelInfo
from batchfit.plan import FitRow, Plan

if TYPE_CHECKING:
    from batchfit._probe import ProbeReport
    from batchfit.search import SearchResult, Trial

# soft_wrap: sentences are never cut into lines (tables still fit the terminal width).
out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)


def _warn(warnings: tuple[str, ...] | list[str]) -> None:
    for w in warnings:
        err.print(f"[yellow]warning:[/] {escape(w)}")


def _breakdown(est: MemoryEstimate, title: str) -> Table:
    table = Table(title=title, title_justify="left", show_lines=False)
    table.add_column("component")
    table.add_column("part")
    table.add_column("GiB", justify="right")
    table.add_column("how it is counted", overflow="fold")
    for comp in COMPONENTS:
        first = True
        # Trace lines that only restate a component at the peak are shown once, below.
        for line in (
            ln
            for ln in est.lines
            if ln.component == comp and not ln.label.startswith("at the peak")
        ):
            table.add_row(
                comp if first else "",
                escape(line.label),
                gib_figure(line.num_bytes),
                escape(line.formula),
            )
            first = False
    table.add_section()
    for comp in COMPONENTS:
        table.add_row(
            f"[bold]{comp}[/]",
            f"at the peak ({est.peak_phase})",
            gib_figure(est.components[comp]),
            "",
        )
    table.add_section()
    table.add_row(
        "[bold]peak allocated[/]",
        "",
        f"[bold]{gib_figure(est.peak_bytes)}[/]",
        "comparable to torch.cuda.max_memory_allocated"
        if est.device != "cpu"
        else "bytes held by tensors",
    )
    if est.device != "cpu":
        table.add_row("reserved", "", gib_figure(est.reserved_bytes), "caching allocator")
        table.add_row(
            "[bold]device total[/]",
            "",
            f"[bold]{gib_figure(est.device_total_bytes)}[/]",
            "what nvidia-smi shows: + CUDA context, NCCL",
        )
    if est.host_bytes:
        table.add_row(
            "host RAM", "", gib_figure(est.host_bytes), "offloaded state, per GPU process"
        )
    return table


def estimate(
    est: MemoryEstimate, info: ModelInfo, gpu: GpuSpec | None, explain: bool = False
) -> None:
    setup = est.setup
    out.print(
        f"[bold]{escape(info.name)}[/] ({human_count(est.total_params)} params, "
        f"{human_count(est.trainable_params)} trainable, {info.task}) on [bold]{est.device}[/]: "
        f"micro-batch {est.micro_batch_size} x seq {est.seq_len}, {setup.precision}, "
        f"{setup.optimizer}, {setup.method}, attention {setup.attention}"
        f"{', grad-ckpt' if setup.grad_ckpt else ''}"
        f"{f', {setup.sharding} x {setup.num_gpus}' if setup.sharding != 'none' else ''}"
    )
    out.print(
        _breakdown(
            est, f"Memory per {'GPU' if est.device != 'cpu' else 'process'} ({est.engine} engine)"
        )
    )
    for note in est.extras.get("notes", []):
        out.print(f"note: {escape(note)}")
    if explain:
        top = est.extras.get("top_modules") or []
        if not top:
            out.print("--explain: module attribution comes from the trace engine")
        else:
            table = Table(
                title="Activation memory by module at the peak (traced layers)",
                title_justify="left",
            )
            table.add_column("module")
            table.add_column("GiB", justify="right")
            for name, num_bytes in top:
                table.add_row(escape(name) or "(model)", gib_figure(num_bytes, 3))
            out.print(table)
    if gpu is not None:
        free = gpu.memory_bytes - est.device_total_bytes
        from batchfit.plan import DEFAULT_HEADROOM_BYTES

        verdict = "[green]fits[/]" if free >= 0 else "[red]does not fit[/]"
        if 0 <= free < DEFAULT_HEADROOM_BYTES:
            verdict = (
                "[yellow]fits, with less than the "
                f"{gib(DEFAULT_HEADROOM_BYTES)} headroom `plan` keeps[/]"
            )
        out.print(
            f"{gpu.full_name}: {gib(gpu.memory_bytes)} -> {verdict} "
            f"({'headroom' if free >= 0 else 'short by'} {gib(abs(free))})"
        )
    _warn(est.warnings)


def plan(p: Plan, info: ModelInfo) -> None:
    est = p.estimate
    out.print(f"[bold]{escape(info.name)}[/] on {p.num_gpus} x [bold]{p.gpu}[/], seq {p.seq_len}")
    out.print(
        f"  micro-batch [bold]{p.micro_batch_size}[/] x accumulation "
        f"[bold]{p.grad_accum_steps}[/] x GPUs [bold]{p.num_gpus}[/] = global batch "
        f"[bold]{p.global_batch_size:,}[/] samples = {p.tokens_per_step:,} tokens per step"
    )
    if p.max_micro_batch == 0:
        out.print("  largest micro-batch that fits: [red]none[/]")
    elif p.max_micro_batch > p.micro_batch_size:
        out.print(
            f"  largest micro-batch that fits: {p.max_micro_batch} (the chosen "
            f"{p.micro_batch_size} divides the {p.global_batch_size // p.num_gpus} "
            "samples each GPU takes per step)"
        )
    else:
        out.print(f"  largest micro-batch that fits: {p.max_micro_batch}")
    if p.learning_rate is not None:
        out.print(
            f"  learning rate: [bold]{p.learning_rate:.3g}[/] ({p.lr_rule}; valid below "
            "the critical batch size)"
        )
    if p.techniques:
        named = ", ".join(
            f"{t.name} [{'green' if t.kind == 'exact' else 'yellow'}]({t.kind})[/]"
            for t in p.techniques
        )
        out.print(f"  to fit: {named}")
    elif p.max_micro_batch == 0:
        out.print("  to fit: [red]no technique on the ladder is enough[/] (see the warning)")
    else:
        out.print("  to fit: nothing extra needed")
    free = p.headroom_bytes
    out.print(
        f"  memory: {gib(est.device_total_bytes)} of {gib(p.gpu_bytes)} "
        f"({'headroom' if free >= 0 else 'short by'} {gib(abs(free))}; "
        f"asked for {gib(p.headroom_wanted_bytes)})"
    )
    out.print(_breakdown(est, f"Memory per GPU at micro-batch {p.micro_batch_size}"))
    if p.alternatives:
        table = Table(title="Alternatives (exact rungs first)", title_justify="left")
        table.add_column("techniques", overflow="fold")
        table.add_column("kind", overflow="fold")
        table.add_column("largest micro-batch", justify="right")
        table.add_column("GiB at that size", justify="right")
        for alt in p.alternatives:
            kinds = {t.kind for t in alt.techniques}
            table.add_row(
                " + ".join(t.name for t in alt.techniques),
                "changes-training" if "changes-training" in kinds else "exact",
                str(alt.max_micro_batch) if alt.max_micro_batch else "[red]none[/]",
                gib_figure(alt.device_total_bytes),
            )
        out.print(table)
    _warn(p.warnings)


def export_note(kind: str, path: Path | None, text: str | None) -> None:
    if path is not None:
        out.print(f"wrote {kind} export to {path}", markup=False)
    elif text is not None:
        out.print(f"[bold]{kind} export[/]:")
        out.print(text, markup=False)


def model_row(info: ModelInfo) -> dict[str, Any]:
    a = info.arch
    return {
        "name": info.name,
        "hub_id": info.hub_id,
        "model_type": a.model_type,
        "task": info.task,
        "params": info.total_params,
        "layers": a.num_layers,
        "hidden_size": a.hidden_size,
        "heads": a.num_heads,
        "kv_heads": a.num_kv_heads,
        "vocab_size": a.vocab_size,
        "max_positions": a.max_positions,
    }


def _plain_table(
    title: str, columns: list[tuple[str, bool]], rows: list[list[str]], optional: str
) -> Table:
    """A table whose cells never wrap; on narrow terminals the ``optional`` column is left out
    (``--json`` has everything), so names people type next are never cut."""
    widths = [max(len(h), *(len(r[k]) for r in rows)) for k, (h, _) in enumerate(columns)]
    keep = [
        k
        for k, (h, _) in enumerate(columns)
        if h != optional or sum(widths) + 3 * len(widths) + 1 <= out.width
    ]
    table = Table(title=title, title_justify="left")
    for k in keep:
        header, right = columns[k]
        table.add_column(
            header, justify="right" if right else "left", no_wrap=True, min_width=widths[k]
        )
    for row in rows:
        table.add_row(*(row[k] for k in keep))
    return table


def models(infos: list[ModelInfo]) -> None:
    columns = [
        ("name", False),
        ("hub id", False),
        ("type", False),
        ("params", True),
        ("layers", True),
        ("hidden", True),
        ("heads/kv", False),
        ("vocab", True),
        ("positions", True),
    ]
    rows = [
        [
            i.name,
            i.hub_id or "",
            i.arch.model_type,
            human_count(i.total_params),
            str(i.arch.num_layers),
            str(i.arch.hidden_size),
            f"{i.arch.num_heads}/{i.arch.num_kv_heads}",
            f"{i.arch.vocab_size:,}",
            str(i.arch.max_positions or "-"),
        ]
        for i in infos
    ]
    out.print(_plain_table("Catalog models (offline configs)", columns, rows, "hub id"))


def gpu_row(g: GpuSpec) -> dict[str, Any]:
    return {
        "name": g.name,
        "full_name": g.full_name,
        "vendor": g.vendor,
        "architecture": g.architecture,
        "memory_bytes": g.memory_bytes,
        "compute_capability": g.compute_capability,
        "bf16": g.bf16,
        "fp8": g.fp8,
        "fp16_tflops_dense": g.fp16_tflops_dense,
        "bf16_tflops_dense": g.bf16_tflops_dense,
        "bandwidth_gb_s": g.bandwidth_gb_s,
    }


def gpus(gpu_list: list[GpuSpec]) -> None:
    columns = [
        ("name", False),
        ("GPU", False),
        ("arch", False),
        ("GiB", True),
        ("CC", False),
        ("bf16", False),
        ("fp8", False),
        ("fp16 TFLOPS", True),
        ("GB/s", True),
    ]
    rows = [
        [
            g.name,
            g.full_name,
            g.architecture,
            gib_figure(g.memory_bytes),
            g.compute_capability or "",
            "yes" if g.bf16 else "no",
            "yes" if g.fp8 else "no",
            f"{g.fp16_tflops_dense or 0:g}",
            f"{g.bandwidth_gb_s or 0:g}",
        ]
        for g in gpu_list
    ]
    title = "Catalog GPUs (memory as nvidia-smi / rocm-smi reports it)"
    out.print(_plain_table(title, columns, rows, "GPU"))


def fit_table(info: ModelInfo, seq_len: int, rows: list[FitRow]) -> None:
    table = Table(
        title=f"{escape(info.name)}, seq {seq_len}: largest micro-batch per GPU (analytic engine)",
        title_justify="left",
    )
    for col in ("GPU", "GiB", "precision", "largest micro-batch", "GiB used", "what it takes"):
        table.add_column(
            col,
            justify="right" if col in ("GiB", "largest micro-batch", "GiB used") else "left",
            no_wrap=col == "GPU",
            min_width=max(len(r.gpu.name) for r in rows) if col == "GPU" else None,
            overflow="fold",
        )
    for r in rows:
        needs = (
            ", ".join(f"{t.name}" + ("*" if t.kind != "exact" else "") for t in r.techniques) or "-"
        )
        if r.precision in ("bf16", "amp-bf16") and not r.gpu.bf16:
            needs += " (no native bf16 on this GPU)"
        table.add_row(
            r.gpu.name,
            gib_figure(r.gpu.memory_bytes),
            r.precision,
            str(r.max_micro_batch) if r.max_micro_batch else "[red]none[/]",
            gib_figure(r.device_total_bytes),
            needs,
        )
    out.print(table)
    out.print("* changes what is learned; the others are exact")


@contextlib.contextmanager
def trial_progress(*, quiet: bool) -> Iterator[Callable[[dict[str, Any]], None]]:
    """A progress line on stderr, one update per message of the probe; nothing when ``quiet``.

    The bar is stopped (the cursor shown again) however the block ends: Ctrl-C, SIGTERM."""
    if quiet:
        yield lambda _message: None
        return
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=err,
        transient=True,
    ) as bar:
        task = bar.add_task("probing: building the model, predicting the limit ...", total=None)

        def update(message: dict[str, Any]) -> None:
            from batchfit.search import Trial

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
            err.print(f"  trial: micro-batch {t.micro_batch_size:>5}  {_verdict(t)}")

        yield update


def _verdict(t: Trial) -> str:
    return ("ok" if t.samples_per_s else "measured") if t.ok else "out of memory"


_PROBE_COLUMNS = ("micro-batch", "result", "peak GiB", "% of budget", "samples/s", "tokens/s")


def _trials_table(info: ModelInfo, report: ProbeReport, seq_len: int, budget: int | None) -> Table:
    table = Table(
        title=f"{escape(info.name)}, seq {seq_len}: real training steps", title_justify="left"
    )
    epochs = report.dataset_size is not None
    for col in (*_PROBE_COLUMNS, *(("time/epoch",) if epochs else ())):
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
            f"{speed * seq_len:,.0f}" if speed else "-",
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
    r = report.result
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


def require_matplotlib() -> None:
    """Refuse ``--plot`` without matplotlib before the trials, not after them."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install 'batchfit[plot]'") from None


def probe_plot(result: SearchResult, path: Path, budget: int | None) -> None:
    """Throughput and peak memory against the micro-batch (matplotlib, the `plot` extra)."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

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
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=100)
    except OSError as e:
        raise UsageError(f"cannot write --plot {path}: {e.strerror}") from None
    finally:
        plt.close(fig)
