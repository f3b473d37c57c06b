"""HTML views of estimates, plans and probe results: for Jupyter (``_repr_html_``) and for
``plan --report FILE.html``, one self-contained page (inline CSS, inline SVG, an embedded PNG;
nothing loaded from the network) to share with a colleague.

Everything is built from the objects' ``to_json()`` (the CLI's ``--json``), so the page says
what the JSON says; every string from the user (model names, paths, warnings) is escaped.
"""

from __future__ import annotations

import base64
from html import escape
from typing import Any

from batchfit._display import register_html
from batchfit._units import human_duration, usd
from batchfit._version import versions

GIB = 2**30
COMPONENTS = ("weights", "gradients", "optimizer_state", "activations", "other")
COLOURS = {
    "weights": "#1f77b4",
    "gradients": "#ff7f0e",
    "optimizer_state": "#2ca02c",
    "activations": "#d62728",
    "other": "#7f7f7f",
    "reserve": "#c7c7c7",
}
CSS = """
.bf { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; font-size: 14px;
      color: #222; max-width: 960px; }
.bf h1 { font-size: 20px; margin: 8px 0; } .bf h2 { font-size: 16px; margin: 16px 0 6px; }
.bf table { border-collapse: collapse; margin: 6px 0; }
.bf th, .bf td { border-bottom: 1px solid #ddd; padding: 3px 10px; text-align: right; }
.bf th:first-child, .bf td:first-child { text-align: left; }
.bf td + td { white-space: nowrap; }
.bf .key { font-weight: 600; } .bf .warn { color: #8a4b00; }
.bf .muted { color: #666; font-size: 12px; }
.bf .exact { color: #1a7f37; } .bf .changes { color: #9a6700; }
"""
# the ladder's rungs that shard over the GPUs (plan/_ladder.py): an alternative without one on
# several GPUs runs as DDP, and the terminal's table names it so (cli/render.py, _rung_name)
SHARDING_RUNGS = frozenset({"zero1", "zero2", "zero3", "fsdp", "fsdp-cpu-offload"})


def _gib(num_bytes: float | None) -> str:
    return "-" if num_bytes is None else f"{num_bytes / GIB:.2f}"


def _bar(components: dict[str, int], total: int | None, gpu_bytes: int | None) -> str:
    """A stacked horizontal bar of the components (and the rest of the device total) against
    the GPU's memory, as inline SVG."""
    width, height = 640, 28
    scale_to = max(gpu_bytes or 0, total or 0, sum(components.values()), 1)
    x = 0.0
    parts = []
    for name in COMPONENTS:
        w = components.get(name, 0) / scale_to * width
        if w > 0:
            parts.append(
                f'<rect x="{x:.1f}" y="0" width="{w:.1f}" height="{height}" '
                f'fill="{COLOURS[name]}"><title>{name}: {_gib(components[name])} GiB</title></rect>'
            )
            x += w
    if total and total > sum(components.values()):
        w = (total - sum(components.values())) / scale_to * width
        parts.append(
            f'<rect x="{x:.1f}" y="0" width="{w:.1f}" height="{height}" '
            f'fill="{COLOURS["reserve"]}"><title>reserve, CUDA context</title></rect>'
        )
    if gpu_bytes:
        parts.append(
            f'<line x1="{gpu_bytes / scale_to * width:.1f}" y1="0" '
            f'x2="{gpu_bytes / scale_to * width:.1f}" y2="{height}" stroke="black" '
            'stroke-width="2" />'
        )
    legend = " ".join(
        f'<span style="color:{COLOURS[n]}">&#9632;</span> {n.replace("_", " ")}' for n in COMPONENTS
    )
    return (
        f'<svg width="{width + 4}" height="{height}" role="img" '
        f'xmlns="http://www.w3.org/2000/svg">{"".join(parts)}</svg>'
        f'<div class="muted">{legend}'
        + (
            " &nbsp;|&nbsp; grey: reserve and context; black line: the GPU's memory"
            if gpu_bytes
            else ""
        )
        + "</div>"
    )


def _breakdown(data: dict[str, Any]) -> str:
    comps = data.get("components", {})
    rows = "".join(
        f"<tr><td>{n.replace('_', ' ')}</td><td>{_gib(comps.get(n, 0))}</td></tr>"
        for n in COMPONENTS
    )
    rows += f'<tr class="key"><td>peak allocated</td><td>{_gib(data.get("peak_bytes"))}</td></tr>'
    if data.get("reserved_bytes"):
        rows += f"<tr><td>reserved</td><td>{_gib(data['reserved_bytes'])}</td></tr>"
    if data.get("device_total_bytes"):
        total = _gib(data["device_total_bytes"])
        rows += f"<tr><td>device total (nvidia-smi)</td><td>{total}</td></tr>"
    return f"<table><tr><th>component</th><th>GiB</th></tr>{rows}</table>"


