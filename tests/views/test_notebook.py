"""The example notebook, executed by a real kernel, converted to HTML and loaded in headless
Chromium: the estimate's and the plan's own renderings show, and nothing fails to load."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.views._browser import BROWSER, NO_BROWSER, render

pytest.importorskip("nbconvert", reason="the notebook test needs the dev extra's nbconvert")
pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOK = Path(__file__).resolve().parents[2] / "examples" / "batchfit.ipynb"

# nbconvert's lab template with its CDN scripts (require.js, MathJax, mermaid) left out: the
# page must load whole with no network, as the notebook's own outputs do.
OFFLINE_TEMPLATE = """{%- extends 'lab/index.html.j2' -%}
{%- block html_head_js -%}{%- endblock html_head_js -%}
{%- block html_head_js_mathjax -%}{%- endblock html_head_js_mathjax -%}
{%- block html_head_js_mermaidjs -%}{%- endblock html_head_js_mermaidjs -%}
"""


def _html_outputs(nb: object) -> list[str]:
    return [
        "".join(out["data"]["text/html"])
        for cell in nb.cells  # type: ignore[attr-defined]
        if cell.cell_type == "code"
        for out in cell.outputs
        if "text/html" in out.get("data", {})
    ]


@pytest.mark.slow
@pytest.mark.skipif(BROWSER is None, reason=NO_BROWSER)
def test_the_example_notebook_renders_in_a_real_browser(tmp_path: Path) -> None:
    import jinja2
    import nbformat
    from nbclient import NotebookClient
    from nbconvert import HTMLExporter

    nb = nbformat.read(NOTEBOOK, as_version=4)
    # a cell that raises fails here (CellExecutionError), naming the cell
    NotebookClient(nb, timeout=120, resources={"metadata": {"path": str(tmp_path)}}).execute()
    estimate_html, plan_html = _html_outputs(nb)  # the two views, as Jupyter gets them
    assert "peak allocated" in estimate_html and "<svg" in estimate_html
    assert "micro-batch" in plan_html and "accumulation" in plan_html

    exporter = HTMLExporter(
        extra_loaders=[jinja2.DictLoader({"offline.html.j2": OFFLINE_TEMPLATE})],
        template_file="offline.html.j2",
    )
    body, _ = exporter.from_notebook_node(nb)
    assert "<script src=" not in body  # nothing to fetch
    page = tmp_path / "batchfit.html"
    page.write_text(body)

    seen = render(page, tmp_path / "notebook.png", size="1100,2400")
    assert "batchfit in a notebook" in seen.dom
    assert "gpt2" in seen.dom and "peak allocated" in seen.dom
    assert "tokens/s per GPU" in seen.dom  # the estimate's predicted time on the T4
    assert "net::ERR" not in seen.log, seen.log[-2000:]
    shot = seen.screenshot.read_bytes()
    assert shot[:4] == b"\x89PNG" and len(shot) > 20_000
