"""Ground truth for one rank of a sharded CPU step: run under ``torchrun`` (gloo), every rank
measures its own peak, as ``_truth.py`` measures one process (same warm-up, same loop).

Each rank builds the model as batchfit builds it (``step_parts``: the setup applied) on real
CPU tensors, wraps it as the setup says (FSDP2: ``fully_shard`` per layer then the root, the
trace's layout; FSDP1 (``"fsdp_version": 1``): ``FullyShardedDataParallel`` per decoder layer
and the root as accelerate wraps it; DDP: ``DistributedDataParallel``), warms up with a
1-layer step at the case's sizes, resets the kernel's high-water mark and trains three steps
(DDP allocates its gradient buckets in the first backward and rebuilds them in the second: the
third is the steady state).
Truth = VmHWM - VmRSS before the model is built, per rank. Rank 0 prints one JSON line with
every rank's figure.

    torchrun --nproc-per-node 2 _fsdp_truth.py '{"model": "gpt2", "setup": {...},
                                                 "micro": 2, "seq": 256}'
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from batchfit._memwatch import status_bytes
from batchfit._oom import _malloc_trim

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _truth import train


def main() -> None:
    spec = json.loads(sys.argv[1])
    from torch.distributed.device_mesh import init_device_mesh

    from batchfit.memory.trace import fsdp as _fsdp
    from batchfit.memory.trace import hf as _hf_trace
    from batchfit.models import resolve_model
    from batchfit.spec import TrainingSetup

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    torch.set_num_threads(int(spec.get("threads", 1)))
    info = resolve_model(spec["model"], spec.get("task"))
    fields = {**spec["setup"], "num_gpus": world}
    setup = TrainingSetup(**fields).resolved(device="cpu", bf16_supported=True)
    mesh = init_device_mesh("cpu", (world,))

    def wrap(net: torch.nn.Module) -> torch.nn.Module:
        if setup.sharding == "fsdp":
            return _fsdp.shard(net, setup, mesh)
        return torch.nn.parallel.DistributedDataParallel(net)

    def step(micro: int, seq: int, depth: int | None, steps: int) -> None:
        parts = _hf_trace.step_parts(
            info, setup, micro=micro, seq=seq, emulate_cuda=False, depth=depth, prepare=wrap
        )
        model: Any = parts.model
        train(model, parts.optimizer, parts.make_batch, parts.autocast_dtype, "trainer", steps)

    step(spec["micro"], spec["seq"], 1, 1)
    gc.collect()
    _malloc_trim()
    dist.barrier()
    rss0 = status_bytes("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    start = time.perf_counter()
    step(spec["micro"], spec["seq"], None, int(spec.get("steps", 3)))
    truth = status_bytes("VmHWM") - rss0
    seconds = time.perf_counter() - start
    out: list[Any] = [None] * world
    dist.all_gather_object(out, {"rank": rank, "truth_bytes": truth, "seconds": seconds})
    if rank == 0:
        print(json.dumps({"ranks": out}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