def _step_time(seconds: float) -> str:
    """Seconds per optimizer step, as every step time on the page and in the terminal
    (cli/render.py: ``time: ~3.78 s per optimizer step``, the ``s / step`` columns) shows it:
    three significant figures."""
    return f"{seconds:.3g}"


def _unit(data: dict[str, Any]) -> str:
    """What throughput counts: images (``image_size``), your own module's samples, or tokens."""
    return "images" if "image_size" in data else "tokens" if data.get("seq_len") else "samples"


def _time(data: dict[str, Any]) -> str:
    if data.get("step_seconds") is None:
        return ""
    source = data.get("throughput_source")
    why = f"--throughput-from: {escape(str(source))}" if source else "predicted"
    mfu = 100 * (data.get("mfu") or 0)
    return (
        f"<p>time: ~{_step_time(data['step_seconds'])} s per optimizer step, "
        f"{data['tokens_per_s_per_gpu']:,.0f} {_unit(data)}/s per GPU, MFU {mfu:.0f}% "
        f'<span class="muted">({why})</span></p>'
    )


def _run(data: dict[str, Any]) -> str:
    """``--train-tokens`` / ``--epochs``: the run's optimizer steps, time and price."""
    steps, seconds = data.get("train_steps"), data.get("train_seconds")
    if steps is None or seconds is None:
        return ""
    gpus = data.get("num_gpus") or 1
    price, cost = data.get("gpu_hour_price"), data.get("cost_usd")
    if cost is not None and price is not None:
        source = escape(str(data.get("price_source") or ""))
        priced = f", {usd(cost)} at ${price:g}/GPU-hour ({source})"
    else:
        priced = (
            f" (no list price for {escape(str(data.get('gpu', '')))}: --gpu-hour-price USD adds "
            "the cost)"
        )
    return (
        f"<p>the run: {steps:,} optimizer step{'s' if steps != 1 else ''}, "
        f"~{human_duration(seconds)} on {gpus} GPU{'s' if gpus > 1 else ''}{priced} "
        '<span class="muted">(predicted)</span></p>'
    )


def _kind(kind: str) -> str:
    """A technique's kind, coloured: ``exact`` (the same training) or ``changes-training``."""
    css = "exact" if kind == "exact" else "changes"
    return f'<span class="{css}">{escape(kind)}</span>'


def _footer(data: dict[str, Any], made_by: str) -> str:
    """What made the figures (the engine, or the device measured) and the versions."""
    known = data.get("versions") or versions()
    named = ", ".join(f"{k} {escape(str(v))}" for k, v in known.items() if k != "batchfit" and v)
    version = escape(str(known.get("batchfit", "")))
    return f'<p class="muted">made by batchfit {version}: {made_by}; {named}</p>'


def _engine(data: dict[str, Any]) -> str:
    engine = data.get("engine")
    if engine == "trace":
        return "figures from the trace engine (dry runs of the step on fake tensors)"
    if engine == "analytic":
        return "figures from the analytic engine (formulas)"
    return f"figures from the {escape(str(engine))} engine" if engine else "figures"


def _warnings(data: dict[str, Any]) -> str:
    items = "".join(f"<li>{escape(str(w))}</li>" for w in data.get("warnings", ()))
    return f'<ul class="warn">{items}</ul>' if items else ""


def estimate_html(data: dict[str, Any], gpu_bytes: int | None = None) -> str:
    """An estimate (``MemoryEstimate.to_json()``) as an HTML fragment."""
    title = (
        f"{escape(str(data.get('model', '')))}: micro-batch {data.get('micro_batch_size')} x "
        f"{data.get('seq_len')}, {escape(str(data.get('engine', '')))} engine, "
        f"{escape(str(data.get('device', '')))}"
    )
    return (
        f'<div class="bf"><style>{CSS}</style><h2>{title}</h2>'
        + _bar(data.get("components", {}), data.get("device_total_bytes"), gpu_bytes)
        + _breakdown(data)
        + _time(data)
        + _warnings(data)
        + _footer(data, _engine(data))
        + "</div>"
    )


_FORMULAS_NOTE = (
    "(formulas): not traced: the formulas put micro-batch 1 far past the card, so it cannot "
    "fit; the figure is theirs"
)


