"""Rendering for people: rich tables on stdout, warnings on stderr. No computing here."""

from __future__ import annotations

import contextlib
import errno
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from batchfit._units import BYTES_IN_GIB, BYTES_IN_MIB, gib, gib_figure, human_count, human_duration
from batchfit.hardware import GpuSpec
from batchfit.memory.types import COMPONENTS, MemoryEstimate
from batchfit.models import ATTENTION_FREE_TYPES, ModelInfo
from batchfit.plan import FIT_RULE, TIME_TOLERANCE, Alternative, FitRow, Plan
from batchfit.spec import TrainingSetup


class _Console(Console):
    """rich's Console, except that a reader closing the pipe (``| head``) raises
    ``BrokenPipeError`` for ``cli.main`` to end quietly with 0; rich's own exits with 1."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        raise BrokenPipeError(errno.EPIPE, "Broken pipe")


def _width(stream: object) -> int | None:
    """A terminal's own width (None: rich asks it); 160 columns for a pipe or a file, where
    rich's 80 cut each technique name of a table over a dozen lines. ``COLUMNS`` decides
    where it is set."""
    isatty = getattr(stream, "isatty", None)
    if (isatty is not None and isatty()) or os.environ.get("COLUMNS"):
        return None
    return PIPE_WIDTH


PIPE_WIDTH = 160
# soft_wrap: sentences are never cut into lines (tables still fit the terminal width).
out = _Console(highlight=False, soft_wrap=True, width=_width(sys.stdout))
err = _Console(stderr=True, highlight=False, soft_wrap=True, width=_width(sys.stderr))


@contextlib.contextmanager
def progress(what: str) -> Iterator[Callable[[str], None]]:
    """A one-line status on stderr while ``what`` runs, on a terminal only; yields the
    function that updates it."""
    if not err.is_terminal:
        yield lambda _text: None
        return
    with err.status(what) as status:
        yield lambda text: status.update(escape(text))


def note(text: str) -> None:
    """One line about the inputs, before the answer (user text escaped)."""
    out.print(escape(text))


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
        f"micro-batch {est.micro_batch_size} x {sample_size(est.seq_len, est.is_image)}, "
        f"{setup.precision}, "
        f"{setup.optimizer}, {setup.method}, attention {setup.attention}"
        f"{', grad-ckpt' if setup.grad_ckpt else ''}"
        f"{f', {setup.sharding} x {setup.num_gpus}' if setup.sharding != 'none' else ''}"
        f"{f', loss {setup.loss_label}' if setup.loss != 'full' else ''}"
        f"{f', adapters {setup.lora_dtype}' if setup.lora_dtype != 'fp32' else ''}"
        f"{f', frozen base {setup.frozen_dtype}' if setup.frozen_dtype != 'auto' else ''}"
        f"{f', {setup.optimizer_impl} optimizer' if setup.optimizer_impl != 'auto' else ''}"
        f", {setup.loop} loop"
        f"{f', {setup.framework} conventions' if setup.framework else ''}"
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
        out.print(f"{gpu.full_name}: {gib(gpu.memory_bytes)} -> {fit_verdict(est, gpu)}")
        time_line(est.speed_json())
    _warn(est.warnings)


def time_line(speed: dict[str, float | None], indent: str = "", source: str | None = None) -> None:
    """The step time, when there is one: predicted (``batchfit.speed``), or corrected by a
    probe's measured steps as ``source`` says (``plan --throughput-from``)."""
    if speed.get("step_seconds") is None:
        return
    parts = []
    if speed.get("comm_seconds"):
        parts.append(f"{speed['comm_seconds']:.2g} s of communication compute does not hide")
    if speed.get("offload_seconds"):
        parts.append(f"{speed['offload_seconds']:.2g} s of CPU offload")
    within = f" (of which {' and '.join(parts)})" if parts else ""
    why = (
        f"--throughput-from: {escape(source)}"
        if source
        else "predicted; compute calibrated on an H100, about 15-25% off on measured steps; "
        "communication and offload not yet checked on real runs"
    )
    out.print(
        f"{indent}time: ~{speed['step_seconds']:.3g} s per optimizer step{within}, "
        f"{speed['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU, MFU "
        f"{100 * (speed['mfu'] or 0):.0f}% ({why})"
    )


