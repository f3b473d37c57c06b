"""Rendering of ``batchfit plan``: the plan's lines, its memory breakdown, the alternatives
table, the GPU counts (``--num-gpus auto``), where an export went, and the ``--report`` page."""

from __future__ import annotations

import os
import re
import tempfile
from dataclasses import replace
from pathlib import Path

from rich.markup import escape
from rich.table import Table

from batchfit._units import gib, gib_figure, human_count, human_duration, ordinal, usd
from batchfit.cli import render
from batchfit.cli.render.estimate import learned_source, print_breakdown, time_line
from batchfit.cli.render.layout import Column, fitted_table, print_table
from batchfit.errors import UsageError
from batchfit.hardware import GpuSpec
from batchfit.memory.trace.timeline import step_timeline
from batchfit.models import ModelInfo, default_task
from batchfit.plan import PRUNE_MARGIN, Alternative, Plan
from batchfit.spec import TrainingSetup
from batchfit.views import html as _html
from batchfit.views import plots as _plots
from batchfit.views import timeline as tl


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
    """The plan for people: its lines, then the tables, then the warnings on stderr."""
    _batch_lines(p, info)
    _learning_rate(p)
    _to_fit(p)
    if p.num_gpus > 1 and p.setup.sharding in ("none", "ddp"):
        render.line("  sharding: none (DDP: every GPU holds the whole model and optimizer)")
    source = None
    if p.throughput is not None:
        source = f"--throughput-from: {p.throughput.source}"
    elif p.learned_time is not None:
        source = learned_source(p.learned_time)
    time_line(p.speed_json(), "  ", source, image=p.is_image)
    if p.train_seconds is not None:
        _the_run(p, p.train_seconds)
    _memory_and_engine(p)
    print_breakdown(p.estimate, f"Memory per GPU at micro-batch {p.micro_batch_size}")
    for note in p.estimate.extras.get("notes", []):  # what the dry run leaves out, as estimate says
        render.line(f"note: {escape(note)}")
    if p.alternatives:
        _alternatives(p)
    if p.gpu_counts:
        _gpu_counts(p)
    render.warn(p.warnings)


def _batch_lines(p: Plan, info: ModelInfo) -> None:
    """The model, GPUs and precision, micro-batch x accumulation x GPUs, and the largest that
    fits."""
    # a task other than the config's own is part of the question (`--task` in its estimate)
    task = f" ({info.task})" if info.task != default_task(info.config) else ""
    # LoRA and QLoRA train other parameters: said where the precision is
    method = f", {p.setup.method} r{p.setup.lora_rank}" if p.setup.is_lora else ""
    render.line(
        f"[bold]{escape(info.name)}[/]{task} on {p.num_gpus} x [bold]{p.gpu}[/], "
        f"{render.sample_size(p.seq_len, p.is_image)}, {p.setup.precision}{method}"
    )
    tokens = f" = {p.tokens_per_step:,} tokens per step" if p.tokens_per_step is not None else ""
    if p.lengths is not None and p.lengths.padding == "longest" and p.tokens_per_step:
        mean = f"{p.tokens_per_step:,} tokens per step"
        tokens = f" ~ {mean} (the samples' mean, padding not counted)"
    render.line(
        f"  micro-batch [bold]{p.micro_batch_size}[/] x accumulation "
        f"[bold]{p.grad_accum_steps}[/] x GPUs [bold]{p.num_gpus}[/] = global batch "
        f"[bold]{p.global_batch_size:,}[/] samples{tokens}"
    )
    if p.max_micro_batch == 0:
        render.line("  largest micro-batch that fits: [red]none[/]")
    elif p.max_micro_batch > p.micro_batch_size:
        render.line(
            f"  largest micro-batch that fits: {p.max_micro_batch} (the chosen "
            f"{p.micro_batch_size} divides the {p.per_gpu_batch:,} "
            "samples each GPU takes per step)"
        )
    elif p.max_micro_batch == p.per_gpu_batch:
        render.line(
            f"  largest micro-batch that fits: {p.max_micro_batch} (all the samples each GPU "
            "takes per step; the search stops there)"
        )
    else:
        render.line(f"  largest micro-batch that fits: {p.max_micro_batch}")


def _learning_rate(p: Plan) -> None:
    if p.learning_rate is None:
        return
    render.line(
        f"  learning rate: [bold]{p.learning_rate:.3g}[/] ({escape(p.lr_rule or '')}; valid "
        "below the critical batch size)"
    )
    for line in p.lr_scaling.lines() if p.lr_scaling else []:
        render.line(f"    {escape(line)}")


