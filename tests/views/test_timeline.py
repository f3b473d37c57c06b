"""The step as a picture and as a PyTorch memory snapshot."""

from __future__ import annotations

import base64
import contextlib
import io
import pickle
import re
import runpy
import subprocess
import sys
import traceback
import warnings
from pathlib import Path

import pytest

from batchfit.hardware import get_gpu
from batchfit.memory.trace.result import CATEGORIES
from batchfit.memory.trace.timeline import StepTimeline, group_modules
from batchfit.views import timeline
from tests._cli import run_cli


@pytest.fixture(scope="module")
def tiny(timeline_config: str) -> str:
    return timeline_config


def test_plot_writes_a_png(cuda_timeline: StepTimeline, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "t.png"
    timeline.plot(cuda_timeline, path, "tiny", get_gpu("t4").memory_bytes)
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_snapshot_replays_to_the_same_peak_and_pytorch_reads_it(
    cuda_timeline: StepTimeline, tmp_path: Path
) -> None:
    path = tmp_path / "s.pickle"
    timeline.write_snapshot(cuda_timeline, path, "cuda")
    with open(path, "rb") as f:
        snap = pickle.load(f)
    live = peak = 0
    sizes = {}
    for entry in snap["device_traces"][0]:
        if entry["action"] == "alloc":
            sizes[entry["addr"]] = entry["size"]
            live += entry["size"]
        elif entry["action"] == "free_completed":
            live -= sizes.pop(entry["addr"])
        peak = max(peak, live)
    assert peak == cuda_timeline.peak_bytes
    # PyTorch's own reader (it runs without a GPU)
    for args in (
        ["stats", str(path)],
        ["trace_plot", str(path), "-o", str(tmp_path / "t.html")],
        ["segment_plot", str(path), "-o", str(tmp_path / "s.html")],
    ):
        proc = _memory_viz(*args)
        assert proc.returncode == 0, proc.stderr[-1000:]
    assert (tmp_path / "t.html").stat().st_size > 1000
    assert (tmp_path / "s.html").stat().st_size > 1000


def _memory_viz(*args: str) -> subprocess.CompletedProcess[str]:
    """PyTorch's ``python -m torch.cuda._memory_viz ARGS``, run as its ``__main__`` in this
    process (the same reader and writers, without a fresh interpreter importing torch)."""
    out, err = io.StringIO(), io.StringIO()
    code = 0
    argv = sys.argv
    sys.argv = ["_memory_viz.py", *args]
    try:
        with (
            contextlib.redirect_stdout(out),
            contextlib.redirect_stderr(err),
            warnings.catch_warnings(),
        ):
            # runpy's note that the module was imported before (with torch.cuda) as a module
            warnings.filterwarnings("ignore", "'torch.cuda._memory_viz' found", RuntimeWarning)
            runpy.run_module("torch.cuda._memory_viz", run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except Exception:  # as the module run on its own would: a traceback and status 1
        code = 1
        err.write(traceback.format_exc())
    finally:
        sys.argv = argv
    return subprocess.CompletedProcess(["_memory_viz", *args], code, out.getvalue(), err.getvalue())


def test_snapshot_holds_what_the_step_leaves_allocated(
    cuda_timeline: StepTimeline, tmp_path: Path
) -> None:
    """As a real ``_snapshot()`` after a step: weights and optimizer state stay allocated;
    zero_grad(set_to_none=True) freed the gradients; the activations are gone."""
    from torch.cuda._memory_viz import Bytes

    tl = cuda_timeline
    end = {c: tl.series[c][-1] for c in CATEGORIES}
    assert end["weights"] > 0 and end["optimizer_state"] > 0
    assert end["gradients"] == 0 and end["activations"] == 0
    path = tmp_path / "s.pickle"
    timeline.write_snapshot(tl, path, "cuda")
    with open(path, "rb") as f:
        snap = pickle.load(f)
    blocks = [b for seg in snap["segments"] for b in seg["blocks"]]
    assert all(b["state"] == "active_allocated" for b in blocks)
    assert sum(b["requested_size"] for b in blocks) == sum(end.values())
    held = {c: sum(b["requested_size"] for b in blocks if b["frames"][0]["name"] == c) for c in end}
    assert held == end
    # the trace replays from nothing to that state
    live: dict[int, int] = {}
    for entry in snap["device_traces"][0]:
        if entry["action"] == "alloc":
            live[entry["addr"]] = entry["size"]
        elif entry["action"] == "free_completed":
            del live[entry["addr"]]
    assert sorted(live) == sorted(b["address"] for b in blocks)
    proc = _memory_viz("stats", str(path))
    assert proc.returncode == 0, proc.stderr[-1000:]
    assert f"total_allocated: {Bytes(sum(end.values()))}\n" in proc.stdout
    assert "total_allocated: 0.0B" not in proc.stdout


def test_snapshot_frames_name_the_module_and_phase(
    cuda_timeline: StepTimeline, tmp_path: Path
) -> None:
    """What trace_plot's hover shows for an allocation: its module, category and phase."""
    path = tmp_path / "s.pickle"
    timeline.write_snapshot(cuda_timeline, path, "cuda")
    html = tmp_path / "t.html"
    assert _memory_viz("trace_plot", str(path), "-o", str(html)).returncode == 0
    # the page carries the snapshot as base64 (its script draws it): read it back from there
    payload = re.search(r'"base64": "([^"]+)"', html.read_text())
    assert payload is not None
    snap = pickle.loads(base64.b64decode(payload.group(1)))
    allocs = [e for e in snap["device_traces"][0] if e["action"] == "alloc"]
    assert all(e["frames"] for e in allocs)
    files = {f["filename"] for e in allocs for f in e["frames"]}
    assert {"transformer.h.0.mlp.c_fc", "transformer.h.1.attn", "lm_head"} <= files
    phases = {f.partition(" ")[0] for f in files}
    assert {"setup", "forward", "backward", "optimizer-step"} <= phases
    # accumulation: micro-steps are named; the activations of the module say so
    mlp = [e for e in allocs if e["frames"][0]["filename"] == "transformer.h.0.mlp.c_fc"]
    assert {e["frames"][0]["name"] for e in mlp} == {"activations"}
    assert {e["frames"][1]["filename"] for e in mlp} >= {
        "forward (step 2, micro-step 1)",
        "forward (step 2, micro-step 2)",
    }


def test_peak_label_groups_a_stacks_layers(cuda_timeline: StepTimeline) -> None:
    """The two layers' modules are one line each (``transformer.h.*.mlp.act: 2 x 1.0 MiB``),
    not one line a layer; each line gives its size."""
    text = timeline.peak_modules_text(cuda_timeline.top_modules)
    lines = text.splitlines()[1:]
    assert len(lines) == len(cuda_timeline.top_modules) > 0
    assert "transformer.h.0." not in text and "transformer.h.1." not in text
    assert "transformer.h.*.mlp.act: 2 × " in text
    for line, group in zip(lines, cuda_timeline.top_modules, strict=True):
        if group.count == 1:
            assert line == f"  {group.name}: {group.total_bytes / (1 << 20):.1f} MiB"
        elif group.each_bytes is not None:
            assert line == f"  {group.name}: {group.count} × {group.each_bytes / (1 << 20):.1f} MiB"
        else:
            assert line == f"  {group.name}: {group.count} layers, " + (
                f"{group.total_bytes / (1 << 20):.1f} MiB"
            )
    totals = [g.total_bytes for g in cuda_timeline.top_modules]
    assert totals == sorted(totals, reverse=True)


def test_group_modules_ranks_groups_by_their_total() -> None:
    by_module = {
        **{f"model.layers.{i}.mlp.act_fn": 84 << 20 for i in range(12)},  # 12 x 84 MiB
        **{f"model.layers.{i}.self_attn": (100 + i) << 20 for i in range(12)},  # sizes differ
        "lm_head": 900 << 20,  # more than any one layer, less than twelve
        "model.layers.3.mlp.experts.7": 1 << 20,  # only the first index is the layer's
        "model.layers.5.mlp.experts.7": 1 << 20,
        "model.layers.5.mlp.experts.6": 1 << 20,
    }
    groups = group_modules(by_module)
    assert [(g.name, g.count, g.total_bytes, g.each_bytes) for g in groups] == [
        ("model.layers.*.self_attn", 12, sum(range(100, 112)) << 20, None),
        ("model.layers.*.mlp.act_fn", 12, 12 * 84 << 20, 84 << 20),
        ("lm_head", 1, 900 << 20, 900 << 20),
        ("model.layers.*.mlp.experts.7", 2, 2 << 20, 1 << 20),
        ("model.layers.5.mlp.experts.6", 1, 1 << 20, 1 << 20),
    ]
    assert timeline.peak_modules_text(groups[:3]).splitlines() == [
        "most activation memory:",
        "  model.layers.*.self_attn: 12 layers, 1.24 GiB",
        "  model.layers.*.mlp.act_fn: 12 × 84.0 MiB",
        "  lm_head: 900.0 MiB",
    ]


def test_the_peak_label_hides_nothing_drawn(cuda_timeline: StepTimeline) -> None:
    """The label box sits above the curve, the reserve and the GPU's line (the y axis leaves
    it room); the legend is outside the axes."""
    pytest.importorskip("matplotlib")
    from matplotlib import pyplot as plt
    from matplotlib.text import Annotation

    tl, gpu_bytes = cuda_timeline, 2 * cuda_timeline.peak_bytes  # the GPU's line near the top
    fig = timeline.figure(tl, "tiny", gpu_bytes)
    try:
        fig.tight_layout()  # as _plots.save lays it out
        fig.canvas.draw()
        (ax,) = fig.axes
        (label,) = [t for t in ax.texts if isinstance(t, Annotation)]
        box = label.get_bbox_patch().get_window_extent()
        assert tl.reserved is not None
        top_bytes = max(gpu_bytes, *tl.reserved, tl.peak_bytes)
        top_px = ax.transData.transform((0, top_bytes / 2**30))[1]
        assert top_px < box.y0
        assert box.y1 <= ax.get_window_extent().y1  # still inside the axes
        legend = ax.get_legend().get_window_extent()
        assert legend.x0 >= ax.get_window_extent().x1
    finally:
        plt.close(fig)


def test_the_peak_box_gives_the_estimate_s_figure(cuda_timeline: StepTimeline) -> None:
    """The box says the estimate's peak (its table's, layers extrapolated), and names the
    whole-step dry run's own peak where that differs."""
    pytest.importorskip("matplotlib")
    from matplotlib import pyplot as plt
    from matplotlib.text import Annotation

    tl = cuda_timeline
    estimate_peak = tl.peak_bytes + (512 << 20)
    fig = timeline.figure(tl, "tiny", None, estimate_peak)
    try:
        (label,) = [t for t in fig.axes[0].texts if isinstance(t, Annotation)]
        text = label.get_text()
        assert text.startswith(f"peak {estimate_peak / 2**30:.2f} GiB (the estimate)")
        assert f"dry run's own peak: {tl.peak_bytes / 2**30:.2f} GiB" in text
    finally:
        plt.close(fig)
    assert timeline.peak_text(tl, tl.peak_bytes).count("GiB") == 1


def test_cli_refuses_what_it_cannot_draw_before_the_work(
    tiny: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from batchfit import models

    monkeypatch.setenv("BATCHFIT_NO_CACHE", "1")
    resolve = models.resolve_model

    def unread(*args: object, **kwargs: object) -> object:
        raise AssertionError("the model was read before the options were checked")

    # a folder that does not exist: refused from the options alone, the model never read
    monkeypatch.setattr(models, "resolve_model", unread)
    code, out, err = run_cli(
        ["estimate", tiny, "-b", "2", "-s", "64", "--timeline", str(tmp_path / "no" / "t.png")],
        capsys,
    )
    assert code == 2 and "--timeline" in err and not out
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    # ZeRO-2 on 2 GPUs: the formulas answer, so there is no dry run to draw, and nothing is
    # written
    monkeypatch.setattr(models, "resolve_model", resolve)
    args = ["estimate", tiny, "-b", "2", "-s", "64", "--gpu", "t4", "--num-gpus", "2"]
    args += ["--sharding", "zero2", "--snapshot", str(tmp_path / "s.pickle")]
    code, out, err = run_cli(args, capsys)
    assert code == 2 and "analytic engine answered" in err
    assert not (tmp_path / "s.pickle").exists()