def fit_verdict(est: MemoryEstimate, gpu: GpuSpec) -> str:
    """``fits`` only when the device total leaves memory free (``fits_on_card``), and says how much.

    Example:
        >>> from batchfit.hardware import get_gpu
        >>> from batchfit.spec import TrainingSetup
        >>> t4 = get_gpu("t4")
        >>> full = MemoryEstimate("m", "analytic", "cuda:t4", 1, 8, TrainingSetup(), {}, 0, 0,
        ...                       t4.memory_bytes, 0, 0, "backward")
        >>> fit_verdict(full, t4)
        '[red]does not fit[/] (no headroom: the card is full)'
    """
    from batchfit.memory.device.totals import fits_on_card
    from batchfit.plan import DEFAULT_HEADROOM_BYTES

    free = gpu.memory_bytes - est.device_total_bytes
    if not fits_on_card(est.device_total_bytes, gpu.memory_bytes):
        if free == 0:
            return "[red]does not fit[/] (no headroom: the card is full)"
        return f"[red]does not fit[/] (short by {_amount(-free)})"
    if free < DEFAULT_HEADROOM_BYTES:
        return (
            f"[yellow]fits, with less than the {gib(DEFAULT_HEADROOM_BYTES)} headroom "
            f"`plan` keeps[/] (headroom {_amount(free)})"
        )
    return f"[green]fits[/] (headroom {_amount(free)})"


def _amount(num_bytes: int) -> str:
    """A positive amount that never prints as zero: GiB, else MiB, else bytes."""
    if num_bytes >= BYTES_IN_GIB // 100:
        return gib(num_bytes)
    if num_bytes >= BYTES_IN_MIB:
        return f"{num_bytes / BYTES_IN_MIB:.1f} MiB"
    return f"{num_bytes:,} B"


def technique_flags(p: Plan) -> str:
    """The flags that switch on what the plan's techniques changed in the setup, for the
    `batchfit estimate` line that reproduces its figures (``""`` without techniques)."""
    if not p.techniques:
        return ""
    s, base = p.setup, TrainingSetup()
    flags = [f"--framework {s.framework}"] if s.framework else []
    if s.grad_ckpt_every is not None:
        flags.append(f"--grad-ckpt-every {s.grad_ckpt_every}")
    elif s.grad_ckpt:
        flags.append("--grad-ckpt")
    if s.loss != base.loss:
        flags.append(f"--loss {s.loss_label}")
    for name, value, default in (
        ("--method", s.method, base.method),
        ("--precision", s.precision, base.precision),
        ("--optimizer", s.optimizer, base.optimizer),
        ("--optimizer-impl", s.optimizer_impl, base.optimizer_impl),
        ("--sharding", s.sharding, base.sharding),
        ("--offload", s.offload, base.offload),
    ):
        if value != default:
            flags.append(f"{name} {value}")
    return "".join(" " + f for f in flags)


