"""torchrun worker for tests/search/test_search.py: ranks with different limits must agree."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from batchfit.search import find_batch_size


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    limit = 40 if rank == 0 else 20  # rank 1 has the smaller budget

    def step(batch: torch.Tensor) -> None:
        if batch.shape[0] > limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")

    result = find_batch_size(
        step, lambda n: torch.zeros(n, 1), high=64, start=32, steps_per_trial=2, choose="max"
    )
    sizes = [t.micro_batch_size for t in result.trials]
    out = {
        "rank": rank,
        "choice": result.micro_batch_size,
        "max": result.max_fitting_micro_batch,
        "sizes": sizes,
    }
    with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
