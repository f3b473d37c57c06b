"""Class and sample weights whose weighted losses still accumulate exactly.

A weighted mean loss is ``sum(w_i * loss_i) / sum(w_i)`` over the whole global batch: so the
``num_items`` of a weighted micro-batch is its weight sum, not its sample count
(:func:`cross_entropy_sum` returns both). Seed guide 000, section 3A, weights the rare class
by hand ("e.g. 10x"); :func:`class_weights` computes the weights from the label counts.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Literal

import torch
import torch.nn.functional as F

from batchfit.train._checks import check_positive_int

logger = logging.getLogger(__name__)

Scheme = Literal["inverse", "sqrt_inverse", "effective_number"]
SCHEMES: tuple[str, ...] = ("inverse", "sqrt_inverse", "effective_number")


def class_weights(
    labels: torch.Tensor | Sequence[int],
    num_classes: int | None = None,
    *,
    scheme: Scheme = "inverse",
    beta: float = 0.999,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Per-class loss weights from label counts, averaging 1 over the classes present.

    Schemes, for a class with ``n`` samples: ``inverse`` 1/n; ``sqrt_inverse`` 1/sqrt(n);
    ``effective_number`` (1 - beta) / (1 - beta**n), the inverse of the effective number of
    samples (Cui et al. 2019, "Class-Balanced Loss Based on Effective Number of Samples",
    eq. 3): beta = 0 weights every class alike, beta -> 1 tends to ``inverse``. A class absent
    from ``labels`` gets weight 0 (logged): there is nothing to count it by.

    Counting costs time in proportion to the number of labels, whatever their values; the
    answer itself takes 4 bytes per class.

    Args:
        labels: Class indices, any shape; entries equal to ``ignore_index`` are skipped.
        num_classes: Number of classes; defaults to the largest label + 1 (refused above
            2**24, where a label is more likely an id than a class: pass it explicitly).
        scheme: How a count becomes a weight.
        beta: For ``effective_number``, in [0, 1).
        ignore_index: Label of padding / unlabelled items.

    Returns:
        A float32 tensor of ``num_classes`` weights, for ``F.cross_entropy(weight=...)`` or
        :func:`cross_entropy_sum`.

    Example:
        >>> class_weights(torch.tensor([0, 0, 0, 1]))
        tensor([0.5000, 1.5000])
        >>> class_weights([0, 0, 0, 1], scheme="effective_number", beta=0.0)
        tensor([1., 1.])
    """
    if scheme not in SCHEMES:
        raise ValueError(f"scheme {scheme!r} is not one of: {', '.join(SCHEMES)}")
    if not 0.0 <= beta < 1.0:
        raise ValueError(f"beta must be in [0, 1), got {beta!r}; Cui et al. use 0.9 to 0.9999")
    flat = _labels_tensor(labels).reshape(-1)
    flat = flat[flat != ignore_index]
    if flat.numel() == 0:
        raise ValueError("labels holds no class index besides ignore_index: nothing to count")
    low, top = int(flat.min()), int(flat.max())
    if low < 0:
        raise ValueError(f"labels holds negative class {low}; set ignore_index to skip it")
    num_classes = _num_classes(num_classes, top)
    classes, counts = _present_counts(flat, top)
    n = counts.to(torch.float64)
    if scheme == "inverse":
        raw = 1.0 / n
    elif scheme == "sqrt_inverse":
        raw = n.rsqrt()
    else:
        raw = (1.0 - beta) / (1.0 - beta**n)
    raw *= len(classes) / raw.sum()
    weights = torch.zeros(num_classes, dtype=torch.float32)
    weights[classes] = raw.to(torch.float32)
    if len(classes) < num_classes:
        _warn_absent(classes.tolist(), num_classes)
    return weights


# Inferring more classes than this from the largest label is refused: 2**24 weights are 64 MiB,
# 64x the largest vocabulary in use (Gemma's 262,144 tokens); a larger id is not a class index.
_MAX_INFERRED_CLASSES = 2**24
# Labels are counted with bincount while its table (largest label + 1 entries) is no longer
# than the labels or this; with a sort beyond.
_SMALL_TABLE = 2**16
_ABSENT_SHOWN = 10


