"""One out-of-memory retry for every loop that keeps its global batch.

``MicroBatcher`` (``batchfit.train.recover``), ``DeepSpeedMicroBatcher`` and Lightning's
``MicroBatchCallback`` (``batchfit.integrations``) size their micro-batches here:

- The size rule (:func:`micro_batch_at_most`): a micro-batch divides this rank's batch, so
  every micro-batch holds the same number of samples and micro-batch x accumulation is still
  the global batch.
- After an out-of-memory error (:func:`smaller_micro_batch`): half the failed size, rounded
  down to such a divisor; never below the floor (``min_micro_batch_size``).
- :class:`OomRetry` runs a global batch at the current size, and after an OOM on any rank
  drops the partial step, puts back the random state and buffers the batch started with, and
  redoes it from its first sample at the smaller size; after ``grow_after_steps`` clean steps
  it tries twice the size again (the divisor at or below it).

Ranks agree through an all-reduce (MAX) of a uint8 OOM flag after every micro-step
(:func:`run_micro_steps`); each rank then applies the same rule to the same batch length, so
every rank moves to the same size in the same step.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import torch
import torch.distributed as dist

from batchfit._oom import OutOfMemoryError, is_oom, release_memory
from batchfit.train import _dist
from batchfit.train._batches import batch_len, slice_batch
from batchfit.train._checks import check_positive_int
from batchfit.train._restart import BatchStart

__all__ = [
    "OomRetry",
    "RetryState",
    "batch_len",
    "micro_batch_at_most",
    "run_micro_steps",
    "smaller_micro_batch",
]

R = TypeVar("R")

_OTHER_RANK = "out of memory on another rank"


def micro_batch_at_most(per_rank: int, limit: int) -> int:
    """The largest micro-batch <= ``limit`` that divides ``per_rank`` (0 when ``limit`` < 1).

    Example:
        >>> micro_batch_at_most(12, 5), micro_batch_at_most(16, 4), micro_batch_at_most(7, 3)
        (4, 4, 1)
    """
    for size in range(min(limit, per_rank), 0, -1):
        if per_rank % size == 0:
            return size
    return 0


def smaller_micro_batch(failed: int, per_rank: int, floor: int = 1) -> int | None:
    """The size to redo a batch of ``per_rank`` samples at after an OOM at ``failed``.

    Half of ``failed``, rounded down to a divisor of ``per_rank``; when that is below
    ``floor``, the smallest divisor at or above ``floor`` that is still below ``failed``.
    None when no divisor lies in ``[floor, failed)``: nothing smaller may be tried.

    Example:
        >>> smaller_micro_batch(16, 32), smaller_micro_batch(15, 45), smaller_micro_batch(8, 10)
        (8, 5, 2)
        >>> smaller_micro_batch(8, 12, floor=5), smaller_micro_batch(1, 8)
        (6, None)
    """
    halved = micro_batch_at_most(per_rank, failed // 2)
    if halved >= floor:
        return halved
    above = [d for d in range(floor, failed) if per_rank % d == 0]
    return above[0] if above else None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else "OOM"


def _oom_in(step: Callable[[Any], None], micro_batch: Any) -> str | None:
    """None when ``step`` ran; the error's first line when it ran out of memory."""
    try:
        step(micro_batch)
    except Exception as exc:
        if not is_oom(exc):
            raise
        return _first_line(exc)
    return None


def run_micro_steps(
    batch: Any,
    micro: int,
    step: Callable[[Any], None],
    *,
    distributed: bool = False,
    group: dist.ProcessGroup | None = None,
) -> str | None:
    """Call ``step`` on each micro-batch of ``batch`` in order; stop at the first OOM.

    When ``distributed``, every micro-step ends with an all-reduce (MAX) of a uint8 OOM flag
    over ``group`` (None: the default group), so every rank stops after the same micro-step.

    Returns:
        None when every micro-step ran on every rank; else the OOM's first line (or that
        another rank ran out of memory).
    """
    device = _dist.collective_device(group) if distributed else None
    for first in range(0, batch_len(batch), micro):
        message = _oom_in(step, slice_batch(batch, first, first + micro))
        oom = message is not None
        if device is not None:
            oom = _dist.any_rank(oom, group, device)
        if oom:
            return message or _OTHER_RANK
    return None


