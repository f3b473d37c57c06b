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
    """``fully_shard`` each layer of ``net``'s layer stacks, then ``net`` itself (the root);
    FullyShardedDataParallel as accelerate wraps it under ``fsdp_version=1``."""
    if setup.fsdp_version == 1:
        return _shard_v1(net, setup)
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


def _shard_v1(net: torch.nn.Module, setup: TrainingSetup) -> torch.nn.Module:
    """FSDP1 as ``accelerate`` builds it: one FlatParameter per decoder layer (and per LoRA
    leaf, as peft's wrap policy) and one for the root, ``use_orig_params=True``, FULL_SHARD,
    BACKWARD_PRE; under AMP its ``MixedPrecision`` (16-bit parameters, reductions and
    buffers) and fp32 flat parameters where any part trains."""
    # lazy: torch (~1 s): the trace engine's cached path reads is_fsdp without it
    import torch
    from torch.distributed.fsdp import BackwardPrefetch, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import CustomPolicy

    from batchfit.memory.trace.dry_run import layer_stacks

    low = {"amp-bf16": torch.bfloat16, "amp-fp16": torch.float16}.get(setup.precision)
    # accelerate utils/dataclasses.py:2136-2142: param, reduce and buffer dtype all the 16-bit one
    policy = MixedPrecision(param_dtype=low, reduce_dtype=low, buffer_dtype=low) if low else None
    layers = {type(layer) for stack in layer_stacks(net) for layer in stack}

    def own_unit(module: torch.nn.Module) -> bool:
        # accelerate TRANSFORMER_BASED_WRAP: the model's decoder layer classes; with an
        # adapter, peft's fsdp_auto_wrap_policy (which transformers' Trainer installs for a
        # PEFT model, distributed/fsdp.py update_fsdp_plugin_peft) also wraps each leaf whose
        # weight trains (lora_A, lora_B): the layer's flat parameter stays frozen
        weight = getattr(module, "weight", None)
        trains = isinstance(weight, torch.nn.Parameter) and weight.requires_grad
        leaf = next(module.children(), None) is None
        return type(module) in layers or (setup.is_lora and leaf and trains)

    try:
        wrapped = FSDP(
            net,
            auto_wrap_policy=CustomPolicy(own_unit),
            sharding_strategy=ShardingStrategy.FULL_SHARD,
            backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
            mixed_precision=policy,
            use_orig_params=True,
            device_id=torch.device("cpu"),
        )
    except (AssertionError, TypeError, ValueError, RuntimeError) as e:
        # one FlatParameter takes one dtype: QLoRA's packed 4-bit weights beside 16-bit ones
        first_line = (str(e).splitlines() or [""])[0][:120]
        why = f"FullyShardedDataParallel refused the model: {first_line}"
        raise NotImplementedError(why) from e
    if low is not None:
        for module in FSDP.fsdp_modules(wrapped):
            handle = module._handle if module._has_params else None
            flat = handle.flat_param if handle is not None else None
            # accelerate accelerator.py:2018-2038: a 16-bit flat parameter with any trainable
            # part (_flat_param.py:832 requires_grad = any) is upcast to fp32
            if handle and flat is not None and flat.requires_grad and flat.dtype != torch.float32:
                flat.data = flat.data.to(torch.float32)
                handle._orig_param_dtype = torch.float32
    return wrapped
