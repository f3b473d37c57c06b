"""One rank of the FSDP2 tests: ``torchrun --nproc_per_node 2 _fsdp_worker.py OUT_DIR``.

Gloo on the CPU, SGD (a scale error shows), every layer and the root under ``fully_shard``.
Saves full parameters (``full_tensor()``) and a JSON record per rank.

- ``native``: ``Accumulator`` on FSDP2, 2 micro-steps of 3 and 1 samples per rank (rank 0
  holds the longer sequences: unequal tokens per rank and per micro-batch), clipping to a
  norm the gradient exceeds; every reduce-scatter FSDP2 runs is counted per micro-step.
- ``small`` / ``oom``: ``MicroBatcher`` on FSDP2 with the wide MLP (dropout on).
  ``small`` runs at micro-batch 8 from the start. ``oom`` starts at 16 with rank 1 alone
  under an OS limit (``RLIMIT_DATA``, run with ``MALLOC_MMAP_THRESHOLD_=65536``) that 16
  exceeds and 8 fits: a real allocator error in the middle of rank 1's forward or backward.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import resource
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard

# Test-only: FSDP2's default reduce-scatter, subclassed to count its calls.
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

from tests.train._ddp_worker import LR, shard

CLIP = 0.05  # below the tiny model's gradient norm: clipping acts
OOM_BUDGET_MIB = 64  # above rank 1's VmData at the limit: micro-batch 8 fits, 16 does not
WIDE_LR = 0.01  # the wide MLP's summed squared error diverges at LR


class CountingReduceScatter(DefaultReduceScatter):
    calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        CountingReduceScatter.calls += 1
        return super().__call__(*args, **kwargs)


def sharded(model: nn.Module) -> Any:
    """``fully_shard`` on every layer with parameters, then on the root."""
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer)
    fully_shard(model)
    return model


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {key: value.full_tensor() for key, value in model.state_dict().items()}


def _vmdata() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmData:"):
            return int(line.split()[1]) * 1024
    raise KeyError("VmData")


def native(rank: int, world: int, out: Path) -> list[dict[str, Any]]:
    from batchfit.train import Accumulator, cross_entropy_sum
    from tests._tiny import linear_stack, token_batches

    model = sharded(linear_stack())
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_reduce_scatter(CountingReduceScatter())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    acc = Accumulator(model, opt, grad_accum_steps=2, max_grad_norm=CLIP)
    steps = []
    for batch in token_batches(2, 8, seed=5):
        ids, labels = shard(batch, rank, world)
        counts = []
        for sl in (slice(0, 3), slice(3, 4)):
            before = CountingReduceScatter.calls
            with acc.micro_step() as micro:
                acc.backward(*cross_entropy_sum(model(ids[sl]), labels[sl]))
            counts.append(CountingReduceScatter.calls - before)
        assert micro.result is not None
        steps.append({**dataclasses.asdict(micro.result), "reduce_scatters": counts})
    torch.save(full_state(model), out / f"native{rank}.pt")
    steps.append({"flags_after": _flags(model)})
    return steps


def _flags(model: nn.Module) -> list[list[bool]]:
    """Each FSDP2 parameter group's sync and reshard-after-backward flags (private state)."""
    return [
        [group.reduce_grads, group.all_reduce_grads, group.reshard_after_backward]
        for module in model.modules()
        if isinstance(module, FSDPModule)
        for group in module._get_fsdp_state()._fsdp_param_groups
    ]


class _Messages(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def batcher_run(rank: int, out: Path, name: str, micro: int, limit: bool) -> list[dict[str, Any]]:
    from batchfit.train import Accumulator, MicroBatcher
    from tests._tiny import wide_batches, wide_mlp, wide_step_fn

    model = sharded(wide_mlp())
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=WIDE_LR))
    batcher = MicroBatcher(acc, micro)
    step_fn = wide_step_fn(model)
    batches = [x.chunk(2)[rank] for x in wide_batches(2, 32)]  # 16 samples per rank
    with torch.no_grad():  # start FSDP2's lazy init, thread pools and gloo before the limit
        model(torch.ones(1, 1, batches[0].shape[2]))
    torch.manual_seed(100 + rank)  # dropout draws, the same in every scenario
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    if limit and rank == 1:
        resource.setrlimit(resource.RLIMIT_DATA, (_vmdata() + OOM_BUDGET_MIB * 2**20, hard))
    messages = _Messages()
    logging.getLogger("batchfit.train.recover").addHandler(messages)
    try:
        results = [dataclasses.asdict(batcher.run(x, step_fn)) for x in batches]
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
        logging.getLogger("batchfit.train.recover").removeHandler(messages)
    torch.save(full_state(model), out / f"{name}{rank}.pt")
    return [*results, {"warnings": messages.messages, "flags_after": _flags(model)}]


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    out = Path(sys.argv[1])
    record = {
        "native": native(rank, world, out),
        "small": batcher_run(rank, out, "small", 8, limit=False),
        "oom": batcher_run(rank, out, "oom", 16, limit=True),
    }
    (out / f"record{rank}.json").write_text(json.dumps(record))
    dist.barrier()  # no rank tears gloo down while the other still has work in flight
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
