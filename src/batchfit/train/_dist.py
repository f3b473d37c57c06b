"""What the runtime needs from torch.distributed: DDP detection and a few small collectives.

The collectives take the process group: DDP's, or the one FSDP2 shards over (``_fsdp``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

# DDP's own default bucket size (torch/nn/parallel/distributed.py, bucket_cap_mb=25).
_BUCKET_BYTES = 25 * 2**20


def ddp_of(model: torch.nn.Module) -> DistributedDataParallel | None:
    """The DDP wrapper when ``model`` is one, else None."""
    return model if isinstance(model, DistributedDataParallel) else None


def world_size(group: dist.ProcessGroup | None) -> int:
    return int(dist.get_world_size(group))


def collective_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where the small flag tensors live: the GPU for NCCL, the CPU otherwise."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def sum_(stats: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """Sum ``stats`` over the ranks in place."""
    dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=group)


def any_rank(flag: bool, group: dist.ProcessGroup | None, device: torch.device) -> bool:
    """True on every rank when ``flag`` is True on any (all-reduce MAX of a uint8)."""
    value = torch.tensor([int(flag)], dtype=torch.uint8, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return bool(value.item())


def check_same(
    count: int, what: str, group: dist.ProcessGroup | None, device: torch.device
) -> None:
    """Raise on every rank when ``count`` differs between ranks (MAX of ``[count, -count]``)."""
    value = torch.tensor([count, -count], dtype=torch.int64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    high, low = int(value[0]), -int(value[1])
    if high != low:
        raise RuntimeError(
            f"ranks disagree on {what}: between {low} and {high}. Give every rank the same "
            "number of samples per global batch, so they run the same micro-steps"
        )


def sum_grads(params: Iterable[torch.nn.Parameter], group: dist.ProcessGroup | None) -> None:
    """Sum the gradients over the ranks, in buckets, as DDP would but without its averaging.

    A parameter with no gradient on this rank takes part with zeros, so every rank sends the
    same buckets.
    """
    bucket: list[torch.Tensor] = []
    size = 0
    for p in params:
        if not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grad = p.grad
        if bucket and (
            size + grad.nbytes > _BUCKET_BYTES
            or grad.dtype != bucket[0].dtype
            or grad.device != bucket[0].device
        ):
            _sum_bucket(bucket, group)
            bucket, size = [], 0
        bucket.append(grad)
        size += grad.nbytes
    if bucket:
        _sum_bucket(bucket, group)


def _sum_bucket(grads: list[torch.Tensor], group: dist.ProcessGroup | None) -> None:
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
