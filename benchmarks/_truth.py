"""Ground truth: one real CPU training step's peak memory, measured in this fresh process.

Run by benchmarks (never imported by the package). Method: a warm-up step of a 1-layer copy of the
model at the case's own micro-batch and sequence first. It loads what a process keeps once it has
run a step of these shapes: kernels, thread pools, and MKL's GEMM buffer cache (MKL's "fast memory
manager" keeps each thread's packing buffers for the life of the process: 16.6 MiB for a 512-wide
model with a 50k vocabulary on 2 threads, none with ``MKL_DISABLE_FAST_MM=1``; every layer of a
stack has the same GEMM shapes, so one layer loads them all). With the old warm-up at a tiny size
this cache was half loaded and the other half (about 10.5 MiB) landed in the truth as a constant the
step does not allocate again. Then, with glibc returning freed blocks (MALLOC_MMAP_THRESHOLD_=65536,
set by the parent), the kernel's high-water mark is reset (/proc/self/clear_refs, "5") and the model
is built and trained for two steps so optimizer state exists. Truth = VmHWM - VmRSS before the model
is built. A QLoRA model is loaded with bitsandbytes (``_bnb_truth.py``: a checkpoint written and
read back through transformers' quantizer); the mark is reset again once it is loaded, so what
it holds counts and the loading's transients (the 16-bit checkpoint read before it is quantised)
do not.

The model, optimizer and batches are built as batchfit builds them (``step_parts``: the setup
applied), but the loop is written here, apart from batchfit's own loop code, since it is the
ground truth. ``loop`` picks which of the two loops users run:

- ``trainer`` (HF Trainer, TRL, Lightning): ``loss = model(**batch).loss`` inside autocast, so
  the outputs (logits) die before backward; ``del batch``; ``loss.backward()``.
- ``keep-outputs`` (the HF course loop, nanoGPT): ``out = model(**batch)``;
  ``out.loss.backward()`` while ``out`` (and the batch) are held.

Both run two optimizer steps with ``zero_grad(set_to_none=True)`` after each.

    python _truth.py '{"model": "gpt2", "setup": {...}, "micro": 4, "seq": 256, "loop": "trainer"}'
"""

from __future__ import annotations

import contextlib
import gc
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from batchfit._memwatch import status_bytes
from batchfit._oom import _malloc_trim

LOOPS = ("trainer", "keep-outputs")


def autocast(
    dtype: torch.dtype | None, device_type: str = "cpu"
) -> contextlib.AbstractContextManager[Any]:
    return contextlib.nullcontext() if dtype is None else torch.autocast(device_type, dtype=dtype)


def train(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    make_batch: Callable[[], dict[str, Any]],
    autocast_dtype: torch.dtype | None,
    loop: str,
    steps: int,
    device_type: str = "cpu",
) -> None:
    """``steps`` optimizer steps of ``loop`` (see the module docstring) on ``device_type``."""
    if loop not in LOOPS:
        raise ValueError(f"loop {loop!r} is not one of: {', '.join(LOOPS)}")
    for _ in range(steps):
        batch = make_batch()
        if loop == "trainer":
            with autocast(autocast_dtype, device_type):
                loss = model(**batch).loss  # HF Trainer.compute_loss returns only the loss
            del batch
            loss.backward()
            del loss
        else:
            with autocast(autocast_dtype, device_type):
                out = model(**batch)
            out.loss.backward()  # the outputs and the batch live through backward
            del out, batch
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def _reset_peak() -> None:
    """Reset the kernel's high-water mark (VmHWM) to the RSS now."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def main() -> None:
    spec = json.loads(sys.argv[1])
    from batchfit.memory.trace import hf as _hf_trace
    from batchfit.models import resolve_model
    from batchfit.spec import TrainingSetup

    torch.manual_seed(0)
    torch.set_num_threads(2)
    info = resolve_model(spec["model"], spec.get("task"))
    loop = spec.get("loop", "trainer")
    # the loop is part of the setup too: a chunked loss under keep-outputs returns every chunk's
    # logits for the loop to hold
    fields = {**spec["setup"], "loop": loop}
    setup = TrainingSetup(**fields).resolved(device="cpu", bf16_supported=True)

    def step(micro: int, seq: int, depth: int | None, steps: int, reset: bool = False) -> None:
        built = None
        if setup.method == "qlora":  # bitsandbytes' own layers (_bnb_truth.py)
            from _bnb_truth import build_4bit

            built = build_4bit(info, setup, depth)
            gc.collect()
            _malloc_trim()
        if reset:  # after a QLoRA model is loaded: its loading transients are not the step's
            _reset_peak()
        parts = _hf_trace.step_parts(
            info, setup, micro=micro, seq=seq, emulate_cuda=False, depth=depth, built=built
        )
        train(parts.model, parts.optimizer, parts.make_batch, parts.autocast_dtype, loop, steps)

    # warm-up: a 1-layer step at the case's sizes loads kernels, thread pools, MKL's GEMM buffers
    step(spec["micro"], spec["seq"], 1, 1)
    gc.collect()
    _malloc_trim()
    rss0 = status_bytes("VmRSS")
    _reset_peak()
    start = time.perf_counter()
    step(spec["micro"], spec["seq"], None, 2, reset=True)
    print(
        json.dumps(
            {
                "truth_bytes": status_bytes("VmHWM") - rss0,
                "rss0": rss0,
                "seconds": time.perf_counter() - start,
            }
        )
    )


if __name__ == "__main__":
    main()