def _to_fit(p: Plan) -> None:
    if p.techniques:
        named = ", ".join(
            f"{t.name} [{'green' if t.kind == 'exact' else 'yellow'}]({t.kind})[/]"
            for t in p.techniques
        )
        render.line(f"  to fit: {named}")
    elif p.max_micro_batch == 0:
        render.line("  to fit: [red]no technique on the ladder is enough[/] (see the warning)")
    else:
        render.line("  to fit: nothing extra needed")


def _the_run(p: Plan, train_seconds: float) -> None:
    """``--train-tokens`` or ``--epochs``: the run's steps, time and cost."""
    cost = (
        f", {usd(p.cost_usd)} at ${p.gpu_hour_price:g}/GPU-hour ({escape(p.price_source)})"
        if p.cost_usd and p.price_source
        else ""
        if p.gpu_hour_price
        else f" (no list price for {p.gpu} in the table: --gpu-hour-price USD adds the cost)"
    )
    render.line(
        f"  the run: {p.train_steps:,} optimizer step{'s' if p.train_steps != 1 else ''}, "
        f"~{human_duration(train_seconds)} on "
        f"{p.num_gpus} GPU{'s' if p.num_gpus > 1 else ''}{cost} (predicted)"
    )
    if p.setup.method == "full" and p.task == "causal-lm" and p.tokens_per_step:
        tokens = human_count((p.train_steps or 0) * p.tokens_per_step)
        render.line(
            f"  pre-training? `batchfit batch-size {escape(p.model.removeprefix('generic-'))} "
            f"--train-tokens {tokens} -s {p.seq_len}`: the batch published laws recommend"
        )


def _memory_and_engine(p: Plan) -> None:
    est, free = p.estimate, p.headroom_bytes
    render.line(
        f"  memory: {gib(est.device_total_bytes)} of {gib(p.gpu_bytes)} "
        f"({'headroom' if free >= 0 else 'short by'} {gib(abs(free))}; "
        f"asked for {gib(p.headroom_wanted_bytes)})"
    )
    task = f" --task {p.setup.task}" if p.setup.task else ""
    flags = technique_flags(p)
    if p.setup.method != "full" and "--method" not in flags:  # asked for, not a technique
        flags = f" --method {p.setup.method}{flags}"
    same = (
        f"batchfit estimate ...{task} -b {p.micro_batch_size} --grad-accum {p.grad_accum_steps}"
        + flags
    )
    if est.engine == "trace":
        render.line(f"  engine: trace (dry runs of the step; `{same}` gives these figures)")
    else:
        render.line(f"  engine: [yellow]analytic[/] (formulas; `{same} --engine analytic`)")


def _alternatives(p: Plan) -> None:
    """The ladder's options, exact first, and the notes that explain the table."""
    timed = any(a.step_seconds for a in p.alternatives)
    # the trace engine was asked: the rows it left to the formulas are marked
    traced = p.estimate.engine == "trace" or any(
        a.engine == "trace" or a.beyond_reach for a in p.alternatives
    )
    table, left_out = _alternatives_table(p, timed, traced)
    print_table(render.out, table, left_out)
    steps = p.train_steps
    if any(t.kind != "exact" for a in p.alternatives for t in a.techniques):
        render.line("* changes what is learned; the others are exact")
    if timed:  # which row is the plan's, then what the time columns say: two lines
        marked = any(a.techniques == p.techniques for a in p.alternatives)
        render.line(
            "(plan): the plan's setup" if marked else "the plan is the setup as given (no row)"
        )
        render.line(
            "each row is timed at the largest micro-batch that divides the per-GPU batch"
            + ("" if "timed at" in left_out else " (timed at)")
            + ("; run and cost for the whole run" if steps else "")
        )
    for need in _merged_needs([need for a in p.alternatives for need in a.needs]):
        # what the config cannot switch on: offered, never chosen
        render.line(f"(needs code): never chosen; it needs {escape(need)}")
    if traced and any(alt.engine == "analytic" and not alt.beyond_reach for alt in p.alternatives):
        render.line("(analytic): the trace cannot run this setup yet; the formulas answered")
    if any(alt.beyond_reach for alt in p.alternatives):
        render.line(
            f"(formulas): not traced: the formulas put micro-batch 1 over {PRUNE_MARGIN:.0%} "
            "past the card, so it cannot fit; the figure is theirs"
        )
    if any(alt.throughput_source for alt in p.alternatives):
        render.line(
            "s / step: corrected by --throughput-from (the model x the probe's "
            "measured/predicted ratio at the nearest micro-batch it timed; --json gives "
            "each row's throughput_source)"
        )


