"""The training runtime: exact gradient accumulation, OOM recovery that keeps the global batch.

- :class:`Accumulator`: micro-steps of ``(loss_sum, num_items)``; one optimizer step whose
  gradient equals the full global batch's, across micro-batches and DDP or FSDP2 ranks.
- :class:`MicroBatcher`: splits each global batch into micro-batches; on out-of-memory halves
  them (rounded down to a divisor of the batch: ``batchfit.train.retry``, shared with the
  DeepSpeed and Lightning integrations) and redoes the global batch from its first sample;
  every rank shrinks together.
- :class:`BatchRamp`, :func:`lr_scale`: a global batch that grows between optimizer steps (on a
  schedule, or when the measured noise scale passes it), the learning rate following it.
- :func:`class_weights`, :func:`cross_entropy_sum`: weighted losses that stay exact.
"""

from __future__ import annotations

from batchfit.train._batches import batch_len as batch_len
from batchfit.train._batches import slice_batch as slice_batch
from batchfit.train._checks import check_positive_int as check_positive_int
from batchfit.train._dist import any_rank as any_rank
from batchfit.train._dist import collective_device as collective_device
from batchfit.train._restart import BatchStart as BatchStart
from batchfit.train.accumulate import Accumulator, MicroStep, StepResult
from batchfit.train.ramp import BatchRamp, lr_scale
from batchfit.train.recover import MicroBatcher
from batchfit.train.weights import class_weights, cross_entropy_sum

__all__ = [
    "Accumulator",
    "BatchRamp",
    "MicroBatcher",
    "MicroStep",
    "StepResult",
    "class_weights",
    "cross_entropy_sum",
    "lr_scale",
]
