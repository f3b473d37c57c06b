"""FSDP2 in a dry run: one rank of N, in one process, under PyTorch's fake process group.

``dist.init_process_group("fake", ...)`` gives a world of any size whose collectives do
nothing: ``fully_shard`` shards the real model, and the real step (all-gathers into unsharded
buffers, reduce-scatters of gradients, the optimizer on the local shards) runs on fake tensors
as rank 0 would run it, so the tracker counts what one rank holds.

The layout is the one FSDP2's documentation and torchtitan use: ``fully_shard`` on each layer of
the model's layer stacks, then on the root (embeddings, final norm, head and the loss wrapper),
``reshard_after_forward=True``. Mixed precision follows the setup: AMP runs with FSDP2's
``MixedPrecisionPolicy(param_dtype=16-bit, reduce_dtype=fp32)`` (fp32 sharded parameters, 16-bit
gathered ones) under autocast, as accelerate does; pure 16-bit and fp32 gather what they store.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from batchfit.spec import TrainingSetup

if TYPE_CHECKING:  # torch-free at import: the trace engine reads cached results without it
    import torch


def is_fsdp(setup: TrainingSetup) -> bool:
    """Whether ``setup`` runs FSDP2 over more than one rank (what a dry run shards)."""
    return setup.sharding == "fsdp" and setup.num_gpus > 1


@contextlib.contextmanager
def fake_world(world_size: int) -> Iterator[Any]:
    """A fake process group of ``world_size`` ranks (this process is rank 0) and its 1-D mesh.

    Raises NotImplementedError (a trace limit: the analytic engine answers) when this process
    already runs torch.distributed: the dry run cannot borrow a real job's process group.
    """
    # lazy: torch (~1 s): the trace engine's cached path reads is_fsdp without it
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise NotImplementedError(
            "this process already runs torch.distributed; FSDP is traced in a fake process group"
        )
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        # the mesh holds real rank tensors: build it before the fake mode starts
        yield init_device_mesh("cpu", (world_size,))
    finally:
        dist.destroy_process_group()


def shard(net: torch.nn.Module, setup: TrainingSetup, mesh: Any) -> torch.nn.Module:
    """``fully_shard`` each layer of ``net``'s layer stacks, then ``net`` itself (the root)."""
    # lazy: torch (~1 s): the trace engine's cached path reads is_fsdp without it
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from batchfit.memory.trace.dry_run import layer_stacks

    param_dtype = {"amp-bf16": torch.bfloat16, "amp-fp16": torch.float16}.get(setup.precision)
    policy = MixedPrecisionPolicy(
        param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None
    )
    try:
        for stack in layer_stacks(net):
            for layer in stack:
                fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(net, mesh=mesh, mp_policy=policy)
    except (AssertionError, TypeError, RuntimeError) as e:
        # FSDP2 refuses mixed dtypes in one group without a policy that unifies them
        # (QLoRA's packed 4-bit weights beside 16-bit ones): a limit of the trace
        first_line = (str(e).splitlines() or [""])[0][:120]
        raise NotImplementedError(f"fully_shard refused the model: {first_line}") from e
    return net