# The alternatives' columns; on a narrow terminal the kind goes first (the * marks say it),
# then the micro-batch each row is timed at, tokens/s/GPU, the run's length, its cost.
_KIND = Column("kind", leave_out=1)
_TIMED = (
    Column("timed at", right=True, wrap=False, leave_out=2),
    Column("s / step", right=True),
    Column("tokens/s/GPU", right=True, leave_out=3),
)
_RUN = Column("run", right=True, wrap=False, leave_out=4)
_COST = Column("cost", right=True, wrap=False, leave_out=5)


def _alternatives_table(p: Plan, timed: bool, traced: bool) -> tuple[Table, list[str]]:
    how = ""
    if p.estimate.engine == "trace":
        how = "; trace engine: searched from the formulas' size" + (
            ", traced until one fits that the traced slope says is the last; ≥: the size "
            "after it not traced (--alternatives traced traces it)"
            if any(alt.from_lines for alt in p.alternatives)
            else ", traced at the answer and the size after it"
        )
    order = "exact first, then by s / step" if timed else "exact rungs first"
    per_gpu = p.per_gpu_batch
    if any(alt.max_micro_batch == per_gpu for alt in p.alternatives):
        how += (
            f"; (batch): all {per_gpu:,} samples a GPU takes per step fit, no larger size searched"
        )
    steps, price = p.train_steps, p.gpu_hour_price
    columns = [
        Column("techniques", want=24),
        _KIND,
        Column("largest micro-batch", right=True),
        Column("GiB at that size", right=True),
        *((*_TIMED[:2], _throughput_column(p, _TIMED[2])) if timed else ()),
        *((_RUN,) if timed and steps else ()),
        *((_COST,) if timed and steps and price is not None else ()),
    ]
    rows: list[list[str] | None] = []
    for alt in ranked(p.alternatives):
        kinds = {t.kind for t in alt.techniques}
        mark = "≥" if alt.from_lines else ""  # the size after it was not traced
        rows.append(
            [
                _rung_name(alt, p.num_gpus, marked=True)
                + _html.engine_mark(alt.engine, alt.beyond_reach, traced)
                + (" (needs code)" if alt.needs else "")
                + (" (plan)" if alt.techniques == p.techniques else ""),
                "changes-training" if "changes-training" in kinds else "exact",
                _largest(alt, mark, per_gpu),
                gib_figure(alt.device_total_bytes),
                *(_timed_cells(p, alt) if timed else ()),
            ]
        )
    return fitted_table(render.out, f"Alternatives ({order}{how})", columns, rows)


def _largest(alt: Alternative, mark: str, per_gpu: int) -> str:
    """An alternative's largest micro-batch: ``≥`` where the size after it was not traced,
    ``(batch)`` where the search stopped at the per-GPU batch."""
    if not alt.max_micro_batch:
        return "[red]none[/]"
    return f"{mark}{alt.max_micro_batch}" + (" (batch)" if alt.max_micro_batch == per_gpu else "")


def _throughput_column(p: Plan, column: Column) -> Column:
    """The throughput column: an image model's counts images."""
    return replace(column, header="images/s/GPU") if p.is_image else column


def _timed_cells(p: Plan, alt: Alternative) -> list[str]:
    """An alternative's timing columns: timed at, s / step, tokens/s/GPU, and the run's."""
    steps, price = p.train_steps, p.gpu_hour_price
    per_gpu = p.per_gpu_batch
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
        cells.append(usd(run / 3600 * p.num_gpus * price) if run else "-")
    return cells


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


def _rung_name(alt: Alternative, num_gpus: int, marked: bool = False) -> str:
    """An alternative's techniques; on several GPUs without sharding, named DDP (else a row
    of 'fused-loss' alone would not say how the GPUs share the work). ``marked``: a * after
    each technique that changes what is learned, as ``gpus`` marks them."""
    name = " + ".join(
        t.name + ("*" if marked and t.kind != "exact" else "") for t in alt.techniques
    )
    if num_gpus > 1 and alt.setup.sharding in ("none", "ddp"):
        return f"ddp + {name}" if name else "ddp"
    return name


