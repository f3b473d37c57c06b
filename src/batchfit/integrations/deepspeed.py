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

from batchfit._oom import OutOfMemoryError, is_oom, release_memory
from batchfit.train import (
    BatchStart,
    any_rank,
    batch_len,
    check_positive_int,
    collective_device,
    slice_batch,
)

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


class DeepSpeedMicroBatcher:
    """Run each global batch on a DeepSpeed engine in micro-batches that fit; on an OOM on any
    rank, every rank halves the micro-batch and redoes the global batch from its first sample.

    The engine's config sets the global batch: ``train_batch_size`` samples over all ranks,
    ``train_micro_batch_size_per_gpu`` x ``gradient_accumulation_steps`` per rank. After an
    OOM the micro-batch becomes the largest divisor of the per-rank batch at or below half
    the failed size, and the engine is reset to it with ``set_train_micro_batch_size`` and
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
        min_micro_batch_size: An OOM at this size is raised, not retried.

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
        check_positive_int(
            "min_micro_batch_size", min_micro_batch_size, meaning="the smallest micro-batch to try"
        )
        if grow_after_steps is not None:
            check_positive_int(
                "grow_after_steps",
                grow_after_steps,
                meaning="clean global steps",
                fix="pass None to keep a reduced size",
            )
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
        self.min_micro_batch_size = min_micro_batch_size
        self.grow_after_steps = grow_after_steps
        self.num_ooms = 0
        self._size = self.initial_micro_batch_size
        self._clean_steps = 0

    @property
    def micro_batch_size(self) -> int:
        """The size the next global batch starts with."""
        return self._size

    def run(self, batch: Any, step_fn: DeepSpeedStepFn) -> DeepSpeedStepResult:
        """Run one global batch (this rank's share) and step the engine once.

        Args:
            batch: This rank's ``train_batch_size / world_size`` samples: a tensor, a mapping
                or tuple of tensors (split along dim 0), or a list of samples.
            step_fn: Forward pass of one micro-batch through the engine; returns its loss
                (a mean, as DeepSpeed expects).

        Raises:
            torch.OutOfMemoryError: Even ``min_micro_batch_size`` ran out of memory.
        """
        n = batch_len(batch)
        if n != self.per_rank_batch_size:
            raise ValueError(
                f"this rank's batch holds {n} samples, but the engine's train_batch_size "
                f"{self.train_batch_size} over {self.world_size} ranks is "
                f"{self.per_rank_batch_size} per rank: give run() exactly that many"
            )
        start = BatchStart.capture(self.engine.module)
        ooms = 0
        while True:
            micro = self._size
            self._configure(micro)
            loss, message = self._attempt(batch, n, micro, step_fn)
            if loss is not None:
                break
            ooms += 1
            self.num_ooms += 1
            self._drop_gradients()
            release_memory()
            smaller = _largest_divisor(n, micro // 2)
            if micro <= self.min_micro_batch_size or smaller < self.min_micro_batch_size:
                raise OutOfMemoryError(
                    f"out of memory at micro-batch {micro}, the smallest allowed: {message}. "
                    "Shorten the sequences, turn on activation checkpointing, or see "
                    "`batchfit plan` for what fits"
                )
            self._size, self._clean_steps = smaller, 0
            logger.warning(
                "out of memory at micro-batch %d (%s): redoing the global batch of %d samples "
                "per rank from its first sample at micro-batch %d (gradient_accumulation_steps "
                "%d)",
                micro,
                message,
                n,
                smaller,
                n // smaller,
            )
            start.restore(self.engine.module)
        self._maybe_grow(ooms, n)
        return DeepSpeedStepResult(
            loss=loss, micro_batch_size=micro, grad_accum_steps=n // micro, ooms=ooms
        )

    def _configure(self, micro: int) -> None:
        engine = self.engine
        engine.set_train_micro_batch_size(micro)
        engine.set_train_batch_size(self.train_batch_size)  # recomputes the accumulation

    def _attempt(
        self, batch: Any, n: int, micro: int, step_fn: DeepSpeedStepFn
    ) -> tuple[float | None, str]:
        engine = self.engine
        device = collective_device(None) if self.world_size > 1 else None
        losses: list[torch.Tensor] = []
        engine.set_gradient_accumulation_boundary(False)
        for first in range(0, n, micro):
            message = self._micro_step(step_fn, slice_batch(batch, first, first + micro), losses)
            oom = message is not None
            if device is not None:
                oom = any_rank(oom, None, device)
            if oom:
                return None, message or "out of memory on another rank"
        engine.set_gradient_accumulation_boundary(True)
        engine.allreduce_gradients()
        engine.step()
        # Back to the engine's own counting (DeepSpeed's default state).
        engine.set_gradient_accumulation_boundary(None)
        return float(torch.stack(losses).mean()), ""

    def _micro_step(
        self, step_fn: DeepSpeedStepFn, micro_batch: Any, losses: list[torch.Tensor]
    ) -> str | None:
        try:
            loss = step_fn(micro_batch)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise TypeError(
                    "step_fn must return the micro-batch's loss as a one-element tensor (a "
                    f"mean, as DeepSpeed expects); it returned {type(loss).__name__}"
                )
            self.engine.backward(loss)
            losses.append(loss.detach())
        except Exception as exc:
            if not is_oom(exc):
                raise
            return str(exc).strip().splitlines()[0][:200] if str(exc).strip() else "OOM"
        return None

    def _drop_gradients(self) -> None:
        """The partial global batch's gradients, wherever the engine keeps them."""
        self.engine.zero_grad()
        optimizer = getattr(self.engine, "optimizer", None)
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
        self.engine.set_gradient_accumulation_boundary(None)

    def _maybe_grow(self, ooms: int, n: int) -> None:
        self._clean_steps = 0 if ooms else self._clean_steps + 1
        if (
            self.grow_after_steps is None
            or self._size >= self.initial_micro_batch_size
            or self._clean_steps < self.grow_after_steps
        ):
            return
        grown = _largest_divisor(n, min(self.initial_micro_batch_size, self._size * 2))
        logger.info(
            "%d steps without running out of memory at micro-batch %d: trying %d",
            self._clean_steps,
            self._size,
            grown,
        )
        self._size, self._clean_steps = grown, 0


def _largest_divisor(n: int, at_most: int) -> int:
    """The largest divisor of ``n`` that is <= ``at_most`` (0 when ``at_most`` < 1).

    Example:
        >>> _largest_divisor(12, 5), _largest_divisor(16, 4), _largest_divisor(7, 3)
        (4, 4, 1)
    """
    return max((d for d in range(1, at_most + 1) if n % d == 0), default=0)
