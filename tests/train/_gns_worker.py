"""One rank of the noise-scale test: ``torchrun --nproc_per_node 2 _gns_worker.py OUT_DIR``.

Gloo on the CPU. Every scenario trains ``linear_stack`` for 3 steps with SGD on
``token_batches(3, 8, seed=5)``, each rank taking its half (``shard``: unequal token counts),
and records ``StepResult.noise_scale`` per step. The test replays the same micro-batches in
one process.

- ``ddp``: ``Accumulator`` on a DDP model, micro-batches of 3 and 1 sequences, DDP's sync.
- ``ddp-batcher``: ``MicroBatcher`` at micro-batch 2 (deferred sync, summed buckets).
- ``ddp-one-micro-step``: one micro-step of 4 per rank: the two ranks' micro-batches are
  the small batches (one process would have none).
- ``fsdp``: FSDP2 (every layer and the root), micro-batches of 3 and 1.
- ``fsdp-batcher``: FSDP2 under ``MicroBatcher`` at 2 (parameters held unsharded).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from tests.train._ddp_worker import LR, shard

SLICES = {"ddp": [(0, 3), (3, 4)], "ddp-batcher": [(0, 2), (2, 4)], "ddp-one-micro-step": [(0, 4)]}
SLICES["fsdp"], SLICES["fsdp-batcher"] = SLICES["ddp"], SLICES["ddp-batcher"]


def run(name: str, rank: int, world: int) -> list[float | None]:
    from batchfit.train import Accumulator, MicroBatcher, cross_entropy_sum
    from tests._tiny import linear_stack, token_batches
    from tests.train._fsdp_worker import sharded

    model: Any = linear_stack()
    model = sharded(model) if name.startswith("fsdp") else DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    slices = SLICES[name]
    acc = Accumulator(model, opt, len(slices), noise_scale=True, noise_scale_ema=0.5)
    values = []
    for batch in token_batches(3, 8, seed=5):
        ids, labels = shard(batch, rank, world)
        if name.endswith("batcher"):
            batcher = MicroBatcher(acc, slices[0][1] - slices[0][0])

            def step_fn(micro: Any) -> Any:
                return cross_entropy_sum(model(micro[0]), micro[1])

            result = batcher.run((ids, labels), step_fn)
        else:
            for start, stop in slices:
                with acc.micro_step() as micro:
                    acc.backward(*cross_entropy_sum(model(ids[start:stop]), labels[start:stop]))
            assert micro.result is not None
            result = micro.result
        values.append(result.noise_scale)
    return values


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    record = {name: run(name, rank, world) for name in SLICES}
    (Path(sys.argv[1]) / f"gns{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