def plan(p: Plan, info: ModelInfo) -> None:
    est = p.estimate
    out.print(
        f"[bold]{escape(info.name)}[/] on {p.num_gpus} x [bold]{p.gpu}[/], "
        f"{sample_size(p.seq_len, p.is_image)}"
    )
    tokens = f" = {p.tokens_per_step:,} tokens per step" if p.tokens_per_step is not None else ""
    out.print(
        f"  micro-batch [bold]{p.micro_batch_size}[/] x accumulation "
        f"[bold]{p.grad_accum_steps}[/] x GPUs [bold]{p.num_gpus}[/] = global batch "
        f"[bold]{p.global_batch_size:,}[/] samples{tokens}"
    )
    if p.max_micro_batch == 0:
        out.print("  largest micro-batch that fits: [red]none[/]")
    elif p.max_micro_batch > p.micro_batch_size:
        out.print(
            f"  largest micro-batch that fits: {p.max_micro_batch} (the chosen "
            f"{p.micro_batch_size} divides the {p.global_batch_size // p.num_gpus} "
            "samples each GPU takes per step)"
        )
    elif p.max_micro_batch == p.global_batch_size // p.num_gpus:
        out.print(
            f"  largest micro-batch that fits: {p.max_micro_batch} (all the samples each GPU "
            "takes per step; the search stops there)"
        )
    else:
        out.print(f"  largest micro-batch that fits: {p.max_micro_batch}")
    if p.learning_rate is not None:
        out.print(
            f"  learning rate: [bold]{p.learning_rate:.3g}[/] ({escape(p.lr_rule or '')}; valid "
            "below the critical batch size)"
        )
        for line in p.lr_scaling.lines() if p.lr_scaling else []:
            out.print(f"    {escape(line)}")
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
    if p.num_gpus > 1 and p.setup.sharding in ("none", "ddp"):
        out.print("  sharding: none (DDP: every GPU holds the whole model and optimizer)")
    time_line(p.speed_json(), "  ", p.throughput.source if p.throughput else None)
    if p.train_seconds is not None:
        cost = (
            f", ${p.cost_usd:,.{0 if p.cost_usd >= 100 else 2}f} at ${p.gpu_hour_price:g}/GPU-hour "
            f"({escape(p.price_source)})"
            if p.cost_usd and p.price_source
            else ""
            if p.gpu_hour_price
            else f" (no list price for {p.gpu} in the table: --gpu-hour-price USD adds the cost)"
        )
        out.print(
            f"  the run: {p.train_steps:,} optimizer step{'s' if p.train_steps != 1 else ''}, "
            f"~{human_duration(p.train_seconds)} on "
            f"{p.num_gpus} GPU{'s' if p.num_gpus > 1 else ''}{cost} (predicted)"
        )
        if p.setup.method == "full" and p.task == "causal-lm" and p.tokens_per_step:
            tokens = human_count((p.train_steps or 0) * p.tokens_per_step)
            out.print(
                f"  pre-training? `batchfit batch-size {escape(p.model.removeprefix('generic-'))} "
                f"--train-tokens {tokens} -s {p.seq_len}`: the batch published laws recommend"
            )
    free = p.headroom_bytes
    out.print(
        f"  memory: {gib(est.device_total_bytes)} of {gib(p.gpu_bytes)} "
        f"({'headroom' if free >= 0 else 'short by'} {gib(abs(free))}; "
        f"asked for {gib(p.headroom_wanted_bytes)})"
    )
    same = (
        f"batchfit estimate ... -b {p.micro_batch_size} --grad-accum {p.grad_accum_steps}"
        + technique_flags(p)
    )
    if est.engine == "trace":
        out.print(f"  engine: trace (dry runs of the step; `{same}` gives these figures)")
    else:
        out.print(f"  engine: [yellow]analytic[/] (formulas; `{same} --engine analytic`)")
    out.print(_breakdown(est, f"Memory per GPU at micro-batch {p.micro_batch_size}"))
    if p.alternatives:
        how = (
            "; trace engine: each peak moment's line through micro-batch 1 and 2, then "
            "traced at that size (searched again where it did not fit)"
            if est.engine == "trace"
            else ""
        )
        timed = any(a.step_seconds for a in p.alternatives)
        order = "exact first, then by s / step" if timed else "exact rungs first"
        table = Table(title=f"Alternatives ({order}{how})", title_justify="left")
        table.add_column("techniques", overflow="fold")
        table.add_column("kind", overflow="fold")
        table.add_column("largest micro-batch", justify="right")
        table.add_column("GiB at that size", justify="right")
        steps, price = p.train_steps, p.gpu_hour_price
        if timed:
            table.add_column("timed at", justify="right")
            table.add_column("s / step", justify="right")
            table.add_column("tokens/s/GPU", justify="right")
            if steps:
                table.add_column("run", justify="right")
            if steps and price is not None:
                table.add_column("cost", justify="right")
        per_gpu = p.global_batch_size // p.num_gpus
        # mark the rows the formulas answered, when the trace answered any (it was asked for)
        traced = est.engine == "trace" or any(a.engine == "trace" for a in p.alternatives)
        for alt in ranked(p.alternatives):
            kinds = {t.kind for t in alt.techniques}
            step = alt.step_seconds
            run = step * steps if step and steps else None
            cells = [
                f"{alt.micro_batch_size} x {per_gpu // alt.micro_batch_size}"
                if step and alt.micro_batch_size
                else "-",
                f"{step:.3g}" if step else "-",
                f"{alt.tokens_per_s_per_gpu:,.0f}" if alt.tokens_per_s_per_gpu else "-",
            ]
            if steps:
                cells.append(human_duration(run) if run else "-")
            if steps and price is not None:
                cells.append(f"${run / 3600 * p.num_gpus * price:,.0f}" if run else "-")
            table.add_row(
                _rung_name(alt, p.num_gpus)
                + (" (analytic)" if traced and alt.engine == "analytic" else "")
                + (" *" if alt.techniques == p.techniques else ""),
                "changes-training" if "changes-training" in kinds else "exact",
                str(alt.max_micro_batch) if alt.max_micro_batch else "[red]none[/]",
                gib_figure(alt.device_total_bytes),
                *(cells if timed else ()),
            )
        out.print(table)
        if timed:
            marked = any(a.techniques == p.techniques for a in p.alternatives)
            out.print(
                ("* the plan" if marked else "the plan is the setup as given (no row)")
                + "; each row is timed at the largest micro-batch that divides the per-GPU "
                "batch (timed at)" + ("; run and cost for the whole run" if steps else "")
            )
        if traced and any(alt.engine == "analytic" for alt in p.alternatives):
            out.print("(analytic): the trace cannot run this setup yet; the formulas answered")
        if any(alt.throughput_source for alt in p.alternatives):
            out.print(
                "s / step: corrected by --throughput-from (the model x the probe's "
                "measured/predicted ratio at the nearest micro-batch it timed; --json gives "
                "each row's throughput_source)"
            )
    if p.gpu_counts:
        _gpu_counts(p)
    _warn(p.warnings)