def _alternatives(data: dict[str, Any]) -> str:
    """The table of alternatives, with the terminal's columns (cli/render.py): techniques, kind,
    largest micro-batch and the GiB at that size; with time, the micro-batch x accumulation the
    time is for, s / step and tokens/s/GPU; with a run length, its time and price."""
    alts = data.get("alternatives") or []
    if not alts:
        return ""
    timed = any(a.get("step_seconds") for a in alts)
    steps, price = data.get("train_steps"), data.get("gpu_hour_price")
    gpus = data.get("num_gpus") or 1
    per_gpu = (data.get("global_batch_size") or 0) // gpus
    head = ["techniques", "kind", "largest micro-batch", "GiB at that size"]
    if timed:
        head += ["timed at micro x accum", "s / step", f"{_unit(data)}/s/GPU"]
        head += ["run", "cost"] if steps and price is not None else ["run"] if steps else []
    traced = data.get("engine") == "trace" or any(
        a.get("engine") == "trace" or a.get("beyond_reach") for a in alts
    )
    rows = []
    # the terminal's order: exact first, then changing training; each timed fastest first
    ordered = sorted(
        enumerate(alts),
        key=lambda ia: (
            "changes-training" in (ia[1].get("kinds") or []),
            not ia[1].get("step_seconds"),
            ia[1].get("step_seconds") or 0.0,
            ia[0],
        ),
    )
    for _, a in ordered:
        kinds = a.get("kinds") or []
        chosen = [t.get("name") for t in data.get("techniques", []) if isinstance(t, dict)]
        mark = "≥" if a.get("from_lines") else ""  # the size after it was not traced
        cells = [
            escape(_rung_name(a, data))
            + engine_mark(str(a.get("engine")), bool(a.get("beyond_reach")), traced)
            + (" (needs code)" if a.get("needs") else "")
            + (" (plan)" if list(a.get("techniques", [])) == chosen else ""),
            _kind("changes-training" if "changes-training" in kinds else "exact"),
            mark + str(a["max_micro_batch"]) if a.get("max_micro_batch") else "none",
            _gib(a.get("device_total_bytes")),
        ]
        if timed:
            micro, step = a.get("micro_batch_size") or 0, a.get("step_seconds")
            cells += [
                f"{micro} x {per_gpu // micro}" if micro and per_gpu else "-",
                "-" if not step else _step_time(step),
                "-" if not a.get("tokens_per_s_per_gpu") else f"{a['tokens_per_s_per_gpu']:,.0f}",
            ]
            if steps:
                cells.append("-" if not step else human_duration(step * steps))
                if price is not None:
                    cells.append("-" if not step else usd(step * steps / 3600 * gpus * price))
        rows.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    notes = []
    if any(" (plan)</td>" in r for r in rows):
        notes.append("(plan): the plan's setup")
    # what the framework's config cannot switch on: offered, never chosen (as the terminal)
    for need in sorted({str(n) for a in alts for n in a.get("needs") or []}):
        notes.append(f"(needs code): never chosen; it needs {escape(need)}")
    if traced and any(a.get("engine") == "analytic" and not a.get("beyond_reach") for a in alts):
        notes.append("(analytic): the trace cannot run this setup yet; the formulas answered")
    if any(a.get("beyond_reach") for a in alts):
        notes.append(_FORMULAS_NOTE)
    if any(a.get("throughput_source") for a in alts):
        notes.append("s / step: corrected by --throughput-from")
    if any(a.get("from_lines") for a in alts):
        notes.append("≥: traced at that size; the size after it was not traced")
    return (
        "<h2>Alternatives <span class='muted'>("
        + ("exact first, then by step time" if timed else "exact rungs first")
        + ")</span></h2><table><tr>"
        + "".join(f"<th>{h}</th>" for h in head)
        + "</tr>"
        + "".join(rows)
        + "</table>"
        + "".join(f'<p class="muted">{n}</p>' for n in notes)
    )


def engine_mark(engine: str, beyond_reach: bool, traced: bool) -> str:
    """An alternative's engine mark, the terminal's and the page's: `` (formulas)`` where the
    trace was not run (far past the card), `` (analytic)`` where it cannot run the setup, in
    a plan the trace answered (``traced``)."""
    if beyond_reach:
        return " (formulas)"
    return " (analytic)" if traced and engine == "analytic" else ""


