"""One rank of the distributed tests: ``torchrun --nproc_per_node 2 _ddp_worker.py OUT_DIR``.

Both scenarios use gloo on the CPU, SGD (a scale error shows), and hand each rank a different
number of tokens: the sequences of a global batch are sorted by length and rank 0 takes the
longer half.

- ``native``: ``Accumulator`` on a DDP model, 2 micro-steps per rank, DDP's own sync.
- ``oom``: ``MicroBatcher`` from micro-batch 8; rank 1 alone runs out of memory (raised half
  way through backward) at size 8, so both ranks must redo the batch at 4.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from tests._tiny import TokenBatch

LR = 0.5


def shard(batch: TokenBatch, rank: int, world: int) -> TokenBatch:
    ids, labels = batch
    order = torch.argsort((labels != -100).sum(1), descending=True, stable=True)
    per_rank = len(ids) // world
    mine = order[rank * per_rank : (rank + 1) * per_rank]
    return ids[mine], labels[mine]


def main() -> None:
    from batchfit.train import Accumulator, MicroBatcher, cross_entropy_sum
    from tests._tiny import linear_stack, token_batches

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    out = Path(sys.argv[1])
    record: dict[str, list[dict[str, object]]] = {"native": [], "oom": []}

    model = DistributedDataParallel(linear_stack())
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=LR), grad_accum_steps=2)
    for batch in token_batches(2, 8, seed=5):
        ids, labels = shard(batch, rank, world)
        for start in (0, 2):
            with acc.micro_step() as micro:
                logits = model(ids[start : start + 2])
                acc.backward(*cross_entropy_sum(logits, labels[start : start + 2]))
        assert micro.result is not None
        record["native"].append(dataclasses.asdict(micro.result))
    torch.save(model.module.state_dict(), out / f"native{rank}.pt")

    model = DistributedDataParallel(linear_stack())
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=LR))
    batcher = MicroBatcher(acc, 8)

    def step_fn(micro: TokenBatch) -> tuple[torch.Tensor, torch.Tensor]:
        ids, labels = micro
        logits = model(ids)
        if rank == 1 and len(ids) == 8:
            logits.register_hook(lambda g: _oom())
        return cross_entropy_sum(logits, labels)

    for batch in token_batches(2, 32, seed=6):
        result = batcher.run(shard(batch, rank, world), step_fn)
        record["oom"].append(dataclasses.asdict(result))
    torch.save(model.module.state_dict(), out / f"oom{rank}.pt")
    (out / f"record{rank}.json").write_text(json.dumps(record))
    dist.barrier()  # no rank tears gloo down while the other still has work in flight
    dist.destroy_process_group()


def _oom() -> None:
    raise torch.OutOfMemoryError(f"CUDA out of memory on rank {os.environ['RANK']} (simulated)")


if __name__ == "__main__":
    main()
