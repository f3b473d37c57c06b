"""HTML views: Jupyter's `_repr_html_`, the self-contained report page, and a real headless
browser loading it (issue #14, part 6)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from batchfit import _html
from batchfit.hardware import get_gpu
from batchfit.memory.estimate import estimate
from batchfit.models import resolve_model
from batchfit.spec import TrainingSetup
from tests._browser import BROWSER, NO_BROWSER, render


def _plan_json() -> dict[str, object]:
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
        "techniques": [{"name": "gradient-checkpointing", "kind": "exact"}],
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
        "step_seconds": 1.5,
        "tokens_per_s_per_gpu": 10922.7,
        "mfu": 0.31,
        "alternatives": [
            {
                "name": "zero2 <i>",
                "micro_batch_size": 12,
                "grad_accum_steps": 3,
                "peak_bytes": 2**32,
                "device_total_bytes": 5 * 2**30,
                "step_seconds": 1.4,
                "tokens_per_s_per_gpu": 11000.0,
            }
        ],
        "warnings": ["a <warning> & more"],
        "versions": {"batchfit": "0.1.0"},
    }


def test_user_text_is_escaped_and_numbers_shown() -> None:
    page = _html.plan_html(_plan_json())
    assert "<b>bold</b>" not in page and "&lt;b&gt;bold&lt;/b&gt;" in page
    assert "&lt;warning&gt; &amp; more" in page and "zero2 &lt;i&gt;" in page
    assert "micro-batch 8 x accumulation 4" in page
    assert "<svg" in page and "7.00" in page  # the bar and the device total in GiB


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
def test_plan_report_and_auto_headroom(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`plan --report` writes the page with the traced step drawn in it; `--headroom auto`
    says what backs it (here: no calibration records, the default)."""
    import json
    import os

    pytest.importorskip("matplotlib")
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {
                "model_type": "gpt2",
                "architectures": ["GPT2LMHeadModel"],
                "n_embd": 128,
                "n_layer": 2,
                "n_head": 4,
                "n_positions": 256,
                "vocab_size": 3000,
            }
        )
    )
    page = tmp_path / "plan.html"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "batchfit",
            "plan",
            str(config),
            "--gpu",
            "t4",
            "--seq-len",
            "128",
            "--global-batch",
            "16",
            "--headroom",
            "auto",
            "--report",
            str(page),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env={
            **os.environ,
            "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src"),
            "BATCHFIT_DATA_DIR": str(tmp_path / "data"),
            "BATCHFIT_NO_CACHE": "1",
        },
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(proc.stdout)
    assert any("--headroom auto: 5.0%" in w for w in data["warnings"])
    assert data["headroom_wanted_bytes"] == int(0.05 * data["gpu_bytes"])
    html = page.read_text()
    assert "data:image/png;base64," in html and "The step, traced" in html
