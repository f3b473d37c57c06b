"""HTML views: Jupyter's `_repr_html_`, the self-contained report page, and a real headless
browser loading it."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from batchfit.hardware import get_gpu
from batchfit.memory.estimate import estimate
from batchfit.models import resolve_model
from batchfit.spec import TrainingSetup
from batchfit.views import html as _html
from tests._cli import run_cli
from tests._tiny import TIMELINE_GPT2
from tests.views._browser import BROWSER, NO_BROWSER, render


def _plan_json() -> dict[str, object]:
    """A plan's JSON as ``Plan.to_json()`` shapes it, with user text that must be escaped."""
    return {
        "model": "gpt2 <b>bold</b>",
        "gpu": "t4",
        "num_gpus": 1,
        "seq_len": 512,
        "micro_batch_size": 8,
        "grad_accum_steps": 4,
        "global_batch_size": 32,
        "tokens_per_step": 16384,
        "max_micro_batch": 9,
        "learning_rate": 3e-4,
        "techniques": [{"name": "gradient-checkpointing", "kind": "exact", "why": "recompute"}],
        "components": {
            "weights": 2**29,
            "gradients": 2**29,
            "optimizer_state": 2**30,
            "activations": 3 * 2**30,
            "other": 2**27,
        },
        "peak_bytes": 5 * 2**30,
        "reserved_bytes": 6 * 2**30,
        "device_total_bytes": 7 * 2**30,
        "gpu_bytes": 15 * 2**30,
        "headroom_bytes": 8 * 2**30,
        "headroom_wanted_bytes": 2**29,
        "engine": "trace",
        "setup": {"sharding": "none"},
        "step_seconds": 1.5,
        "tokens_per_s_per_gpu": 10922.7,
        "mfu": 0.31,
        "alternatives": [
            {
                "techniques": ["zero2 <i>", "lora"],
                "kinds": ["exact", "changes-training"],
                "max_micro_batch": 12,
                "device_total_bytes": 5 * 2**30,
                "engine": "trace",
                "micro_batch_size": 8,
                "step_seconds": 1.4,
                "tokens_per_s_per_gpu": 11000.0,
                "throughput_source": None,
            }
        ],
        "warnings": ["a <warning> & more"],
        "versions": {"batchfit": "0.1.0", "torch": "2.9.0", "transformers": None},
    }


def test_user_text_is_escaped_and_numbers_shown() -> None:
    page = _html.plan_html(_plan_json())
    assert "<b>bold</b>" not in page and "&lt;b&gt;bold&lt;/b&gt;" in page
    assert "&lt;warning&gt; &amp; more" in page and "zero2 &lt;i&gt; + lora" in page
    assert "micro-batch 8 x accumulation 4" in page
    assert "<svg" in page and "7.00" in page  # the bar and the device total in GiB
    text = _text(page)
    assert "to fit: gradient-checkpointing (exact)" in text
    # the alternative: kind, largest micro-batch, GiB there, the timed micro x accumulation
    assert "zero2 <i> + lora | changes-training | 12 | 5.00 | 8 x 4 | 1.4 | 11,000 |" in text
    assert "made by batchfit 0.1.0: figures from the trace engine" in text
    assert text.rstrip().endswith("; torch 2.9.0")  # a missing version is left out


def test_an_alternative_that_needs_code_is_marked_with_the_change() -> None:
    data = _plan_json()
    need = "code: wrap every 2nd transformer layer's forward in torch.utils.checkpoint <yourself>"
    data["alternatives"][0]["needs"] = [need]
    page = _html.plan_html(data)
    assert "<yourself>" not in page  # the change is user-facing text: escaped
    text = _text(page)
    assert "zero2 <i> + lora (needs code) | changes-training | 12 |" in text
    assert f"(needs code): never chosen; it needs {need}" in text
    assert "(needs code)" not in _text(_html.plan_html(_plan_json()))


def test_an_alternative_beyond_reach_is_marked_as_the_formulas() -> None:
    data = _plan_json()
    data["alternatives"][0].update(beyond_reach=True, engine="analytic", max_micro_batch=0)
    text = _text(_html.plan_html(data))
    assert "zero2 <i> + lora (formulas) | changes-training | none |" in text
    assert "(formulas): not traced" in text and "(analytic)" not in text
    assert "(formulas)" not in _text(_html.plan_html(_plan_json()))


