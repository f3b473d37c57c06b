"""Rendering of ``batchfit estimate``: the setup line, the memory breakdown (``plan`` prints it
too), the verdict on a GPU, the step time, the JSON object, and the ``--timeline`` picture."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from rich.markup import escape

from batchfit._units import BYTES_IN_GIB, BYTES_IN_MIB, gib, gib_figure, human_count
from batchfit.calibration import TimeFactor
from batchfit.cli import render
from batchfit.cli.render.layout import Column, fitted_table, print_table
from batchfit.hardware import GpuSpec
from batchfit.lengths import LengthsSummary
from batchfit.memory.device.totals import fits_on_card
from batchfit.memory.trace.timeline import step_timeline, traced_micro_steps
from batchfit.memory.types import COMPONENTS, MemoryEstimate
from batchfit.models import ATTENTION_FREE_TYPES, ModelInfo
from batchfit.plan import DEFAULT_HEADROOM_BYTES
from batchfit.views import timeline as tl

# The breakdown's columns; below about 100 columns the lines of how each part is counted are
# left out (the parts and their figures stay).
_BREAKDOWN = [
    Column("component"),
    Column("part", want=24),
    Column("GiB", right=True),
    Column("how it is counted", leave_out=1, want=60),
]


def print_breakdown(est: MemoryEstimate, title: str) -> None:
    """The components, each line of how they are counted, the peak and the device total."""
    rows: list[list[str] | None] = []
    for comp in COMPONENTS:
        first = True
        # Trace lines that only restate a component at the peak are shown once, below.
        for line in (
            ln
            for ln in est.lines
            if ln.component == comp and not ln.label.startswith("at the peak")
        ):
            rows.append(
                [
                    comp if first else "",
                    escape(line.label),
                    gib_figure(line.num_bytes),
                    escape(line.formula),
                ]
            )
            first = False
    rows.append(None)
    for comp in COMPONENTS:
        rows.append(
            [
                f"[bold]{comp}[/]",
                f"at the peak ({est.peak_phase})",
                gib_figure(est.components[comp]),
                "",
            ]
        )
    rows.append(None)
    rows += _totals(est)
    print_table(render.out, *fitted_table(render.out, title, _BREAKDOWN, rows))


def _totals(est: MemoryEstimate) -> list[list[str] | None]:
    rows: list[list[str] | None] = [
        [
            "[bold]peak allocated[/]",
            "",
            f"[bold]{gib_figure(est.peak_bytes)}[/]",
            "comparable to torch.cuda.max_memory_allocated"
            if est.device != "cpu"
            else "bytes held by tensors",
        ]
    ]
    if est.device != "cpu":
        rows.append(["reserved", "", gib_figure(est.reserved_bytes), "caching allocator"])
        rows.append(
            [
                "[bold]device total[/]",
                "",
                f"[bold]{gib_figure(est.device_total_bytes)}[/]",
                "what nvidia-smi shows: + CUDA context, NCCL",
            ]
        )
    if est.host_bytes:
        rows.append(
            ["host RAM", "", gib_figure(est.host_bytes), "offloaded state, per GPU process"]
        )
    return rows


def estimate(
    est: MemoryEstimate, info: ModelInfo, gpu: GpuSpec | None, explain: bool = False
) -> None:
    render.line(_setup_line(est, info))
    print_breakdown(
        est, f"Memory per {'GPU' if est.device != 'cpu' else 'process'} ({est.engine} engine)"
    )
    for note in est.extras.get("notes", []):
        render.line(f"note: {escape(note)}")
    if explain:
        _explain(est)
    if gpu is not None:
        render.line(f"{gpu.full_name}: {gib(gpu.memory_bytes)} -> {fit_verdict(est, gpu)}")
        learned = est.extras.get("time_factor")
        source = learned_source(TimeFactor.from_json(learned)) if learned else None
        time_line(est.speed_json(), source=source, image=est.is_image)
    render.warn(est.warnings)


def learned_source(learned: TimeFactor) -> str:
    """Where a time scaled by the user's runs comes from, for the time line."""
    return f"{learned.describe()}: the calibration file; --no-learned-time for the model alone"


def _attention(info: ModelInfo, attention: str) -> str:
    """The attention kernel, for a model that has attention (not a convolutional one)."""
    return "" if info.arch.model_type in ATTENTION_FREE_TYPES else f", attention {attention}"