def _rung_name(alt: dict[str, Any], plan: dict[str, Any]) -> str:
    """An alternative's techniques joined with ``+``; on several GPUs without a sharding rung
    and an unsharded plan setup, named DDP (the terminal's ``_rung_name``)."""
    names = [str(t) for t in alt.get("techniques", [])]
    name = " + ".join(names)
    if (plan.get("num_gpus") or 1) > 1 and not SHARDING_RUNGS.intersection(names):
        chosen = {t.get("name") for t in plan.get("techniques", []) if isinstance(t, dict)}
        sharding = (plan.get("setup") or {}).get("sharding", "none")
        # the plan's setup holds its own techniques: a sharding rung there was not asked for
        if sharding in ("none", "ddp") or SHARDING_RUNGS.intersection(chosen):
            return f"ddp + {name}" if name else "ddp"
    return name or "-"


def _micro_accum(count: dict[str, Any]) -> str:
    if not count.get("micro_batch_size"):
        return "-"
    if not count.get("fits"):
        return "none fits"
    return f"{count['micro_batch_size']} x {count.get('grad_accum_steps')}"


def _gpu_counts(data: dict[str, Any]) -> str:
    """``--num-gpus auto``: each count's plan in one row, the chosen one marked."""
    counts = data.get("gpu_counts") or []
    if not counts:
        return ""
    rows = []
    for c in counts:
        step, tps, eff = c.get("step_seconds"), c.get("tokens_per_s_per_gpu"), c.get("efficiency")
        what = c.get("note") if not c.get("micro_batch_size") else None
        rows.append(
            f"<tr><td>{c.get('num_gpus')}{' *' if c.get('chosen') else ''}</td>"
            f"<td>{_micro_accum(c)}</td>"
            f"<td>{'-' if not step else _step_time(step)}</td>"
            f"<td>{'-' if not tps else f'{tps:,.0f}'}</td>"
            f"<td>{'-' if eff is None else f'{eff:.0%}'}</td>"
            f"<td>{'-' if not c.get('train_seconds') else human_duration(c['train_seconds'])}</td>"
            f"<td>{'-' if not c.get('cost_usd') else usd(c['cost_usd'])}</td>"
            f"<td>{escape(str(what or ' + '.join(c.get('techniques', [])) or 'nothing extra'))}"
            "</td></tr>"
        )
    head = "".join(
        f"<th>{h}</th>"
        for h in (
            "GPUs",
            "micro x accum",
            "s / step",
            "tokens/s/GPU",
            "eff.",
            "run",
            "cost",
            "to fit",
        )
    )
    rule = escape(str(data.get("gpu_count_rule") or ""))
    return (
        f"<h2>GPU counts <span class='muted'>(--num-gpus auto)</span></h2><table><tr>{head}</tr>"
        + "".join(rows)
        + f'</table><p class="muted">* {rule}; eff. = tokens/s per GPU over the best count\'s</p>'
    )


def plan_html(data: dict[str, Any], picture: str = "") -> str:
    """A plan (``Plan.to_json()``) as an HTML fragment; ``picture`` (HTML) before the
    alternatives."""
    techniques = ", ".join(
        f"{escape(str(t.get('name', t)))} ({_kind(str(t.get('kind', '')))})"
        if isinstance(t, dict)
        else escape(str(t))
        for t in data.get("techniques", [])
    )
    if not techniques:
        techniques = (
            "none: no technique on the ladder is enough"
            if not data.get("max_micro_batch")
            else "nothing extra needed"
        )
    lr = data.get("learning_rate")
    rule = f" ({escape(str(data['lr_rule']))})" if data.get("lr_rule") else ""
    tokens = data.get("tokens_per_step")
    gpus = data.get("num_gpus") or 1
    ddp = gpus > 1 and (data.get("setup") or {}).get("sharding") in ("none", "ddp")
    summary = (
        f"<p><span class='key'>micro-batch {data.get('micro_batch_size')} x accumulation "
        f"{data.get('grad_accum_steps')} x GPUs {gpus} = global batch "
        f"{data.get('global_batch_size')}</span>"
        + (f" ({tokens:,} tokens per step)" if tokens else "")
        + f"; largest micro-batch that fits: {data.get('max_micro_batch')}</p>"
        + (f"<p>learning rate: {lr:.3g}{rule}</p>" if isinstance(lr, (int, float)) else "")
        + f"<p>to fit: {techniques}</p>"
        + (
            "<p>sharding: none (DDP: every GPU holds the whole model and optimizer)</p>"
            if ddp
            else ""
        )
        + f"<p>memory per GPU: {_gib(data.get('device_total_bytes'))} GiB of "
        f"{_gib(data.get('gpu_bytes'))} GiB (headroom {_gib(data.get('headroom_bytes'))} GiB; "
        f"asked for {_gib(data.get('headroom_wanted_bytes'))} GiB)</p>"
    )
    # your own module has no sequence length: its batch_fn makes the samples
    size = (
        f", image {data['image_size']} px"
        if data.get("image_size")
        else f", seq {data['seq_len']}"
        if data.get("seq_len")
        else ""
    )
    title = (
        f"{escape(str(data.get('model', '')))} on {gpus} x {escape(str(data.get('gpu', '')))}{size}"
    )
    return (
        f'<div class="bf"><style>{CSS}</style><h1>{title}</h1>{summary}'
        + _bar(data.get("components", {}), data.get("device_total_bytes"), data.get("gpu_bytes"))
        + _breakdown(data)
        + _time(data)
        + _run(data)
        + picture
        + _alternatives(data)
        + _gpu_counts(data)
        + _warnings(data)
        + _footer(data, _engine(data))
        + "</div>"
    )