def test_the_estimate_renders_itself_in_jupyter() -> None:
    est = estimate(
        resolve_model("gpt2"),
        TrainingSetup(),
        micro_batch_size=2,
        seq_len=128,
        gpu=get_gpu("t4"),
        engine="analytic",
    )
    html = est._repr_html_()
    assert "gpt2" in html and "peak allocated" in html and "tokens/s per GPU" in html


def test_the_report_page_needs_no_network() -> None:
    png = b"\x89PNG\r\n\x1a\nfake"
    page = _html.report_page(_plan_json(), png)
    assert page.startswith("<!DOCTYPE html>")
    assert 'src="data:image/png;base64,' in page
    # no resource from anywhere: the only URL is the SVG namespace, which loads nothing
    urls = set(re.findall(r"https?://[^\s\"'<>]+", page))
    assert urls <= {"http://www.w3.org/2000/svg"}
    assert "<script" not in page and "<link" not in page


@pytest.mark.slow
@pytest.mark.skipif(BROWSER is None, reason=NO_BROWSER)
def test_a_real_browser_renders_the_report(tmp_path: Path) -> None:
    """Headless Chromium loads the page, dumps its DOM and takes a screenshot."""
    import base64

    # a real PNG (1 x 1) so that the browser decodes an image
    png = base64.b64decode(
        "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="
    )
    page = tmp_path / "report.html"
    page.write_text(_html.report_page(_plan_json(), png))
    seen = render(page, tmp_path / "shot.png")
    assert "micro-batch 8 x accumulation 4" in seen.dom
    assert "net::ERR" not in seen.log
    shot = seen.screenshot
    assert shot.read_bytes()[:4] == b"\x89PNG" and shot.stat().st_size > 10_000


@pytest.mark.slow
def test_plan_report_and_auto_headroom(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`plan --report` writes the page with the traced step drawn in it; `--headroom auto`
    says what backs it (here: no calibration records, the default)."""
    import json

    pytest.importorskip("matplotlib")
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TIMELINE_GPT2))
    page = tmp_path / "plan.html"
    monkeypatch.setenv("BATCHFIT_DATA_DIR", str(tmp_path / "data"))
    args = ["plan", str(config), "--gpu", "t4", "--seq-len", "128", "--global-batch", "16"]
    code, out, err = run_cli([*args, "--headroom", "auto", "--report", str(page), "--json"], capsys)
    assert code == 0, err[-2000:]
    data = json.loads(out)
    assert any("--headroom auto: 5.0%" in w for w in data["warnings"])
    assert data["headroom_wanted_bytes"] == int(0.05 * data["gpu_bytes"])
    html = page.read_text()
    assert "data:image/png;base64," in html and "The step, traced" in html


def _text(page: str) -> str:
    """The page's text, a table row a line with ``|`` after each cell (tags dropped)."""
    import html

    page = re.sub(r"<style>.*?</style>|<svg.*?</svg>", "", page, flags=re.S)
    page = re.sub(r"</tr>|</p>|</h\d>|</li>", "\n", page)
    page = re.sub(r"</t[dh]>", " | ", page)
    return html.unescape(re.sub(r"<[^>]+>", "", page))


def _cli_plan(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    *args: str,
) -> tuple[dict[str, Any], str]:
    """`batchfit plan ... --report FILE --json`: the JSON and the page's text."""
    import json

    page = tmp_path / "plan.html"
    monkeypatch.setenv("BATCHFIT_DATA_DIR", str(tmp_path / "data"))
    code, out, err = run_cli(["plan", *args, "--report", str(page), "--json"], capsys)
    assert code == 0, err[-2000:]
    return json.loads(out), _text(page.read_text())


def _alternative_rows(data: dict[str, Any]) -> list[str]:
    """The rows the terminal's table shows (cli/render.py), as the page must show them."""
    per_gpu = data["global_batch_size"] // data["num_gpus"]
    rows = []
    for a in data["alternatives"]:
        name = " + ".join(a["techniques"])
        sharded = {"zero1", "zero2", "zero3", "fsdp", "fsdp-cpu-offload"} & set(a["techniques"])
        if data["num_gpus"] > 1 and not sharded:
            name = f"ddp + {name}"
        if a["techniques"] == [t["name"] for t in data["techniques"]]:
            name += " (plan)"  # the plan's row, as the terminal marks it
        kind = "changes-training" if "changes-training" in a["kinds"] else "exact"
        mark = "≥" if a["from_lines"] else ""  # the size after it was not traced
        size = f"{mark}{a['max_micro_batch']}" if a["max_micro_batch"] else "none"
        cells = [name, kind, size, _gib(a["device_total_bytes"])]
        if a["step_seconds"]:
            micro = a["micro_batch_size"]
            cells += [
                f"{micro} x {per_gpu // micro}",
                f"{a['step_seconds']:.3g}",
                f"{a['tokens_per_s_per_gpu']:,.0f}",
            ]
        rows.append(" | ".join(cells) + " |")
    return rows


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.2f}"