def _gpu_counts(p: Plan) -> None:
    """``--num-gpus auto``: each count's plan in one row, the chosen one marked."""
    run = any(c.train_seconds for c in p.gpu_counts)
    cost = any(c.cost_usd for c in p.gpu_counts)
    columns = [
        Column("GPUs", right=True, wrap=False),
        Column("micro x accum", right=True, wrap=False),
        Column("s/step", right=True),
        Column("tokens/s/GPU", right=True, leave_out=1),
        Column("eff.", right=True),
        *([Column("run", right=True, wrap=False)] if run else []),
        *([Column("cost", right=True, wrap=False)] if cost else []),
    ]
    rows: list[list[str] | None] = []
    for c in p.gpu_counts:
        if not c.micro_batch_size:
            rows.append([str(c.num_gpus), *["-"] * (4 + run + cost)])
            continue
        rows.append(
            [
                f"[bold]{c.num_gpus}[/] *" if c.chosen else str(c.num_gpus),
                f"{c.micro_batch_size} x {c.grad_accum_steps}" if c.fits else "[red]none fits[/]",
                f"{c.step_seconds:.3g}" if c.step_seconds else "-",
                f"{c.tokens_per_s_per_gpu:,.0f}" if c.tokens_per_s_per_gpu else "-",
                f"{c.efficiency:.0%}" if c.efficiency is not None else "-",
                *([human_duration(c.train_seconds) if c.train_seconds else "-"] if run else []),
                *([usd(c.cost_usd) if c.cost_usd else "-"] if cost else []),
            ]
        )
    title = "GPU counts (--num-gpus auto)"
    print_table(render.out, *fitted_table(render.out, title, columns, rows))
    # the techniques below the table, a line each: the figures above stay whole on any width
    for c in p.gpu_counts:
        what = c.note if not c.micro_batch_size else " + ".join(c.techniques) or "nothing extra"
        render.line(f"  {c.num_gpus} GPU{'s' if c.num_gpus > 1 else ''}: {escape(what)}")
    render.line(
        f"* {escape(p.gpu_count_rule or '')}; eff. = each count's tokens/s per GPU over "
        "the best count's"
    )


def write_report(result: Plan, info: ModelInfo, gpu: GpuSpec, path: Path) -> None:
    """``plan --report``: the page, with the chosen setup's traced step drawn in it (a dry run
    of the whole model) when the trace engine answered."""
    png = None
    est = result.estimate
    if est.engine == "trace" and not est.is_image:
        _plots.require("--report")
        png = _report_timeline(result, info, gpu)
    page = _html.report_page(result.to_json(), png)
    tmp_path = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp_path.write_text(page)
        os.replace(tmp_path, path)
    except OSError as e:
        raise UsageError(f"cannot write --report {path}: {e.strerror}") from None
    finally:
        if tmp_path.exists():
            tmp_path.unlink()
    render.wrote(path, "the plan's report")


def _report_timeline(result: Plan, info: ModelInfo, gpu: GpuSpec) -> bytes:
    """The report's picture: the plan's step, traced whole, as PNG bytes."""
    est = result.estimate
    with render.progress("dry run of the whole step for the report ..."):
        drawn = step_timeline(
            info,
            est.setup,
            micro_batch_size=est.micro_batch_size,
            seq_len=est.seq_len,
            device="cuda",
            gpu=gpu,
            grad_accum_steps=result.grad_accum_steps,
        )
    with tempfile.TemporaryDirectory() as tmp:
        picture = Path(tmp) / "timeline.png"
        accum = result.grad_accum_steps
        title = (
            f"{info.name}: micro-batch {est.micro_batch_size} x {est.seq_len}"
            + (f", accumulation {accum}" if accum > 1 else "")
            + f", {est.setup.precision}, on {gpu.name}"
        )
        tl.plot(drawn, picture, title, gpu.memory_bytes, est.peak_bytes)
        return picture.read_bytes()


def _merged_needs(needs: list[str]) -> list[str]:
    """Each distinct need once, those that differ only in which layers they wrap (every 2nd,
    3rd, 4th) as one.

    Example:
        >>> _merged_needs(["code: wrap every 3rd layer", "code: wrap every 2nd layer", "x"])
        ['code: wrap every 2nd or 3rd layer', 'x']
    """
    every: dict[str, set[int]] = {}  # each need with its ordinal cut out: the ordinals
    for need in needs:
        found = re.search(r"\bevery (\d+)(?:st|nd|rd|th)\b", need)
        if found is None:
            every.setdefault(need, set())
        else:
            cut = need[: found.start(1)] + "{}" + need[found.end() :]
            every.setdefault(cut, set()).add(int(found.group(1)))
    merged = []
    for need, ks in every.items():
        names = [ordinal(k) for k in sorted(ks)]
        listed = " or ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)
        merged.append(need.format(listed) if ks else need)
    return sorted(merged)