def probe_html(data: dict[str, Any]) -> str:
    """A probe's result (``SearchResult.to_json()``) as an HTML fragment."""
    head = "<tr><th>micro-batch</th><th>result</th><th>peak GiB</th><th>samples/s</th></tr>"
    rows = "".join(
        f"<tr><td>{t.get('micro_batch_size')}</td><td>{'ok' if t.get('ok') else 'out of memory'}"
        f"</td><td>{_gib(t.get('peak_bytes'))}</td><td>{_speed(t.get('samples_per_s'))}</td></tr>"
        for t in data.get("trials", [])
    )
    notes = "".join(f"<li>{escape(str(n))}</li>" for n in data.get("notes", ()))
    return (
        f'<div class="bf"><style>{CSS}</style><h2>probe: choice micro-batch '
        f"{data.get('micro_batch_size')}, largest that fitted "
        f"{data.get('max_fitting_micro_batch')}</h2><table>{head}{rows}</table>"
        + (f'<ul class="muted">{notes}</ul>' if notes else "")
        + _footer(data, "figures measured in real steps on the device")
        + "</div>"
    )


def _speed(samples_per_s: float | None) -> str:
    return "-" if samples_per_s is None else f"{samples_per_s:.2f}"


def report_page(plan: dict[str, Any], timeline_png: bytes | None = None) -> str:
    """One self-contained page: the plan, its breakdown, the step's timeline, the
    alternatives. No script, no stylesheet or image from the network."""
    picture = ""
    if timeline_png:
        encoded = base64.b64encode(timeline_png).decode()
        picture = (
            "<h2>The step, traced</h2>"
            f'<img alt="memory over the traced step" style="max-width:100%" '
            f'src="data:image/png;base64,{encoded}">'
            f'<p class="muted">{_traced_steps_caption(plan.get("grad_accum_steps") or 1)}</p>'
        )
    return (
        "<!DOCTYPE html><html><head><meta charset='utf-8'>"
        f"<title>batchfit plan: {escape(str(plan.get('model', '')))}</title></head><body>"
        + plan_html(plan, picture)
        + "</body></html>"
    )


def _traced_steps_caption(grad_accum_steps: int) -> str:
    """What the picture's dry run holds against the plan's accumulation: each of its two
    optimizer steps traces at most two micro-steps (``memory.trace.timeline.traced_micro_steps``).

    Example:
        >>> print(_traced_steps_caption(8))
        Two optimizer steps are traced (the first creates the optimizer state), each with 2 \
micro-steps of the plan's 8. Micro-steps 3 to 8 are not traced: each would repeat micro-step 2, \
which already holds the gradients the earlier ones accumulated (the same memory, the same peak).
    """
    # lazy: `import batchfit` loads this module; the timeline's would bring models and hardware
    from batchfit.memory.trace.timeline import traced_micro_steps

    traced = traced_micro_steps(grad_accum_steps)
    head = "Two optimizer steps are traced (the first creates the optimizer state)"
    if grad_accum_steps <= 1:
        return f"{head}, each of one micro-step: the plan does not accumulate gradients."
    if grad_accum_steps == traced:
        return f"{head}, each with the plan's {traced} micro-steps."
    rest = (
        f"Micro-step {grad_accum_steps} is not traced: it would repeat"
        if grad_accum_steps == traced + 1
        else f"Micro-steps {traced + 1} to {grad_accum_steps} are not traced: each would repeat"
    )
    return (
        f"{head}, each with {traced} micro-steps of the plan's {grad_accum_steps}. {rest} "
        f"micro-step {traced}, which already holds the gradients the earlier ones accumulated "
        "(the same memory, the same peak)."
    )


# the pages behind the values' ``_repr_html_`` (batchfit._display)
register_html("estimate", estimate_html)
register_html("plan", plan_html)
register_html("probe", probe_html)
