"""The step as a picture and as a PyTorch memory snapshot (issue #14, part 1)."""

from __future__ import annotations

import base64
import json
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest

from batchfit.hardware import get_gpu
from batchfit.memory import timeline
from batchfit.memory._trace_estimate import estimate_trace
from batchfit.memory._trace_result import CATEGORIES
from batchfit.memory.analytic import resolve_setup
from batchfit.models import resolve_model
from batchfit.spec import TrainingSetup

ROOT = Path(__file__).resolve().parents[2]
TINY = {
    "model_type": "gpt2",
    "architectures": ["GPT2LMHeadModel"],
    "n_embd": 128,
    "n_layer": 2,
    "n_head": 4,
    "n_positions": 256,
    "vocab_size": 3000,
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("tiny") / "config.json"
    path.write_text(json.dumps(TINY))
    return str(path)


@pytest.fixture(scope="module")
def cuda_timeline(tiny: str) -> timeline.StepTimeline:
    model, gpu = resolve_model(tiny), get_gpu("t4")
    setup = resolve_setup(model, TrainingSetup(), "cuda", gpu)
    return timeline.step_timeline(
        model, setup, micro_batch_size=2, seq_len=64, device="cuda", gpu=gpu, grad_accum_steps=2
    )


def test_the_timeline_is_the_estimates_dry_run(tiny: str) -> None:
    model = resolve_model(tiny)
    setup = resolve_setup(model, TrainingSetup(), "cpu", None)
    tl = timeline.step_timeline(
        model, setup, micro_batch_size=2, seq_len=64, device="cpu", gpu=None
    )
    est = estimate_trace(
        model,
        TrainingSetup(),
        micro_batch_size=2,
        seq_len=64,
        device="cpu",
        gpu=None,
        full_depth=True,
    )
    assert tl.peak_bytes == est.peak_bytes
    assert all(len(s) == len(tl.events) for s in tl.series.values())
    assert {p for _, p in tl.phases} >= {"forward", "backward", "optimizer-step", "zero-grad"}
    assert tl.reserved is None  # no allocator on the CPU


def test_cuda_timeline_draws_the_reserve_and_accumulation(
    cuda_timeline: timeline.StepTimeline,
) -> None:
    tl = cuda_timeline
    assert tl.reserved is not None
    totals = [sum(tl.series[c][i] for c in CATEGORIES) for i in range(len(tl.events))]
    assert all(r >= t for r, t in zip(tl.reserved, totals, strict=True))
    # two steps of two micro-steps: four forwards
    assert sum(1 for _, p in tl.phases if p == "forward") == 4
    assert "later micro-step" in tl.peak_label


def test_plot_writes_a_png(cuda_timeline: timeline.StepTimeline, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "t.png"
    timeline.plot(cuda_timeline, path, "tiny", get_gpu("t4").memory_bytes)
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_snapshot_replays_to_the_same_peak_and_pytorch_reads_it(
    cuda_timeline: timeline.StepTimeline, tmp_path: Path
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
    return subprocess.run(
        [sys.executable, "-m", "torch.cuda._memory_viz", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_snapshot_holds_what_the_step_leaves_allocated(
    cuda_timeline: timeline.StepTimeline, tmp_path: Path
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
    cuda_timeline: timeline.StepTimeline, tmp_path: Path
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


def test_peak_label_gives_each_modules_size(cuda_timeline: timeline.StepTimeline) -> None:
    text = timeline.peak_modules_text(cuda_timeline.top_modules)
    lines = text.splitlines()[1:]
    assert len(lines) == len(cuda_timeline.top_modules) > 0
    for line, (name, nbytes) in zip(lines, cuda_timeline.top_modules, strict=True):
        assert line == f"  {name}  {nbytes / (1 << 20):.1f} MiB"


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "batchfit", "estimate", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src"), "BATCHFIT_NO_CACHE": "1"},
    )


def test_cli_refuses_what_it_cannot_draw_before_the_work(tiny: str, tmp_path: Path) -> None:
    proc = _cli(tiny, "-b", "2", "-s", "64", "--timeline", str(tmp_path / "no" / "t.png"))
    assert proc.returncode == 2 and "--timeline" in proc.stderr
    proc = _cli(
        tiny,
        "-b",
        "2",
        "-s",
        "64",
        "--gpu",
        "t4",
        "--num-gpus",
        "2",
        "--sharding",
        "zero2",
        "--snapshot",
        str(tmp_path / "s.pickle"),
    )
    assert proc.returncode == 2 and "analytic engine answered" in proc.stderr
    assert not (tmp_path / "s.pickle").exists()