def _labels_tensor(labels: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """``labels`` as a tensor of integer class indices, or a one-line error naming the fix."""
    try:
        tensor = torch.as_tensor(labels)
    except (TypeError, ValueError, RuntimeError) as e:  # what as_tensor raises on non-numbers
        raise TypeError(
            f"labels must be a tensor or a rectangular list of int class indices, got "
            f"{type(labels).__name__} ({e})"
        ) from e
    if tensor.numel() == 0:
        raise ValueError("labels is empty: pass the class index of every sample to count")
    if tensor.dtype == torch.bool:
        raise ValueError(
            "labels are booleans, not class indices: pass labels.long() to count False as "
            "class 0 and True as class 1"
        )
    if tensor.is_floating_point() or tensor.is_complex():
        raise ValueError(f"labels must hold class indices (integers), got {tensor.dtype}")
    return tensor


def _present_counts(labels: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Classes present in ``labels`` (ascending, on the CPU) and how many times each occurs.

    The cost follows the number of labels, not the value of the largest (``top``): a
    bincount (fast) while its table is no longer than the labels, a sort (``unique``) beyond.
    """
    if top < max(labels.numel(), _SMALL_TABLE):
        table = torch.bincount(labels).cpu()
        classes = table.nonzero().reshape(-1)
        return classes, table[classes]
    classes, counts = torch.unique(labels, return_counts=True)
    return classes.cpu(), counts.cpu()


def _num_classes(num_classes: int | None, top: int) -> int:
    if num_classes is None:
        if top >= _MAX_INFERRED_CLASSES:
            raise ValueError(
                f"label {top} would make {top + 1} classes: pass num_classes= if the model "
                "really has that many outputs, or map the labels to 0..K-1 first"
            )
        return top + 1
    check_positive_int(
        "num_classes",
        num_classes,
        meaning="the model's output classes",
        fix="pass None to take the largest label + 1",
    )
    if top >= num_classes:
        raise ValueError(f"label {top} is out of range for num_classes={num_classes}")
    return num_classes


def _warn_absent(present: list[int], num_classes: int) -> None:
    """Log the classes without samples; the first few by name (there may be millions)."""
    seen = set(present)
    # Among the first len(present) + _ABSENT_SHOWN ids at least that many are absent.
    scan = range(min(num_classes, len(present) + _ABSENT_SHOWN))
    shown = [c for c in scan if c not in seen][:_ABSENT_SHOWN]
    absent = num_classes - len(present)
    if absent == len(shown):
        logger.warning("classes %s have no samples in labels: their weight is 0", shown)
    else:
        logger.warning(
            "%d classes have no samples in labels (the first: %s): their weight is 0",
            absent,
            shown,
        )


def cross_entropy_sum(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    class_weights: torch.Tensor | None = None,
    sample_weights: torch.Tensor | None = None,
    ignore_index: int = -100,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy summed over items, and what to divide it by: ``(loss_sum, num_items)``.

    ``num_items`` is the number of items not equal to ``ignore_index`` without weights, and
    the sum of the item weights (class weight x sample weight) with them, so that
    ``loss_sum / num_items`` over a whole global batch is PyTorch's weighted mean
    (``F.cross_entropy(weight=w, reduction="mean")``). Pass both to ``Accumulator.backward``.

    Args:
        logits: ``[..., C]``, classes last (token logits ``[B, T, V]`` included).
        target: ``[...]`` class indices, the shape of ``logits`` without the class dim.
        class_weights: ``[C]`` weight per class.
        sample_weights: Weight per item, the shape of ``target`` (or broadcastable to it).
        ignore_index: Target of items that carry no loss (padding).

    Example:
        >>> logits = torch.zeros(3, 2)
        >>> loss_sum, n = cross_entropy_sum(logits, torch.tensor([0, 1, -100]))
        >>> round(float(loss_sum / n), 4), int(n)
        (0.6931, 2)
        >>> _, n = cross_entropy_sum(logits, torch.tensor([0, 1, 1]),
        ...                          class_weights=torch.tensor([2.0, 0.5]))
        >>> float(n)
        3.0
    """
    if logits.shape[:-1] != target.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and target {tuple(target.shape)} do not match: "
            "logits are [..., C] with the classes last, target is [...]"
        )
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_target = target.reshape(-1)
    if class_weights is not None:
        # F.cross_entropy wants the weights in the logits' dtype (bf16 / fp16 / fp64 logits).
        class_weights = class_weights.to(dtype=logits.dtype, device=logits.device)
    valid = flat_target != ignore_index
    if sample_weights is None:
        loss_sum = F.cross_entropy(
            flat_logits,
            flat_target,
            weight=class_weights,
            ignore_index=ignore_index,
            reduction="sum",
        )
        if class_weights is None:
            return loss_sum, valid.sum()
        item_weights = class_weights[flat_target.clamp(min=0)] * valid
        return loss_sum, item_weights.sum()
    per_item = F.cross_entropy(
        flat_logits, flat_target, ignore_index=ignore_index, reduction="none"
    )
    item_weights = torch.broadcast_to(sample_weights, target.shape).reshape(-1) * valid
    if class_weights is not None:
        item_weights = item_weights * class_weights[flat_target.clamp(min=0)]
    return (per_item * item_weights).sum(), item_weights.sum()
