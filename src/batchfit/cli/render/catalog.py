"""Rendering of ``batchfit models`` and ``batchfit gpus``: the catalog tables, their JSON rows,
and what fits on each GPU (``gpus MODEL``)."""

from __future__ import annotations

from typing import Any

from rich.markup import escape
from rich.table import Table

from batchfit._units import gib_figure, human_count
from batchfit.cli import render
from batchfit.cli.render.layout import Column, fitted_table, print_table
from batchfit.hardware import GpuSpec
from batchfit.models import ATTENTION_FREE_TYPES, ModelInfo
from batchfit.plan import FIT_RULE, TIME_TOLERANCE, FitRow


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
    title: str, columns: list[tuple[str, bool]], rows: list[list[str]], optional: list[str]
) -> None:
    """A table whose cells never wrap, printed; on narrow terminals the ``optional`` columns
    are left out in that order until it fits, and named below it (``--json`` has everything),
    so names people type next are never cut."""
    widths = [max(len(h), *(len(r[k]) for r in rows)) for k, (h, _) in enumerate(columns)]
    keep = list(range(len(columns)))
    for header in optional:
        if sum(widths[k] for k in keep) + 3 * len(keep) + 1 <= render.out.width:
            break
        keep.remove(next(k for k, (h, _) in enumerate(columns) if h == header))
    table = Table(title=title, title_justify="left")
    for k in keep:
        header, right = columns[k]
        table.add_column(
            header, justify="right" if right else "left", no_wrap=True, min_width=widths[k]
        )
    for row in rows:
        table.add_row(*(row[k] for k in keep))
    print_table(render.out, table, [h for k, (h, _) in enumerate(columns) if k not in keep])


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
            f"{i.arch.max_positions:,}" if i.arch.max_positions else "-",
        ]
        for i in infos
    ]
    # on a narrow terminal: what a name says already, then what the formulas need least
    dropped = ["hub id", "type", "positions", "heads/kv", "vocab"]
    _plain_table("Catalog models (offline configs)", columns, rows, dropped)


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
        ("full name", False),
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
    _plain_table(title, columns, rows, ["full name", "arch", "CC", "fp8"])


# `gpus MODEL`'s columns; on a narrow terminal the card's memory ("card GiB", apart from the
# GiB used) goes first, then the memory used, then the hours per billion tokens (the GPU, its
# precision, its micro-batch and the techniques stay).
_FIT_COLUMNS = [
    Column("GPU"),
    Column("card GiB", right=True, leave_out=1),
    Column("precision"),
    Column("largest micro-batch", right=True),
    Column("GiB used", right=True, leave_out=2),
    Column("h / 1B tokens", right=True, leave_out=3),
    Column("setup (techniques)", want=24),
]


def fit_table(info: ModelInfo, seq_len: int, rows: list[FitRow], engine: str) -> None:
    """``gpus MODEL``: the largest micro-batch on each GPU, with the rule each row follows."""
    image = info.task == "image-classification"
    title = (
        f"{escape(info.name)}, {render.sample_size(seq_len, image)}: largest micro-batch per "
        f"GPU ({engine} engine; no gradient accumulation)"
    )
    cells: list[list[str] | None] = []
    for r in rows:
        mark = "≥" if r.from_lines else ""  # the size after it was not traced
        cells.append(
            [
                r.gpu.name,
                gib_figure(r.gpu.memory_bytes),
                r.precision,
                f"{mark}{r.max_micro_batch}" if r.max_micro_batch else "[red]none[/]",
                "-" if r.note else gib_figure(r.device_total_bytes),
                "-"
                if r.seconds_per_billion_tokens is None
                else f"{r.seconds_per_billion_tokens / 3600:,.1f}",
                _needs(r, engine),
            ]
        )
    print_table(render.out, *fitted_table(render.out, title, _FIT_COLUMNS, cells))
    _fit_notes(rows, engine)


def fit_json(info: ModelInfo, seq_len: int, rows: list[FitRow], engine: str) -> dict[str, Any]:
    """``gpus MODEL --json``: the sample's size, the engine that answered, and each GPU's row."""
    return {
        "model": info.name,
        **(
            {"seq_len": None, "image_size": seq_len}
            if info.task == "image-classification"
            else {"seq_len": seq_len}
        ),
        "engine": engine,
        "grad_accum_steps": 1,
        "gpus": [r.to_json() for r in rows],
    }


def _needs(r: FitRow, engine: str) -> str:
    """A row's last column: the techniques it needs, or why it cannot run."""
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
    return needs


def _fit_notes(rows: list[FitRow], engine: str) -> None:
    if any(r.seconds_per_billion_tokens for r in rows):
        render.line(
            "h / 1B tokens: one GPU at the largest micro-batch in the row's setup, the optimizer "
            "step spread over a 1M-token batch (predicted; batchfit.speed)"
        )
    render.line(f"{FIT_RULE}; options within {TIME_TOLERANCE:.0%} tie, the fewer techniques win")
    if any(t.kind != "exact" for r in rows for t in r.techniques):
        render.line("* changes what is learned; the others are exact")
    if any(r.engine != engine for r in rows):
        render.line("(analytic): the trace cannot run this setup yet; the formulas answered")
    if any(r.from_lines for r in rows):
        render.line(
            "≥: each peak moment's line through traced micro-batch 1 and 2 gave the size, "
            "sized to fit by the dry runs (from two traced sizes' allocation histories where "
            "they line up); the size after it was not checked (batchfit plan MODEL --gpu GPU "
            "traces both)"
        )
