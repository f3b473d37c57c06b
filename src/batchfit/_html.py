"""HTML views of estimates, plans and probe results: for Jupyter (``_repr_html_``) and for
``plan --report FILE.html``, one self-contained page (inline CSS, inline SVG, an embedded PNG;
nothing loaded from the network) to share with a colleague (issue #14, part 6).

Everything is built from the objects' ``to_json()`` (the CLI's ``--json``), so the page says
what the JSON says; every string from the user (model names, paths, warnings) is escaped.
"""

from __future__ import annotations

import base64
from html import escape
from typing import Any

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
.bf .key { font-weight: 600; } .bf .warn { color: #8a4b00; }
.bf .muted { color: #666; font-size: 12px; }
"""


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


def _time(data: dict[str, Any]) -> str:
    if data.get("step_seconds") is None:
        return ""
    return (
        f"<p>time: ~{data['step_seconds']:.3g} s per optimizer step, "
        f"{data['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU, MFU {100 * data['mfu']:.0f}% "
        '<span class="muted">(predicted)</span></p>'
    )


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
        + "</div>"
    )


def _alternatives(data: dict[str, Any]) -> str:
    alts = data.get("alternatives") or []
    if not alts:
        return ""
    head = (
        "<tr><th>alternative</th><th>micro-batch</th><th>accumulation</th><th>peak GiB</th>"
        "<th>device GiB</th><th>s / step</th><th>tokens/s/GPU</th></tr>"
    )
    rows = []
    for a in alts:
        name = a.get("name") or ", ".join(a.get("techniques", [])) or "-"
        step = a.get("step_seconds")
        tps = a.get("tokens_per_s_per_gpu")
        rows.append(
            f"<tr><td>{escape(str(name))}</td><td>{a.get('micro_batch_size', '-')}</td>"
            f"<td>{a.get('grad_accum_steps', '-')}</td><td>{_gib(a.get('peak_bytes'))}</td>"
            f"<td>{_gib(a.get('device_total_bytes'))}</td>"
            f"<td>{'-' if step is None else f'{step:.3g}'}</td>"
            f"<td>{'-' if tps is None else f'{tps:,.0f}'}</td></tr>"
        )
    return f"<h2>Alternatives</h2><table>{head}{''.join(rows)}</table>"


def plan_html(data: dict[str, Any], picture: str = "") -> str:
    """A plan (``Plan.to_json()``) as an HTML fragment; ``picture`` (HTML) before the
    alternatives."""
    techniques = ", ".join(
        f"{escape(str(t.get('name', t)))} ({escape(str(t.get('kind', '')))})"
        if isinstance(t, dict)
        else escape(str(t))
        for t in data.get("techniques", [])
    )
    lr = data.get("learning_rate")
    summary = (
        f"<p><span class='key'>micro-batch {data.get('micro_batch_size')} x accumulation "
        f"{data.get('grad_accum_steps')} x GPUs {data.get('num_gpus')} = global batch "
        f"{data.get('global_batch_size')}</span> ({data.get('tokens_per_step', 0):,} tokens per "
        f"step); largest micro-batch that fits: {data.get('max_micro_batch')}</p>"
        + (f"<p>learning rate: {lr:.3g}</p>" if isinstance(lr, (int, float)) else "")
        + (f"<p>to fit: {techniques}</p>" if techniques else "")
        + f"<p>memory: {_gib(data.get('device_total_bytes'))} GiB of "
        f"{_gib(data.get('gpu_bytes'))} GiB (headroom {_gib(data.get('headroom_bytes'))} GiB)</p>"
    )
    title = (
        f"{escape(str(data.get('model', '')))} on {data.get('num_gpus')} x "
        f"{escape(str(data.get('gpu', '')))}, seq {data.get('seq_len')}"
    )
    return (
        f'<div class="bf"><style>{CSS}</style><h1>{title}</h1>{summary}'
        + _bar(data.get("components", {}), data.get("device_total_bytes"), data.get("gpu_bytes"))
        + _breakdown(data)
        + _time(data)
        + picture
        + _alternatives(data)
        + _warnings(data)
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
        )
    versions = ", ".join(f"{k} {escape(str(v))}" for k, v in plan.get("versions", {}).items())
    return (
        "<!DOCTYPE html><html><head><meta charset='utf-8'>"
        f"<title>batchfit plan: {escape(str(plan.get('model', '')))}</title></head><body>"
        + plan_html(plan, picture)
        + f'<p class="muted bf">made by batchfit ({versions})</p></body></html>'
    )
