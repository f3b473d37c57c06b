"""What an ``Accumulator`` step returns: ``StepResult`` per optimizer step, ``MicroStep`` per
micro-step, and the item counts a micro-step reports (``NumItems``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeAlias

import torch

NumItems: TypeAlias = "int | float | torch.Tensor"


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step did.

    Attributes:
        loss: The global batch's mean loss: the sum of every micro-batch's loss sum on every
            rank, divided by ``num_items``.
        grad_norm: L2 norm of the gradient of that mean loss, before clipping (inf or nan when
            the step overflowed).
        num_items: Items in the global batch (tokens, samples or weight sum), all ranks.
        skipped: True when the GradScaler found inf/nan gradients: parameters, optimizer state
            and scheduler did not move.
        micro_steps: Micro-steps that made up the step on this rank.
        learning_rate: The first parameter group's learning rate during the step.
        micro_batch_size: Samples per micro-batch when a ``MicroBatcher`` split the batch.
        ooms: Out-of-memory errors recovered from while running this global batch.
        noise_scale: The gradient noise scale B_simple = tr(Σ)/|G|² (McCandlish et al. 2018),
            smoothed over the steps so far, in the unit of ``num_items``; set with
            ``Accumulator(..., noise_scale=True)``. None until a step had two micro-batches
            with items (over all ranks), or while the smoothed |G|² is not positive.
        seconds: Wall time of the step on this rank, from its first micro-step to the end of
            the optimizer step.
        peak_bytes: Peak memory while the step ran, on this rank: CUDA
            ``max_memory_allocated`` (its peak counter is reset as the step begins), on the
            CPU the process's RSS high-water mark (Linux; reset likewise). None elsewhere.
        reserved_bytes: CUDA ``max_memory_reserved`` over the step; None on the CPU.
        samples_per_s: Samples of the global batch per second of ``seconds`` (all ranks),
            where the samples are known (a ``MicroBatcher`` splits them); else None.
        items_per_s: ``num_items`` per second of ``seconds``.
    """

    loss: float
    grad_norm: float
    num_items: float
    skipped: bool
    micro_steps: int
    learning_rate: float
    micro_batch_size: int | None = None
    ooms: int = 0
    noise_scale: float | None = None
    # measurements of this run: not part of what two equivalent steps compare equal on
    seconds: float = field(default=0.0, compare=False)
    peak_bytes: int | None = field(default=None, compare=False)
    reserved_bytes: int | None = field(default=None, compare=False)
    samples_per_s: float | None = field(default=None, compare=False)
    items_per_s: float | None = field(default=None, compare=False)


@dataclass
class MicroStep:
    """What ``with acc.micro_step() as micro:`` yields.

    ``result`` is set when this micro-step was the last of its global step and the optimizer
    stepped as it closed.
    """

    index: int
    is_last: bool
    result: StepResult | None = None