def test_the_report_of_a_multi_gpu_plan_with_a_run_and_its_cost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The alternatives carry the terminal's columns, each filled; kinds are labelled; the
    run's time and cost and the footer's engine and versions are on the page."""
    from batchfit._version import versions

    data, text = _cli_plan(
        tmp_path,
        monkeypatch,
        capsys,
        "llama-3.1-8b",
        "--gpu",
        "h100-80gb",
        "--num-gpus",
        "8",
        "--global-batch",
        "256",
        "--seq-len",
        "4096",
        "--train-tokens",
        "1B",
        "--engine",
        "analytic",
    )
    head = (
        "techniques | kind | largest micro-batch | GiB at that size | timed at micro x accum | "
        "s / step | tokens/s/GPU | run | cost |"
    )
    assert head in text
    rows = _alternative_rows(data)
    assert len(rows) == len(data["alternatives"]) > 5
    for row in rows:
        assert row in text, row
    assert "ddp + fused-adamw | exact | none |" in text  # DDP named, as in the terminal
    assert "| changes-training |" in text
    # a timed row's run and cost: its step time x the run's steps, at the plan's price
    timed = next(a for a in data["alternatives"] if a["step_seconds"])
    cost = timed["step_seconds"] * data["train_steps"] / 3600 * 8 * data["gpu_hour_price"]
    assert f"${cost:,.0f} |" in text
    chosen = ", ".join(f"{t['name']} ({t['kind']})" for t in data["techniques"])
    assert f"to fit: {chosen}\n" in text and "(exact)" in chosen
    assert f"the run: {data['train_steps']:,} optimizer steps" in text
    assert f"${data['cost_usd']:,.0f} at ${data['gpu_hour_price']:g}/GPU-hour" in text
    ours = versions()
    assert (
        f"made by batchfit {ours['batchfit']}: figures from the analytic engine (formulas); "
        f"torch {ours['torch']}"
    ) in text
    assert "batchfit ()" not in text


def test_the_notebook_view_of_an_own_module_plan_is_timed_in_samples(tmp_path: Path) -> None:
    """Your own module: timed from what its dry runs counted, in samples a second, and no row
    or cell left empty."""
    import torch

    from batchfit.plan import make_plan

    def mlp() -> torch.nn.Module:  # 1.5 GiB of fp32 weights: alternatives worth showing
        return torch.nn.Sequential(*[torch.nn.Linear(8192, 8192) for _ in range(6)])

    plan = make_plan(
        mlp,
        get_gpu("l4"),  # bf16: pure bf16 changes training (8-bit AdamW alone is left out)
        TrainingSetup(precision="fp32"),
        batch_fn=lambda n: torch.randn(n, 8192),
        loss_fn=lambda out, batch: out.square().mean(),
        global_batch=2,  # one dry run a rung: each fits the whole batch
    )
    text = _text(plan._repr_html_())
    data = plan.to_json()
    assert data["step_seconds"] and "time:" in text and "samples/s per GPU" in text
    head = "techniques | kind | largest micro-batch | GiB at that size |"
    assert head + " timed at micro x accum | s / step | samples/s/GPU |" in text
    for row in _alternative_rows(data):
        assert row in text, row
    assert "|  |" not in text  # no empty cell
    assert "mlp on 1 x l4\n" in text  # no "seq 0": its batch_fn makes the samples
    assert "to fit: nothing extra needed" in text and "| changes-training |" in text
    assert "made by batchfit " in text and "figures from the trace engine" in text


def test_a_probe_result_has_a_footer() -> None:
    page = _html.probe_html(
        {
            "micro_batch_size": 4,
            "max_fitting_micro_batch": 4,
            "trials": [
                {"micro_batch_size": 4, "ok": True, "peak_bytes": 2**30, "samples_per_s": 9.5}
            ],
            "notes": [],
            "versions": {"batchfit": "0.1.0", "torch": "2.9.0"},
        }
    )
    text = _text(page)
    assert "4 | ok | 1.00 | 9.50 |" in text
    assert (
        "made by batchfit 0.1.0: figures measured in real steps on the device; torch 2.9.0" in text
    )


def test_every_step_time_on_the_page_has_one_format() -> None:
    """The time line, the alternatives' and the GPU counts' ``s / step`` show a step time
    alike: three significant figures, as the terminal does (never a mix of formats)."""
    plan = {
        **_plan_json(),
        "step_seconds": 12.345,
        "num_gpus": 2,
        "global_batch_size": 64,
        "alternatives": [
            {
                "techniques": ["zero2"],
                "kinds": ["exact"],
                "max_micro_batch": 12,
                "device_total_bytes": 5 * 2**30,
                "micro_batch_size": 8,
                "step_seconds": 12.345,
                "tokens_per_s_per_gpu": 11000.0,
            }
        ],
        "gpu_counts": [
            {
                "num_gpus": 2,
                "chosen": True,
                "micro_batch_size": 8,
                "grad_accum_steps": 4,
                "fits": True,
                "step_seconds": 12.345,
                "tokens_per_s_per_gpu": 5000.0,
                "efficiency": 1.0,
                "techniques": [],
            }
        ],
    }
    text = _text(_html.plan_html(plan))
    assert "time: ~12.3 s per optimizer step," in text
    assert "| 8 x 4 | 12.3 | 11,000 |" in text  # the alternative
    assert "2 * | 8 x 4 | 12.3 | 5,000 |" in text  # the GPU count
    assert text.count("12.3") == 3 and "12.35" not in text and "12 s" not in text


def test_the_pages_step_times_are_the_terminals(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same plan in the terminal and on the page: the same step time in the time line and
    in each GPU count's row."""
    args = [
        "llama-3.1-8b",
        "--gpu",
        "h100-80gb",
        "--num-gpus",
        "auto",
        "--global-batch",
        "256",
        "--seq-len",
        "4096",
        "--engine",
        "analytic",
    ]
    data, text = _cli_plan(tmp_path, monkeypatch, capsys, *args)
    code, terminal, err = run_cli(["plan", *args], capsys)  # drawn as into a pipe
    assert code == 0, err[-2000:]
    time_line = re.search(r"time: (~\S+ s per optimizer step),", terminal)
    assert time_line is not None and f"time: {time_line.group(1)}," in text
    timed = [c for c in data["gpu_counts"] if c.get("step_seconds")]
    assert len(timed) > 1
    for c in timed:
        row = re.search(
            rf"│\s+{c['num_gpus']}( \*)?\s+│\s+{c['micro_batch_size']} x {c['grad_accum_steps']}"
            r"\s+│\s+(\S+)\s+│",
            terminal,
        )
        assert row is not None, c
        chosen = " *" if c.get("chosen") else ""
        assert (
            f"{c['num_gpus']}{chosen} | {c['micro_batch_size']} x {c['grad_accum_steps']} | "
            f"{row.group(2)} |"
        ) in text


@pytest.mark.parametrize(
    ("accumulation", "caption"),
    [
        (
            8,
            "each with 2 micro-steps of the plan's 8. Micro-steps 3 to 8 are not traced: each "
            "would repeat micro-step 2,",
        ),
        (3, "each with 2 micro-steps of the plan's 3. Micro-step 3 is not traced: it would"),
        (2, "each with the plan's 2 micro-steps."),
        (1, "each of one micro-step: the plan does not accumulate gradients."),
    ],
)
def test_the_report_says_how_many_micro_steps_the_picture_traces(
    accumulation: int, caption: str
) -> None:
    """The picture's dry run caps accumulation at two micro-steps a step
    (timeline.traced_micro_steps); the caption under it says so against the plan's count."""
    page = _html.report_page({**_plan_json(), "grad_accum_steps": accumulation}, b"\x89PNG")
    text = _text(page)
    assert "Two optimizer steps are traced (the first creates the optimizer state)" in text
    assert caption in text
    assert "Two optimizer steps" not in _text(_html.report_page(_plan_json()))  # no picture
