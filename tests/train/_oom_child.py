"""Child process of the real-OOM tests: a ``MicroBatcher`` under an ``RLIMIT_DATA`` budget.

Run with ``MALLOC_MMAP_THRESHOLD_=65536`` (freed blocks go back to the OS, so the limit
behaves like a GPU's memory). ``python _oom_child.py MODE BUDGET_MIB OUT_DIR``:

- ``recover``: two global batches of 32 starting at micro-batch 16; saves the parameters.
- ``repeat``: 21 global batches of 16, each with a fresh batcher at micro-batch 16 that runs
  out of memory and recovers at 8; records the RSS after each.
- ``fits SIZE``: one global batch at micro-batch SIZE, no recovery (sizing the budget).
"""

from __future__ import annotations

import json
import logging
import resource
import sys
from pathlib import Path

import torch


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def main() -> None:
    from batchfit.train import Accumulator, MicroBatcher
    from tests._tiny import wide_batches, wide_mlp, wide_step_fn

    mode, budget_mib, out = sys.argv[1], float(sys.argv[2]), Path(sys.argv[3])
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    torch.set_num_threads(1)
    model = wide_mlp()
    acc = Accumulator(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    step_fn = wide_step_fn(model)
    batches = wide_batches(21 if mode == "repeat" else 2, 16 if mode == "repeat" else 32)
    with torch.no_grad():  # start the thread pool and the allocator before the limit
        model(torch.ones(1, 1, batches[0].shape[2]))
    torch.manual_seed(0)  # dropout draws; the parent's reference seeds the same
    limit = _status("VmData") + int(budget_mib * 2**20)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, resource.RLIM_INFINITY))
    record: dict[str, list[float]] = {"micro": [], "ooms": [], "loss": [], "rss": []}
    for batch in batches:
        if mode == "fits":
            batcher = MicroBatcher(acc, int(sys.argv[4]), min_micro_batch_size=int(sys.argv[4]))
        elif mode == "repeat" or not record["micro"]:
            batcher = MicroBatcher(acc, 16)
        result = batcher.run(batch, step_fn)
        record["micro"].append(result.micro_batch_size or 0)
        record["ooms"].append(result.ooms)
        record["loss"].append(result.loss)
        record["rss"].append(_status("VmRSS"))
    resource.setrlimit(resource.RLIMIT_DATA, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    torch.save(model.state_dict(), out / "params.pt")
    (out / "record.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