def ranked(alternatives: tuple[Alternative, ...]) -> list[Alternative]:
    """Exact options first, then those that change training; in each, the timed ones fastest
    first, then the rest in the ladder's order."""
    order = {id(a): i for i, a in enumerate(alternatives)}
    return sorted(
        alternatives,
        key=lambda a: (
            any(t.kind != "exact" for t in a.techniques),
            not a.step_seconds,
            a.step_seconds or 0.0,
            order[id(a)],
        ),
    )


def _rung_name(alt: Alternative, num_gpus: int) -> str:
    """An alternative's techniques; on several GPUs without sharding, named DDP (else a row
    of 'fused-loss' alone would not say how the GPUs share the work)."""
    name = " + ".join(t.name for t in alt.techniques)
    if num_gpus > 1 and alt.setup.sharding in ("none", "ddp"):
        return f"ddp + {name}" if name else "ddp"
    return name


def _gpu_counts(p: Plan) -> None:
    """``--num-gpus auto``: each count's plan in one row, the chosen one marked."""
    run = any(c.train_seconds for c in p.gpu_counts)
    cost = any(c.cost_usd for c in p.gpu_counts)
    table = Table(title="GPU counts (--num-gpus auto)", title_justify="left")
    for name in ("GPUs", "micro x accum", "s/step", "tokens/s/GPU", "eff."):
        table.add_column(name, justify="right", no_wrap=True)
    if run:
        table.add_column("run", justify="right", no_wrap=True)
    if cost:
        table.add_column("cost", justify="right", no_wrap=True)
    for c in p.gpu_counts:
        if not c.micro_batch_size:
            table.add_row(str(c.num_gpus), *["-"] * (4 + run + cost))
            continue
        table.add_row(
            f"[bold]{c.num_gpus}[/] *" if c.chosen else str(c.num_gpus),
            f"{c.micro_batch_size} x {c.grad_accum_steps}" if c.fits else "[red]none fits[/]",
            f"{c.step_seconds:.3g}" if c.step_seconds else "-",
            f"{c.tokens_per_s_per_gpu:,.0f}" if c.tokens_per_s_per_gpu else "-",
            f"{c.efficiency:.0%}" if c.efficiency is not None else "-",
            *([human_duration(c.train_seconds) if c.train_seconds else "-"] if run else []),
            *([f"${c.cost_usd:,.0f}" if c.cost_usd else "-"] if cost else []),
        )
    out.print(table)
    # the techniques below the table, a line each: the figures above stay whole on any width
    for c in p.gpu_counts:
        what = c.note if not c.micro_batch_size else " + ".join(c.techniques) or "nothing extra"
        out.print(f"  {c.num_gpus} GPU{'s' if c.num_gpus > 1 else ''}: {escape(what)}")
    out.print(f"* {escape(p.gpu_count_rule or '')}; eff. = tokens/s per GPU over the best count's")