def _setup_line(est: MemoryEstimate, info: ModelInfo) -> str:
    setup = est.setup
    return (
        f"[bold]{escape(info.name)}[/] on [bold]{est.device}[/], {setup.precision} "
        f"({human_count(est.total_params)} params, {human_count(est.trainable_params)} "
        f"trainable, {info.task}): "
        f"micro-batch {est.micro_batch_size} x {render.sample_size(est.seq_len, est.is_image)}, "
        f"{setup.optimizer}, {setup.method}{_attention(info, setup.attention)}"
        f"{', grad-ckpt' if setup.grad_ckpt else ''}"
        f"{f', {setup.sharding} x {setup.num_gpus}' if setup.sharding != 'none' else ''}"
        f"{f', loss {setup.loss_label}' if setup.loss != 'full' else ''}"
        f"{f', adapters {setup.lora_dtype}' if setup.lora_dtype != 'fp32' else ''}"
        f"{f', frozen base {setup.frozen_dtype}' if setup.frozen_dtype != 'auto' else ''}"
        f"{f', {setup.optimizer_impl} optimizer' if setup.optimizer_impl != 'auto' else ''}"
        f", {setup.loop} loop"
        f"{f', {setup.framework} conventions' if setup.framework else ''}"
    )


def _explain(est: MemoryEstimate) -> None:
    """``--explain``: the modules holding the most activation memory at the peak."""
    top = est.extras.get("top_modules") or []
    if not top:
        render.line("--explain: module attribution comes from the trace engine")
        return
    rows: list[list[str] | None] = [
        [escape(name) or "(model)", gib_figure(num_bytes, 3)] for name, num_bytes in top
    ]
    title = "Activation memory by module at the peak (traced layers)"
    columns = [Column("module"), Column("GiB", right=True)]
    print_table(render.out, *fitted_table(render.out, title, columns, rows))


def time_line(
    speed: dict[str, float | None],
    indent: str = "",
    source: str | None = None,
    *,
    image: bool = False,
) -> None:
    """The step time, when there is one: predicted (``batchfit.speed``), or corrected by
    measured steps as ``source`` says (``plan --throughput-from``, ``--learned-time``). An
    ``image``
    model's throughput counts images; where it has no time (the formulas answered: no dry run
    counted its FLOPs) the line says so rather than leave it out."""
    if speed.get("step_seconds") is None:
        if image:
            render.line(f"{indent}time: not predicted (an image model's FLOPs come from a dry run)")
        return
    parts = []
    if speed.get("comm_seconds"):
        parts.append(f"{speed['comm_seconds']:.2g} s of communication compute does not hide")
    if speed.get("offload_seconds"):
        parts.append(f"{speed['offload_seconds']:.2g} s of CPU offload")
    within = f" (of which {' and '.join(parts)})" if parts else ""
    why = (
        escape(source)
        if source
        else "predicted from the dry run's operators; 9% off at the median on published "
        "image-model runs"
        if image
        else "predicted for the step alone, without data loading, evaluation or logging; "
        "8-16% off at the median on published runs it was not fitted on, up to 30-40% on "
        "some; CPU offload not yet checked on real runs"
    )
    render.line(
        f"{indent}time: ~{speed['step_seconds']:.3g} s per optimizer step{within}, "
        f"{speed['tokens_per_s_per_gpu']:,.0f} {'images' if image else 'tokens'}/s per GPU, MFU "
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


def estimate_json(
    est: MemoryEstimate, gpu: GpuSpec | None, lengths: LengthsSummary | None
) -> dict[str, Any]:
    """``estimate --json``: the estimate, and with a GPU whether it fits there."""
    data = est.to_json()
    if gpu is not None:
        data["gpu_bytes"] = gpu.memory_bytes
        data["headroom_bytes"] = gpu.memory_bytes - est.device_total_bytes
        data["fits"] = fits_on_card(est.device_total_bytes, gpu.memory_bytes)
    if lengths is not None:
        data["lengths"] = lengths.to_json(est.micro_batch_size)
    return data


def draw_timeline(
    est: MemoryEstimate,
    info: ModelInfo,
    gpu: GpuSpec | None,
    grad_accum: int,
    png: Path | None,
    pickle_path: Path | None,
) -> None:
    """``--timeline`` / ``--snapshot``: a dry run of the whole step, drawn and written."""
    device: Literal["cpu", "cuda"] = "cpu" if est.device == "cpu" else "cuda"
    with render.progress(f"dry run of the whole step for {png or pickle_path} ..."):
        drawn = step_timeline(
            info,
            est.setup,
            micro_batch_size=est.micro_batch_size,
            seq_len=est.seq_len,
            device=device,
            gpu=gpu,
            grad_accum_steps=grad_accum,
        )
    title = (
        f"{info.name}: micro-batch {est.micro_batch_size} x {est.seq_len}"
        + (f", accumulation {grad_accum}" if grad_accum > 1 else "")
        + (
            f" ({traced_micro_steps(grad_accum)} drawn; the rest repeat the 2nd)"
            if grad_accum > traced_micro_steps(grad_accum)
            else ""
        )
        + f", {est.setup.precision}, on {gpu.name if gpu else device}"
    )
    if png is not None:
        tl.plot(drawn, png, title, gpu.memory_bytes if gpu else None, est.peak_bytes)
        render.wrote(png, "the step's memory timeline")
    if pickle_path is not None:
        tl.write_snapshot(drawn, pickle_path, device)
        render.wrote(pickle_path, "a PyTorch memory snapshot: pytorch.org/memory_viz")