class OomRetry(Generic[R]):
    """The micro-batch size of a loop through out-of-memory errors, and the loop that redoes
    a global batch at the next smaller size.

    Args:
        micro_batch_size: Samples per micro-batch to start with.
        min_micro_batch_size: The floor: an OOM with no allowed smaller size is raised.
        grow_after_steps: After this many global steps without an OOM at a reduced size, try
            twice the size (up to ``micro_batch_size``). None keeps the reduced size.
        logger: Where the changes are logged (the caller's logger).

    Example:
        >>> retry: OomRetry[str] = OomRetry(8)
        >>> def attempt(micro):  # an OOM at 8, then fits
        ...     return (None, "simulated") if micro == 8 else (f"done at {micro}", "")
        >>> retry.run(12, torch.nn.Linear(1, 1), attempt, discard=lambda: None)
        ('done at 4', 4, 1)
    """

    def __init__(
        self,
        micro_batch_size: int,
        *,
        min_micro_batch_size: int = 1,
        grow_after_steps: int | None = None,
        logger: logging.Logger | None = None,
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
        self.initial_micro_batch_size = micro_batch_size
        self.min_micro_batch_size = min_micro_batch_size
        self.grow_after_steps = grow_after_steps
        self.logger = logger or logging.getLogger(__name__)
        self.num_ooms = 0  # over the retry's life
        self.size = micro_batch_size  # what the next global batch starts with
        self._clean_steps = 0

    def run(
        self,
        n: int,
        model: torch.nn.Module,
        attempt: Callable[[int], tuple[R | None, str]],
        discard: Callable[[], None],
    ) -> tuple[R, int, int]:
        """Run a global batch of ``n`` samples (this rank's) until it fits.

        Args:
            n: Samples in this rank's share of the global batch.
            model: Whose buffers (and the random state) a redo puts back.
            attempt: Runs the whole global batch at a micro-batch size: ``(result, "")``
                when it completed, ``(None, message)`` after an OOM on any rank.
            discard: Drops the partial batch's gradients.

        Returns:
            The attempt's result, the micro-batch size it completed at, the OOMs on the way.

        Raises:
            torch.OutOfMemoryError: No allowed smaller size is left.
        """
        start = BatchStart.capture(model)
        ooms = 0
        while True:
            micro = min(self.size, n)
            result, message = attempt(micro)
            if result is not None:
                break
            # Out of the except block: the traceback, and the failed step's tensors, are gone.
            ooms += 1
            self.num_ooms += 1
            discard()
            release_memory()
            self._shrink(micro, n, message)
            start.restore(model)
        self._after_step(ooms, n)
        return result, micro, ooms

    def _shrink(self, micro: int, n: int, message: str) -> None:
        smaller = smaller_micro_batch(micro, n, self.min_micro_batch_size)
        if smaller is None:
            why = (
                "the smallest allowed"
                if micro <= self.min_micro_batch_size
                else f"and no smaller micro-batch of at least {self.min_micro_batch_size} "
                f"divides the {n} samples"
            )
            raise OutOfMemoryError(
                f"out of memory at micro-batch {micro}, {why}: {message}. Shorten the "
                "sequences, turn on gradient checkpointing, or see `batchfit plan` for what fits"
            )
        self.size, self._clean_steps = smaller, 0
        self.logger.warning(
            "out of memory at micro-batch %d (%s): redoing the global batch of %d samples on "
            "this rank from its first sample at micro-batch %d (%d micro-steps)",
            micro,
            message,
            n,
            smaller,
            math.ceil(n / smaller),
        )

    def _after_step(self, ooms: int, n: int) -> None:
        self._clean_steps = 0 if ooms else self._clean_steps + 1
        if (
            self.grow_after_steps is None
            or self.size >= self.initial_micro_batch_size
            or self._clean_steps < self.grow_after_steps
        ):
            return
        grown = micro_batch_at_most(n, min(self.initial_micro_batch_size, self.size * 2))
        if grown <= self.size:
            return  # no larger divisor of this batch up to the first size
        self.logger.info(
            "%d steps without running out of memory at micro-batch %d: trying %d",
            self._clean_steps,
            self.size,
            grown,
        )
        self.size, self._clean_steps = grown, 0


class RetryState:
    """What a batcher built on :class:`OomRetry` reports of it (``MicroBatcher``,
    ``DeepSpeedMicroBatcher``): the sizes and the errors recovered from."""

    _retry: OomRetry[Any]

    @property
    def min_micro_batch_size(self) -> int:
        """The smallest micro-batch to try."""
        return self._retry.min_micro_batch_size

    @property
    def grow_after_steps(self) -> int | None:
        """Clean global steps before trying a larger size again; None keeps a reduced size."""
        return self._retry.grow_after_steps

    @property
    def num_ooms(self) -> int:
        """Out-of-memory errors recovered from over the batcher's life."""
        return self._retry.num_ooms

    @property
    def micro_batch_size(self) -> int:
        """The size the next global batch starts with."""
        return self._retry.size
