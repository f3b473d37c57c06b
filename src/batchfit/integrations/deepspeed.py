"""DeepSpeed: an engine owns its accumulation; ``DeepSpeedMicroBatcher`` keeps its global batch
through out-of-memory errors by rebuilding the micro-batch split on the engine.

DeepSpeed is not imported here: the engine you built is all this module touches, through
its public API (``train_micro_batch_size_per_gpu``, ``gradient_accumulation_steps``,
``train_batch_size``, ``set_train_micro_batch_size``, ``set_train_batch_size``,
``set_gradient_accumulation_boundary``, ``allreduce_gradients``, ``backward``, ``step``).
Checked against DeepSpeed 0.19.8 (``deepspeed/runtime/engine.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from batchfit.train.retry import OomRetry, RetryState, batch_len, run_micro_steps

logger = logging.getLogger(__name__)

DeepSpeedStepFn = Callable[[Any], torch.Tensor]


@dataclass(frozen=True)
class DeepSpeedStepResult:
    """What one DeepSpeed optimizer step did.

    Attributes:
        loss: This rank's loss: the mean of its micro-batches' losses, as DeepSpeed weighs
            them (each divided by ``grad_accum_steps``).
        micro_batch_size: Samples per micro-batch the step completed at.
        grad_accum_steps: Micro-steps it took (the engine's ``gradient_accumulation_steps``).
        ooms: Out-of-memory errors recovered from while running this global batch.
    """

    loss: float
    micro_batch_size: int
    grad_accum_steps: int
    ooms: int


class DeepSpeedMicroBatcher(RetryState):
    """Run each global batch on a DeepSpeed engine in micro-batches that fit; on an OOM on any
    rank, every rank halves the micro-batch and redoes the global batch from its first sample.

    The engine's config sets the global batch: ``train_batch_size`` samples over all ranks,
    ``train_micro_batch_size_per_gpu`` x ``gradient_accumulation_steps`` per rank. After an
    OOM the micro-batch becomes the largest divisor of the per-rank batch at or below half
    the failed size (``batchfit.train.retry``, the rule ``MicroBatcher`` follows too), and the
    engine is reset to it with ``set_train_micro_batch_size`` and
    ``set_train_batch_size`` (which recomputes ``gradient_accumulation_steps``), so
    ``train_batch_size`` never changes. A redone batch starts with the random state and
    module buffers it first started with (dropout draws what a run at the smaller size from
    the start would). Every change is logged.

    Each micro-step runs with ``set_gradient_accumulation_boundary(False)``, then all-reduces
    (MAX) a uint8 OOM flag over the ranks; only when no rank ran out of memory does the
    batcher mark the boundary, reduce the gradients (``allreduce_gradients``) and ``step()``.
    With ZeRO stage 0 or 1 a micro-step's backward runs no collective, so an OOM on one rank
    anywhere in its forward or backward never leaves another rank waiting in one. ZeRO-2
    reduces gradients in every backward and ZeRO-3 gathers parameters in every forward:
    there an OOM on one rank alone can hang the others in that collective, so the batcher
    refuses stage 2 and 3 with more than one rank.

    DeepSpeed averages the micro-batches' losses with equal weights: the result equals the
    full batch's when ``step_fn`` returns a per-sample mean and the micro-batches are equal,
    which the divisor rule keeps.

    Args:
        engine: A ``deepspeed.DeepSpeedEngine`` with an optimizer.
        grow_after_steps: After this many global steps without an OOM at a reduced size, try
            the next larger divisor again (up to the engine's first micro-batch). None keeps
            the reduced size.
        min_micro_batch_size: The smallest micro-batch to try: an OOM with no smaller
            divisor of the per-rank batch at or above it is raised, not retried.

    Example:
        A training loop (``engine`` from ``deepspeed.initialize``; ``loader`` gives each
        rank ``train_batch_size / world_size`` samples at a time)::

            batcher = DeepSpeedMicroBatcher(engine)
            for x, y in loader:
                result = batcher.run(
                    (x, y), lambda micro: F.cross_entropy(engine(micro[0]), micro[1])
                )
    """

    def __init__(
        self,
        engine: Any,
        *,
        grow_after_steps: int | None = None,
        min_micro_batch_size: int = 1,
    ) -> None:
        self.engine = engine
        self.world_size = int(engine.dp_world_size)
        stage = int(engine.zero_optimization_stage())
        if stage >= 2 and self.world_size > 1:
            raise ValueError(
                f"ZeRO stage {stage} communicates inside every micro-step (stage 2 reduces "
                "gradients in backward, stage 3 gathers parameters in forward), so an OOM on "
                "one rank alone would hang the others there: use stage 0 or 1 with "
                "DeepSpeedMicroBatcher, or size the micro-batch with `batchfit probe`"
            )
        self.initial_micro_batch_size = int(engine.train_micro_batch_size_per_gpu())
        self.per_rank_batch_size = self.initial_micro_batch_size * int(
            engine.gradient_accumulation_steps()
        )
        self.train_batch_size = int(engine.train_batch_size())
        if min_micro_batch_size > self.initial_micro_batch_size:
            raise ValueError(
                f"min_micro_batch_size {min_micro_batch_size} is above the engine's "
                f"train_micro_batch_size_per_gpu {self.initial_micro_batch_size}: lower it"
            )
        self._retry: OomRetry[float] = OomRetry(
            self.initial_micro_batch_size,
            min_micro_batch_size=min_micro_batch_size,
            grow_after_steps=grow_after_steps,
            logger=logger,
        )

    def run(self, batch: Any, step_fn: DeepSpeedStepFn) -> DeepSpeedStepResult:
        """Run one global batch (this rank's share) and step the engine once.

        Args:
            batch: This rank's ``train_batch_size / world_size`` samples: a tensor, a mapping
                or tuple of tensors (split along dim 0), or a list of samples.
            step_fn: Forward pass of one micro-batch through the engine; returns its loss
                (a mean, as DeepSpeed expects).

        Raises:
            torch.OutOfMemoryError: Out of memory with no smaller size left to try (none
                that divides the per-rank batch at or above ``min_micro_batch_size``).
        """
        n = batch_len(batch)
        if n != self.per_rank_batch_size:
            raise ValueError(
                f"this rank's batch holds {n} samples, but the engine's train_batch_size "
                f"{self.train_batch_size} over {self.world_size} ranks is "
                f"{self.per_rank_batch_size} per rank: give run() exactly that many"
            )

        def attempt(micro: int) -> tuple[float | None, str]:
            self._configure(micro)
            return self._attempt(batch, micro, step_fn)

        loss, micro, ooms = self._retry.run(n, self.engine.module, attempt, self._drop_gradients)
        return DeepSpeedStepResult(
            loss=loss, micro_batch_size=micro, grad_accum_steps=n // micro, ooms=ooms
        )

    def _configure(self, micro: int) -> None:
        engine = self.engine
        engine.set_train_micro_batch_size(micro)
        engine.set_train_batch_size(self.train_batch_size)  # recomputes the accumulation

    def _attempt(
        self, batch: Any, micro: int, step_fn: DeepSpeedStepFn
    ) -> tuple[float | None, str]:
        engine = self.engine
        losses: list[torch.Tensor] = []

        def step(micro_batch: Any) -> None:
            loss = step_fn(micro_batch)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise TypeError(
                    "step_fn must return the micro-batch's loss as a one-element tensor (a "
                    f"mean, as DeepSpeed expects); it returned {type(loss).__name__}"
                )
            engine.backward(loss)
            losses.append(loss.detach())

        engine.set_gradient_accumulation_boundary(False)
        message = run_micro_steps(batch, micro, step, distributed=self.world_size > 1)
        if message is not None:
            return None, message
        engine.set_gradient_accumulation_boundary(True)
        engine.allreduce_gradients()
        engine.step()
        # Back to the engine's own counting (DeepSpeed's default state).
        engine.set_gradient_accumulation_boundary(None)
        return float(torch.stack(losses).mean()), ""

    def _drop_gradients(self) -> None:
        """The partial global batch's gradients, wherever the engine keeps them."""
        self.engine.zero_grad()
        optimizer = getattr(self.engine, "optimizer", None)
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
        self.engine.set_gradient_accumulation_boundary(None)
