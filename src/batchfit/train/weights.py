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

    Args:
        labels: Class indices, any shape; entries equal to ``ignore_index`` are skipped.
        num_classes: Number of classes; defaults to the largest label + 1.
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
    labels = torch.as_tensor(labels)
    if labels.is_floating_point() or labels.is_complex():
        raise ValueError(f"labels must hold class indices (integers), got {labels.dtype}")
    labels = labels.reshape(-1)
    labels = labels[labels != ignore_index]
    if labels.numel() == 0:
        raise ValueError("labels holds no class index besides ignore_index: nothing to count")
    if int(labels.min()) < 0:
        raise ValueError(
            f"labels holds negative class {int(labels.min())}; set ignore_index to skip it"
        )
    top = int(labels.max())
    if num_classes is None:
        num_classes = top + 1
    elif top >= num_classes:
        raise ValueError(f"label {top} is out of range for num_classes={num_classes}")
    counts = torch.bincount(labels.cpu(), minlength=num_classes).to(torch.float64)
    present = counts > 0
    weights = torch.zeros(num_classes, dtype=torch.float64)
    n = counts[present]
    if scheme == "inverse":
        weights[present] = 1.0 / n
    elif scheme == "sqrt_inverse":
        weights[present] = n.rsqrt()
    else:
        weights[present] = (1.0 - beta) / (1.0 - beta**n)
    weights *= int(present.sum()) / weights.sum()
    if not bool(present.all()):
        absent = torch.nonzero(~present).reshape(-1).tolist()
        logger.warning("classes %s have no samples in labels: their weight is 0", absent)
    return weights.to(torch.float32)


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
