"""One rank of the DeepSpeed tests: ``torchrun --nproc_per_node 2 _deepspeed_worker.py OUT``.

A real ``DeepSpeedEngine`` on the CPU (``DS_ACCELERATOR=cpu``, gloo), ZeRO stages 0 and 1
in turn (files ``*_zero{stage}``), SGD, the wide MLP (dropout on), 16 samples per rank
per global batch (``train_batch_size`` 32).

- ``small``: ``train_micro_batch_size_per_gpu`` 8 from the start.
- ``oom``: starts at 16 with rank 1 alone under an OS limit (``RLIMIT_DATA``, run with
  ``MALLOC_MMAP_THRESHOLD_=65536``) that 16 exceeds and 8 fits: a real allocator error.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import resource
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tests.train._fsdp_worker import OOM_BUDGET_MIB, WIDE_LR, _vmdata


def run(
    rank: int, out: Path, stage: int, name: str, micro: int, limit: bool
) -> list[dict[str, Any]]:
    import deepspeed

    from batchfit.integrations.deepspeed import DeepSpeedMicroBatcher
    from tests._tiny import wide_batches, wide_mlp

    model = wide_mlp()
    config = {
        "train_batch_size": 32,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 16 // micro,
        "zero_optimization": {
            "stage": stage,
            # ZeRO-1's default buckets (5e8 elements) would take 2 GB under rank 1's limit
            "reduce_bucket_size": 500_000,
            "allgather_bucket_size": 500_000,
        },
        "zero_allow_untested_optimizer": True,
    }
    optimizer = torch.optim.SGD(model.parameters(), lr=WIDE_LR)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    batcher = DeepSpeedMicroBatcher(engine)

    def step_fn(x: torch.Tensor) -> torch.Tensor:
        return ((engine(x) - x) ** 2).mean()

    batches = [x.chunk(2)[rank] for x in wide_batches(2, 32)]
    with torch.no_grad():
        engine(torch.ones(1, 1, batches[0].shape[2]))
    torch.manual_seed(100 + rank)
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    if limit and rank == 1:
        resource.setrlimit(resource.RLIMIT_DATA, (_vmdata() + OOM_BUDGET_MIB * 2**20, hard))
    try:
        results = [dataclasses.asdict(batcher.run(x, step_fn)) for x in batches]
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
    torch.save(
        {k: v.detach().clone() for k, v in model.state_dict().items()},
        out / f"{name}{rank}_zero{stage}.pt",
    )
    config_after = {
        "micro": engine.train_micro_batch_size_per_gpu(),
        "gas": engine.gradient_accumulation_steps(),
        "train_batch_size": engine.train_batch_size(),
        "global_steps": engine.global_steps,
    }
    return [*results, config_after]


def main() -> None:
    dist.init_process_group("gloo")
    import deepspeed

    # The shared-memory all-reduce is a C++ op compiled on first use (2-3 minutes on 2 cores);
    # gloo carries every collective these tests run. (``deepspeed.comm.torch`` is PyTorch there.)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None

    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    out = Path(sys.argv[1])
    for stage in (0, 1):
        record = {
            "small": run(rank, out, stage, "small", 8, limit=False),
            "oom": run(rank, out, stage, "oom", 16, limit=True),
        }
        (out / f"record{rank}_zero{stage}.json").write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
