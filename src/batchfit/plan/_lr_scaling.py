"""Learning-rate scaling: an LR tuned at one global batch, moved to another."""

from __future__ import annotations

import math

from batchfit.errors import UsageError
from batchfit.spec import ADAM_FAMILY

# In ADAM_FAMILY for want of a better rule, not by a source: the text says so.
_UNSOURCED = frozenset({"lion", "adafactor"})


def scale_learning_rate(
    base_lr: float, base_batch: float, global_batch: int, optimizer: str
) -> tuple[float, str]:
    """Scale a learning rate tuned at ``base_batch`` to ``global_batch``.

    Linear for SGD (Goyal et al. 2017), square root for Adam-family optimizers (Malladi et al.
    2022); both hold only below the critical batch size. Lion and Adafactor have no published
    rule: they get the square root too, and the returned text says it is a guess.

    Example:
        >>> scale_learning_rate(1e-4, 256, 1024, "adamw")[0]
        0.0002
        >>> scale_learning_rate(0.1, 256, 1024, "sgd")[0]
        0.4
        >>> scale_learning_rate(1e-4, 256, 1024, "lion")[1].startswith("no published")
        True
    """
    for flag, value in (("--base-lr", base_lr), ("--base-batch", base_batch)):
        # `not value > 0` also refuses NaN, which compares false with everything
        if not (math.isfinite(value) and value > 0):
            raise UsageError(f"{flag} must be a finite positive number, got {value}")
    ratio = global_batch / base_batch
    if not math.isfinite(base_lr * ratio):  # 1e308 x 4 overflows to inf
        raise UsageError(
            f"--base-lr {base_lr:g} scaled to {global_batch} samples overflows: give a real rate"
        )
    sqrt_text = f"{base_lr:g} x sqrt({global_batch}/{_count(base_batch)})"
    if optimizer in _UNSOURCED:
        return base_lr * math.sqrt(ratio), (
            f"no published batch-size rule for {optimizer} (it keeps other state than Adam): "
            f"Adam's square-root rule as a first guess, tune it: {sqrt_text}"
        )
    if optimizer in ADAM_FAMILY:
        return base_lr * math.sqrt(ratio), (
            f"square-root scaling for {optimizer} (Malladi et al. 2022): {sqrt_text}"
        )
    return base_lr * ratio, (
        f"linear scaling for {optimizer} (Goyal et al. 2017): "
        f"{base_lr:g} x {global_batch}/{_count(base_batch)}"
    )


def _count(batch: float) -> str:
    """A batch as written: whole numbers in full, a fraction to four digits."""
    return f"{batch:.0f}" if float(batch).is_integer() else f"{batch:.4g}"
