"""``MicroBatcher``: run each global batch in micro-batches that fit; on OOM, shrink and redo.

An out-of-memory error in the middle of a global batch drops its partial gradients, halves the
micro-batch (rounded down to a divisor of the batch, ``batchfit.train.retry``) and redoes the
global batch from its first sample, with the random state and the module buffers it started
with: no sample is lost or counted twice (in the gradients or in BatchNorm's running
statistics), the optimizer, scheduler and scaler only move when the whole global batch is done,
and dropout draws what a run at the smaller size would have drawn.

Composer's auto-microbatching does the same on GPUs; accelerate's ``find_executable_batch_size``
instead shrinks the batch itself (the global batch changes) and reruns the whole function.

With a ``BatchRamp`` the global batch itself changes, on purpose and only between optimizer
steps (``batchfit.train.ramp``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from batchfit.train import _dist
from batchfit.train._batches import batch_len
from batchfit.train._checks import check_positive_int
from batchfit.train.accumulate import Accumulator, NumItems, StepResult
from batchfit.train.ramp import BatchRamp
from batchfit.train.retry import OomRetry, RetryState, run_micro_steps

logger = logging.getLogger(__name__)

StepFn = Callable[[Any], tuple[torch.Tensor, NumItems]]


class MicroBatcher(RetryState):
    """Split global batches into micro-batches for an ``Accumulator``, surviving OOM errors.

    ``run(batch, step_fn)`` calls ``step_fn(micro_batch)`` for each micro-batch; it runs the
    forward pass and returns ``(loss_sum, num_items)``, as for ``Accumulator.backward``. On an
    out-of-memory error (``batchfit._oom.is_oom``) the global batch is redone at half the
    micro-batch size, rounded down to a divisor of the batch so that every micro-batch holds
    the same number of samples (``batchfit.train.retry``, the rule DeepSpeed's and Lightning's
    integrations follow too); that size then stays, unless ``grow_after_steps`` asks to try
    doubling it again after that many clean steps. Every change is logged (``logging``).

    Under DDP and FSDP2 every micro-step ends with an all-reduce (MAX) of an OOM flag, so all
    ranks learn of an OOM on any of them and shrink together; gradients are combined over
    the ranks once, after the last micro-step, and only when no rank ran out of memory. No
    micro-step runs a collective (see ``Accumulator.deferred``): a rank that runs out of
    memory anywhere in its forward or backward never leaves another waiting in one. Under
    FSDP2 that means the parameters are all-gathered once as the global batch starts and
    stay unsharded until one reduce-scatter after its last micro-step, so the batch holds
    the unsharded parameters and gradients (DDP's memory for them, not FSDP's); the
    activations, which grow with the micro-batch, are what an OOM shrinks. An OOM in that
    all-gather or reduce-scatter (sizes that no micro-batch changes) is not recovered.
    Every rank must run the same number of micro-steps: give each the same number of
    samples per global batch.

    Each global batch starts with a copy of the model's floating-point and integer buffers
    (BatchNorm's running statistics and batch counts), on their own device, put back when the
    batch is redone. Its cost: the buffers' bytes once more (for BatchNorm, two floats per
    channel) and one device-side copy per global batch; nothing for a model without buffers.

    A ``ramp`` (:class:`~batchfit.train.ramp.BatchRamp`) sets the global batch per optimizer
    step: ``global_batch_size`` (all ranks) and ``local_batch_size`` (this rank's share) say
    how many samples the next ``run`` must get, and ``run`` refuses any other count. The ramp
    moves only after a completed step, so a global batch never changes within one; as it
    grows the optimizer's learning rates (and a scheduler's ``base_lrs``) are rescaled by the
    ramp's rule. It is independent of OOM recovery: an OOM redoes the same global batch at a
    smaller micro-batch (the step stays exact: gradients are normalised by the item count,
    whatever the split), and a larger global batch runs more micro-steps of the micro-batch
    size in force, never a larger micro-batch.

    Args:
        accumulator: Does the backward passes and the optimizer step; its
            ``grad_accum_steps`` is set per global batch.
        micro_batch_size: Samples per micro-batch to start with.
        grow_after_steps: After this many global steps without an OOM at a reduced size, try
            twice the size (up to ``micro_batch_size``, rounded down to a divisor of the
            batch). None keeps the reduced size.
        min_micro_batch_size: The smallest micro-batch to try: an OOM with no smaller
            divisor of the batch at or above it is raised, not retried.
        ramp: The global batch per optimizer step, and how the learning rate follows it.

    Example:
        >>> import torch
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <torch._C.Generator object at ...>
        >>> model = torch.nn.Linear(4, 1)
        >>> acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
        >>> batcher = MicroBatcher(acc, micro_batch_size=4)
        >>> def step_fn(micro):
        ...     x, y = micro
        ...     return ((model(x).squeeze(1) - y) ** 2).sum(), len(y)
        >>> result = batcher.run((torch.randn(10, 4), torch.randn(10)), step_fn)
        >>> result.micro_steps, result.num_items, result.ooms
        (3, 10.0, 0)
    """

    def __init__(
        self,
        accumulator: Accumulator,
        micro_batch_size: int,
        *,
        grow_after_steps: int | None = None,
        min_micro_batch_size: int = 1,
        ramp: BatchRamp | None = None,
    ) -> None:
        check_positive_int("micro_batch_size", micro_batch_size, meaning="samples per micro-batch")
        self._retry: OomRetry[StepResult] = OomRetry(
            micro_batch_size,
            min_micro_batch_size=min_micro_batch_size,
            grow_after_steps=grow_after_steps,
            logger=logger,
        )
        if min_micro_batch_size > micro_batch_size:
            raise ValueError(
                f"min_micro_batch_size {min_micro_batch_size} is above micro_batch_size "
                f"{micro_batch_size}: lower it, or start from a larger micro-batch"
            )
        self.accumulator = accumulator
        self.ramp = ramp
        if ramp is not None:
            self._check_divides(ramp.global_batch_size)

    @property
    def initial_micro_batch_size(self) -> int:
        """The size the batcher started with (and grows back to)."""
        return self._retry.initial_micro_batch_size

    @property
    def global_batch_size(self) -> int | None:
        """Samples the next ``run`` covers over all ranks (a ramp's); None without a ramp."""
        return None if self.ramp is None else self.ramp.global_batch_size

    @property
    def local_batch_size(self) -> int | None:
        """This rank's share of ``global_batch_size``: what to give the next ``run``."""
        if self.ramp is None:
            return None
        return self.ramp.global_batch_size // self._world_size()

    def _world_size(self) -> int:
        acc = self.accumulator
        return _dist.world_size(acc.process_group) if acc.is_distributed else 1

    def _check_divides(self, global_batch: int) -> None:
        world = self._world_size()
        if global_batch % world:
            raise ValueError(
                f"the ramp's global batch {global_batch} does not split over {world} ranks: "
                "use multiples of the world size"
            )

    def run(self, batch: Any, step_fn: StepFn) -> StepResult:
        """Run one global batch (this rank's share) and step the optimizer once.

        Args:
            batch: A tensor, a mapping or tuple of tensors (split along dim 0), or a list of
                samples (sliced; ``step_fn`` collates them).
            step_fn: Forward pass of one micro-batch: returns ``(loss_sum, num_items)``.

        Returns:
            The step's result, with the micro-batch size it completed at and the OOMs it
            recovered from.

        Raises:
            torch.OutOfMemoryError: Out of memory with no smaller size left to try (none
                that divides the batch at or above ``min_micro_batch_size``).
        """
        acc = self.accumulator
        if acc.micro_steps_done:
            raise RuntimeError(
                f"the accumulator is in the middle of a global step ({acc.micro_steps_done} "
                "micro-steps done): finish it before MicroBatcher.run"
            )
        n = batch_len(batch)
        if n == 0:
            raise ValueError("the global batch is empty: give MicroBatcher.run at least one sample")
        if self.local_batch_size is not None and n != self.local_batch_size:
            raise ValueError(
                f"the ramp's global batch is {self.global_batch_size} samples at step "
                f"{acc.steps}, {self.local_batch_size} on this rank, but run got {n}: draw "
                "batcher.local_batch_size samples for each run"
            )

        def attempt(micro: int) -> tuple[StepResult | None, str]:
            acc.grad_accum_steps = math.ceil(n / micro)
            return self._attempt(batch, micro, step_fn)

        result, micro, ooms = self._retry.run(n, acc.model, attempt, acc.discard)
        samples_per_s = None
        if result.seconds > 0:  # the global batch's samples, all ranks
            ranks = _dist.world_size(acc.process_group) if acc.is_distributed else 1
            samples_per_s = n * ranks / result.seconds
        result = replace(result, micro_batch_size=micro, ooms=ooms, samples_per_s=samples_per_s)
        if self.ramp is not None:
            self._advance_ramp(self.ramp, result)
        return result

    def _advance_ramp(self, ramp: BatchRamp, result: StepResult) -> None:
        """Between optimizer steps: the next global batch, and the LR that goes with it."""
        old = ramp.global_batch_size
        new = ramp.advance(self.accumulator.steps, result)
        if new == old:
            return
        self._check_divides(new)
        acc = self.accumulator
        factor = ramp.apply_lr(acc.optimizer, acc.scheduler, old, new)
        logger.info(
            "global batch %d -> %d samples from step %d; learning rates x %.4g (%s rule)",
            old,
            new,
            acc.steps,
            factor,
            ramp.lr_rule or "no",
        )

    def _attempt(self, batch: Any, micro: int, step_fn: StepFn) -> tuple[StepResult | None, str]:
        acc = self.accumulator
        group = acc.process_group
        device = _dist.collective_device(group) if acc.is_distributed else None
        if device is not None:
            _dist.check_same(acc.grad_accum_steps, "micro-steps per global batch", group, device)
        with acc.deferred():
            message = run_micro_steps(
                batch,
                micro,
                lambda micro_batch: self._forward_backward(step_fn, micro_batch),
                distributed=acc.is_distributed,
                group=group,
            )
            if message is not None:
                return None, message
            acc.reduce_gradients()
            return acc.finish(), ""

    def _forward_backward(self, step_fn: StepFn, micro_batch: Any) -> None:
        # Its own frame: the loss and activations die with it, or with the traceback.
        with self.accumulator.micro_step():
            returned = step_fn(micro_batch)
            if not (isinstance(returned, tuple) and len(returned) == 2):
                raise TypeError(
                    "step_fn must return (loss_sum, num_items), e.g. the result of "
                    f"batchfit.train.cross_entropy_sum; it returned {type(returned).__name__}"
                )
            loss_sum, num_items = returned
            self.accumulator.backward(loss_sum, num_items)
