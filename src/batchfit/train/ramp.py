"""A global-batch ramp for ``MicroBatcher``: a schedule, or growth that follows the noise scale.

"Start small and increase it as the model gets smarter" (seed 000) has a measurable form: the
gradient noise scale B_simple (``Accumulator(..., noise_scale=True)``) is the batch above
which a larger batch buys little (McCandlish et al. 2018), and it grows as training goes on.
A batch well below it wastes optimizer steps; well above it wastes compute.

The learning rate follows the batch: linear for SGD (Goyal et al. 2017), square root for
Adam-family optimizers (Malladi et al. 2022, who also rescale Adam's β1, β2 and ε; only the
rate is changed here), both only below the critical batch size.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch

from batchfit.train._checks import check_positive_int
from batchfit.train.accumulate import StepResult

logger = logging.getLogger(__name__)

LrRule = Literal["sqrt", "linear"]


def lr_scale(rule: LrRule, old_batch: float, new_batch: float) -> float:
    """The factor on the learning rate when the global batch goes from ``old_batch`` to
    ``new_batch``.

    Args:
        rule: ``"sqrt"`` for Adam-family optimizers (Malladi et al. 2022, "On the SDEs and
            Scaling Rules for Adaptive Gradient Algorithms"), ``"linear"`` for SGD (Goyal et
            al. 2017, "Accurate, Large Minibatch SGD").
        old_batch: The batch the current rate was tuned for.
        new_batch: The new batch, in the same unit.

    Example:
        >>> lr_scale("sqrt", 256, 1024), lr_scale("linear", 256, 1024)
        (2.0, 4.0)
    """
    for name, value in (("old_batch", old_batch), ("new_batch", new_batch)):
        if isinstance(value, bool) or not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a finite positive batch size, got {value!r}")
    ratio = new_batch / old_batch
    if rule == "sqrt":
        return math.sqrt(ratio)  # Malladi et al. 2022, square-root scaling rule
    if rule == "linear":
        return ratio  # Goyal et al. 2017, linear scaling rule
    raise ValueError(f"unknown LR rule {rule!r}: use 'sqrt' (Adam family) or 'linear' (SGD)")


Schedule = Callable[[int], int] | Sequence[tuple[int, int]]


class BatchRamp:
    """The global batch (samples over all ranks) for each optimizer step.

    Make one with :meth:`schedule` (the batch as a function of the step) or
    :meth:`noise_scale` (grow when the measured noise scale exceeds the batch), and give it
    to ``MicroBatcher(..., ramp=...)``.

    Args:
        start: The global batch of step 0 (samples, all ranks).
        lr_rule: How the optimizer's learning rates follow a change (:func:`lr_scale`);
            None leaves them alone.
    """

    def __init__(self, start: int, *, lr_rule: LrRule | None = "sqrt") -> None:
        check_positive_int("start", start, meaning="the first global batch, in samples")
        if lr_rule is not None and lr_rule not in ("sqrt", "linear"):
            raise ValueError(
                f"unknown lr_rule {lr_rule!r}: 'sqrt' (Adam family), 'linear' (SGD) or None"
            )
        self.lr_rule = lr_rule
        self.global_batch_size = start
        self._schedule: Callable[[int], int] | None = None
        self._growth = 2.0
        self._max: int | None = None
        self._patience = 0
        self._since_change = 0

    @classmethod
    def schedule(cls, schedule: Schedule, *, lr_rule: LrRule | None = "sqrt") -> BatchRamp:
        """A fixed schedule: ``schedule(step)``, or ``[(step, batch), ...]`` from step 0 on.

        Example:
            >>> ramp = BatchRamp.schedule([(0, 32), (100, 64), (1000, 128)])
            >>> [ramp.at(step) for step in (0, 99, 100, 5000)]
            [32, 32, 64, 128]
        """
        if not callable(schedule):
            schedule = _from_pairs(schedule)
        ramp = cls(_checked(schedule, 0), lr_rule=lr_rule)
        ramp._schedule = schedule
        return ramp

    @classmethod
    def noise_scale(
        cls,
        start: int,
        *,
        max_global_batch: int,
        growth: float = 2.0,
        patience: int = 10,
        lr_rule: LrRule | None = "sqrt",
    ) -> BatchRamp:
        """Grow the global batch by ``growth`` whenever the measured noise scale exceeds the
        batch of the step just done (both in ``num_items``), up to ``max_global_batch``.

        Needs ``Accumulator(..., noise_scale=True)``. After a change (and at the start) it
        waits ``patience`` steps, so that the smoothed estimate has seen the new batch.

        Example:
            >>> ramp = BatchRamp.noise_scale(32, max_global_batch=256, patience=0)
            >>> ramp.global_batch_size
            32
        """
        check_positive_int("max_global_batch", max_global_batch, meaning="the cap, in samples")
        if max_global_batch < start:
            raise ValueError(f"max_global_batch {max_global_batch} is below start {start}")
        if not (math.isfinite(growth) and growth > 1):
            raise ValueError(f"growth must be a factor above 1, got {growth!r}")
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 0:
            raise ValueError(f"patience must be a whole number of steps >= 0, got {patience!r}")
        ramp = cls(start, lr_rule=lr_rule)
        ramp._growth, ramp._max, ramp._patience = growth, max_global_batch, patience
        return ramp

    def at(self, step: int) -> int:
        """The scheduled batch at ``step`` (a schedule ramp), else the current batch."""
        return self.global_batch_size if self._schedule is None else _checked(self._schedule, step)

    def advance(self, step: int, result: StepResult) -> int:
        """Set and return the global batch of optimizer step ``step`` (the next one), after
        ``result`` (the step just done)."""
        self.global_batch_size = self._next(step, result)
        return self.global_batch_size

    def _next(self, step: int, result: StepResult) -> int:
        if self._schedule is not None:
            return self.at(step)
        self._since_change += 1
        current = self.global_batch_size
        assert self._max is not None  # set by noise_scale(), the only other constructor
        if (
            result.noise_scale is None
            or result.noise_scale <= result.num_items
            or self._since_change <= self._patience
            or current >= self._max
        ):
            return current
        self._since_change = 0
        grown = min(self._max, math.ceil(current * self._growth))
        logger.info(
            "noise scale %.4g above the batch of %.4g items: global batch %d -> %d samples",
            result.noise_scale,
            result.num_items,
            current,
            grown,
        )
        return grown

    def apply_lr(
        self, optimizer: torch.optim.Optimizer, scheduler: Any | None, old: int, new: int
    ) -> float:
        """Rescale every parameter group's rate (and a scheduler's base rates) by the rule."""
        if self.lr_rule is None or old == new:
            return 1.0
        factor = lr_scale(self.lr_rule, old, new)
        for group in optimizer.param_groups:
            group["lr"] = group["lr"] * factor
            if "initial_lr" in group:  # what a scheduler created later starts from
                group["initial_lr"] = group["initial_lr"] * factor
        base_lrs = getattr(scheduler, "base_lrs", None)
        if scheduler is not None and isinstance(base_lrs, list):
            # LambdaLR and the closed-form schedulers compute from these
            scheduler.base_lrs = [lr * factor for lr in base_lrs]
        return factor


def _from_pairs(pairs: Sequence[tuple[int, int]]) -> Callable[[int], int]:
    steps = [step for step, _ in pairs]
    if not pairs or steps[0] != 0 or any(b <= a for a, b in itertools.pairwise(steps)):
        raise ValueError(
            f"a batch schedule is [(step, global_batch), ...] with steps rising from 0, got "
            f"{list(pairs)!r}"
        )
    for _, batch in pairs:
        check_positive_int("global batch", batch, meaning="samples per optimizer step")
    table = list(pairs)

    def batch_at(step: int) -> int:
        current = table[0][1]
        for first, batch in table:
            if first > step:
                break
            current = batch
        return current

    return batch_at


def _checked(schedule: Callable[[int], int], step: int) -> int:
    batch = schedule(step)
    check_positive_int(
        f"the scheduled global batch at step {step}", batch, meaning="samples per optimizer step"
    )
    return batch
