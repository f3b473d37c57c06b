"""BatchNorm and small micro-batches: one warning, said by every path that picks a size.

BatchNorm normalises with the statistics of the micro-batch it sees; accumulation over several
micro-batches does not pool them, and below about 16 samples the estimates get noisy (Wu and He,
"Group Normalization", 2018, fig. 1: ResNet-50 error rises steeply below 16 images per batch).
"""

from __future__ import annotations

from typing import Any

SMALL_MICRO_BATCH = 16


def has_batchnorm(model: Any) -> bool:
    """Whether an ``nn.Module`` holds a BatchNorm layer (1d/2d/3d, synced or lazy)."""
    # lazy: torch (~1 s): plans and estimates of catalog models never need it
    from torch.nn.modules.batchnorm import _BatchNorm

    return any(isinstance(m, _BatchNorm) for m in model.modules())


def batchnorm_warning(micro_batch_size: int) -> str | None:
    """The warning for a BatchNorm model trained at ``micro_batch_size``, or None."""
    if micro_batch_size >= SMALL_MICRO_BATCH:
        return None
    return (
        f"BatchNorm statistics come from each micro-batch of {micro_batch_size}, not the global "
        f"batch (below {SMALL_MICRO_BATCH} they are noisy; accumulation does not make them "
        "exact): consider GroupNorm or SyncBatchNorm, or a larger micro-batch"
    )
