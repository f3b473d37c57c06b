"""The arithmetic of an ``Accumulator`` step: item counts checked, the global sums over the
ranks, the gradient norm and the one rescale, and the step's peak memory."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from batchfit._memwatch import status_bytes
from batchfit.train import _dist
from batchfit.train._results import NumItems
from batchfit.train.noise import NoiseScaleMeter

# torch.nn.utils.clip_grad_norm_ adds this to the norm before dividing.
CLIP_EPS = 1e-6


def check_items(num_items: NumItems) -> float | torch.Tensor:
    if isinstance(num_items, torch.Tensor):
        if num_items.numel() != 1:
            raise ValueError(
                f"num_items must be one count, got a tensor of shape {tuple(num_items.shape)}: "
                "sum it (e.g. (labels != -100).sum())"
            )
        return num_items.detach()
    if isinstance(num_items, bool) or not isinstance(num_items, int | float):
        raise ValueError(
            f"num_items must be an int, float or one-element tensor, got {num_items!r}"
        )
    if not math.isfinite(num_items) or num_items < 0:
        raise ValueError(
            f"num_items must be a finite count >= 0 (tokens, samples or weight sum), got "
            f"{num_items!r}"
        )
    return float(num_items)


def global_sums(
    losses: list[torch.Tensor],
    items_tensors: list[torch.Tensor],
    items_float: float,
    noise: NoiseScaleMeter | None,
    group: dist.ProcessGroup | None,
    distributed: bool,
) -> tuple[float, float, tuple[float, float] | None]:
    """Loss sum and item count of the global batch, and the noise meter's sums (S, P),
    summed over ranks in one collective."""
    device = losses[0].device
    dtype = torch.float32 if device.type == "mps" else torch.float64
    loss = stack(losses, device, dtype).sum()
    if items_tensors:
        counts = stack(items_tensors, device, dtype)
        items = counts.sum() + items_float
        bad = ((counts < 0) | ~counts.isfinite()).any()
        stats = torch.stack([loss, items, bad.to(dtype)])
    else:
        stats = torch.stack([loss, loss.new_tensor(items_float), loss.new_zeros(())])
    if noise is not None:
        stats = torch.cat([stats, noise.local_sums(device, dtype)])
    if distributed:
        _dist.sum_(stats, group)
    loss, total, n_bad, *noise_sums = stats.tolist()
    if n_bad:
        raise ValueError(
            "num_items was negative or not finite in a micro-step: pass the count of "
            "items behind the loss sum (tokens, samples or weight sum)"
        )
    if not total > 0:
        raise ValueError(
            "the global batch has no items (num_items summed to 0 over all micro-steps "
            "and ranks): nothing to average over; check the labels are not all ignored"
        )
    return loss, total, (noise_sums[0], noise_sums[1]) if noise_sums else None


def stack(values: list[torch.Tensor], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """One-element tensors as one flat tensor of ``dtype`` on ``device``."""
    first = values[0]
    if all(
        v.shape == first.shape and v.dtype == first.dtype and v.device == device for v in values
    ):
        return torch.stack(values).reshape(-1).to(dtype)
    return torch.cat([v.reshape(1).to(device=device, dtype=dtype) for v in values])


def total_norm(grads: list[torch.Tensor]) -> float:
    if not grads:
        return 0.0
    get_total_norm = getattr(torch.nn.utils, "get_total_norm", None)  # torch >= 2.6
    if get_total_norm is not None:
        norm = get_total_norm(grads)
        # FSDP2's gradients are DTensor shards: the norm over all of them, from every rank.
        full_tensor = getattr(norm, "full_tensor", None)
        return float(full_tensor() if full_tensor is not None else norm)
    return float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))


def scale_(grads: list[torch.Tensor], scale: float) -> None:
    by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        by_kind.setdefault((g.device, g.dtype), []).append(g)
    for same in by_kind.values():
        torch._foreach_mul_(same, scale)


class StepPeak:
    """A step's peak memory: CUDA's peak counters, or the CPU's RSS high-water mark, reset as
    the step begins (both are per process: a caller's own peak readings restart too)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    @classmethod
    def begin(cls, device: torch.device) -> StepPeak | None:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            return cls(device)
        if device.type == "cpu":
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")  # VmHWM restarts from the current RSS
            except OSError:  # not Linux, or not allowed
                return None
            return cls(device)
        return None

    def read(self) -> tuple[int | None, int | None]:
        if self.device.type == "cuda":
            return (
                int(torch.cuda.max_memory_allocated(self.device)),
                int(torch.cuda.max_memory_reserved(self.device)),
            )
        return status_bytes("VmHWM"), None