@contextlib.contextmanager
def on_stderr() -> Iterator[None]:
    """Print what would go to stdout on stderr instead (stdout kept for one file's text)."""
    global out
    kept, out = out, err
    try:
        yield
    finally:
        out = kept


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
            # convnets have no heads; Swin's differ by stage
            "-"
            if i.arch.model_type in _NO_HEAD_COUNT
            else f"{i.arch.num_heads}/{i.arch.num_kv_heads}",
            f"{i.arch.vocab_size:,}" if i.arch.vocab_size else "-",
            str(i.arch.max_positions or "-"),
        ]
        for i in infos
    ]
    out.print(_plain_table("Catalog models (offline configs)", columns, rows, "hub id"))


_NO_HEAD_COUNT = ATTENTION_FREE_TYPES | {"swin", "swinv2"}


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


def sample_size(size: int, image: bool) -> str:
    """One sample's size as the options spell it: ``seq 512`` or ``image 224 px``."""
    return f"image {size} px" if image else f"seq {size}"


def fit_table(info: ModelInfo, seq_len: int, rows: list[FitRow], engine: str) -> None:
    table = Table(
        title=f"{escape(info.name)}, {sample_size(seq_len, info.task == 'image-classification')}: "
        "largest micro-batch per GPU "
        f"({engine} engine; no gradient accumulation)",
        title_justify="left",
    )
    columns = ("GPU", "GiB", "precision", "largest micro-batch", "GiB used", "h / 1B tokens")
    for col in (*columns, "setup (techniques)"):
        table.add_column(
            col,
            justify="right" if col in columns[1:] and col != "precision" else "left",
            no_wrap=col == "GPU",
            min_width=max(len(r.gpu.name) for r in rows) if col == "GPU" else None,
            overflow="fold",
        )
    for r in rows:
        needs = (
            ", ".join(f"{t.name}" + ("*" if t.kind != "exact" else "") for t in r.techniques)
            or "as given"
        )
        if r.note:
            needs = f"cannot run: {r.note}"
        elif r.engine != engine:
            needs += " (analytic)"
        if r.precision in ("bf16", "amp-bf16") and not r.gpu.bf16:
            needs += " (no native bf16 on this GPU)"
        table.add_row(
            r.gpu.name,
            gib_figure(r.gpu.memory_bytes),
            r.precision,
            str(r.max_micro_batch) if r.max_micro_batch else "[red]none[/]",
            "-" if r.note else gib_figure(r.device_total_bytes),
            "-"
            if r.seconds_per_billion_tokens is None
            else f"{r.seconds_per_billion_tokens / 3600:,.1f}",
            needs,
        )
    out.print(table)
    if any(r.seconds_per_billion_tokens for r in rows):
        out.print(
            "h / 1B tokens: one GPU at the largest micro-batch in the row's setup, the optimizer "
            "step spread over a 1M-token batch (predicted; batchfit.speed)"
        )
    out.print(f"{FIT_RULE}; options within {TIME_TOLERANCE:.0%} tie, the fewer techniques win")
    if any(t.kind != "exact" for r in rows for t in r.techniques):
        out.print("* changes what is learned; the others are exact")
    if any(r.engine != engine for r in rows):
        out.print("(analytic): the trace cannot run this setup yet; the formulas answered")
