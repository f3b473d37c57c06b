"""What a real step allocates that its tensors alone do not show: the CPU bf16 fallback
matmul's fp32 accumulator, and autograd's in-place gradient sum. Each rule is checked against
the process's real high-water mark in a fresh process, then against the tracker."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from batchfit.memory.trace.tracker import AllocationTracker, _fp32_scratch, cpu_bf16_gemm_scratch

MiB = 2**20
aten = torch.ops.aten


def _real_hwm_delta(body: str) -> dict[str, int]:
    """Run ``body`` in a fresh process (glibc returning freed blocks at once); it sets
    ``out[name] = VmHWM rise`` through ``hwm(name, fn)``."""
    script = (
        textwrap.dedent(
            """
        import json, torch
        import torch.nn.functional as F
        from batchfit._memwatch import status_bytes
        torch.set_num_threads(1)
        out = {}
        def hwm(name, fn):
            fn()  # warm-up: kernels, thread pools, library caches
            open("/proc/self/clear_refs", "w").write("5")
            base = status_bytes("VmRSS")
            fn()
            out[name] = status_bytes("VmHWM") - base
        """
        )
        + textwrap.dedent(body)
        + "\nprint(json.dumps(out))\n"
    )
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_fp32_scratch_only_for_transposed_first_bf16_matrix() -> None:
    a = torch.empty(64, 512, dtype=torch.bfloat16)
    b = torch.empty(64, 256, dtype=torch.bfloat16)
    out = torch.empty(512, 256, dtype=torch.bfloat16)
    assert _fp32_scratch(aten.mm.default, (a.t(), b), out) == 4 * 512 * 256
    assert _fp32_scratch(aten.addmm.default, (out, a.t(), b), out) == 4 * 512 * 256
    w = torch.empty(256, 512, dtype=torch.bfloat16)
    x = torch.empty(64, 512, dtype=torch.bfloat16)
    y = torch.empty(64, 256, dtype=torch.bfloat16)
    assert _fp32_scratch(aten.mm.default, (x, w.t()), y) == 0  # forward: x @ W.t()
    assert _fp32_scratch(aten.mm.default, (y, w), x) == 0  # input gradient: g @ W
    fp32 = torch.empty(512, 256)
    assert _fp32_scratch(aten.mm.default, (a.t().float(), b.float()), fp32) == 0
    assert _fp32_scratch(aten.add.Tensor, (out, out), out) == 0


@pytest.mark.skipif(not cpu_bf16_gemm_scratch(), reason="this CPU runs bf16 matmuls in oneDNN")
def test_cpu_bf16_weight_gradient_matmul_holds_an_fp32_output() -> None:
    m, k, n = 2048, 64, 1024  # output 2048 x 1024: 8 MiB of fp32 scratch, 4 MiB of bf16 output
    real = _real_hwm_delta(
        f"""
        a = torch.randn({k}, {m}).to(torch.bfloat16)
        b = torch.randn({k}, {n}).to(torch.bfloat16)
        hwm("transposed", lambda: a.t() @ b)
        hwm("plain", lambda: a.t().contiguous() @ b)
        """
    )
    out_bytes = 2 * m * n
    assert real["transposed"] - out_bytes == pytest.approx(4 * m * n, rel=0.1)
    assert real["plain"] < out_bytes + 2 * m * k + MiB  # the copy of a, the output, no scratch

    a = torch.randn(k, m).to(torch.bfloat16)
    b = torch.randn(k, n).to(torch.bfloat16)
    for scratch, expected in ((True, out_bytes + 4 * m * n), (False, out_bytes)):
        with AllocationTracker(gemm_scratch=scratch) as tracker:
            tracker.track(a)
            tracker.track(b)
            before = tracker.live_bytes
            a.t() @ b
        assert tracker.peak_total - before == expected


def _tied_backward_peak() -> int:
    """Backward of two uses of one 4 MiB weight: its two (plain, dense) gradients are summed."""
    weight = torch.zeros(1024, 1024, requires_grad=True)
    x, y = torch.randn(1024, 1024), torch.randn(1024, 1024)
    with AllocationTracker() as tracker:
        for t in (weight, x, y):
            tracker.track(t, "weights")
        loss = (weight * x).sum() + (weight * y).sum()
        tracker.set_phase("backward")
        start = tracker.live_bytes
        loss.backward()
        tracker.set_phase("optimizer")
    return tracker.timeline.phase_peaks["backward|"].total - start


def test_gradient_sum_in_place_as_autograd_does() -> None:
    table = 1024 * 1024 * 4
    real = _real_hwm_delta(
        """
        weight = torch.zeros(1024, 1024, requires_grad=True)
        x, y = torch.randn(1024, 1024), torch.randn(1024, 1024)
        def step():
            ((weight * x).sum() + (weight * y).sum()).backward()
            weight.grad = None
        hwm("backward", step)
        """
    )
    # the engine adds the second gradient into the first (add_): two tables, not three
    assert real["backward"] == pytest.approx(2 * table, rel=0.1)
    assert _tied_backward_peak() == pytest.approx(2 * table, rel=0.01)
