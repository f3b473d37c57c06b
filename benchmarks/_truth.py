"""Ground truth: one real CPU training step's peak memory, measured in this fresh process.

Run by benchmarks (never imported by the package). Method (issue #3): a warm-up step at a tiny
size first (loads kernels and thread pools), glibc returning freed blocks
(MALLOC_MMAP_THRESHOLD_=65536, set by the parent), then the kernel's high-water mark is reset
(/proc/self/clear_refs, "5") and the model is built and trained for two steps so optimizer
state exists. Truth = VmHWM - VmRSS before the model is built.

    python _truth.py '{"model": "gpt2", "setup": {...}, "micro": 4, "seq": 256}'
"""

from __future__ import annotations

import gc
import json
import sys
import time

from batchfit._memwatch import status_bytes
from batchfit._oom import _malloc_trim


def main() -> None:
    spec = json.loads(sys.argv[1])
    import torch

    from batchfit.memory import _hf_trace, trace
    from batchfit.models import resolve_model
    from batchfit.search._probe import warm_up
    from batchfit.spec import TrainingSetup

    torch.manual_seed(0)
    torch.set_num_threads(2)
    info = resolve_model(spec["model"], spec.get("task"))
    setup = TrainingSetup(**spec["setup"]).resolved(device="cpu", bf16_supported=True)

    def step(micro: int, seq: int) -> None:
        with trace.quiet():
            parts = _hf_trace.step_parts(info, setup, micro=micro, seq=seq, emulate_cuda=False)
            trace.training_steps(
                parts.model,
                parts.optimizer,
                parts.make_batch,
                parts.loss_of,
                autocast_dtype=parts.autocast_dtype,
                steps=2,
            )

    warm_up(info, setup)  # the probe's own warm-up: a 1-layer step at a tiny size
    gc.collect()
    _malloc_trim()
    rss0 = status_bytes("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    start = time.perf_counter()
    step(spec["micro"], spec["seq"])
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
