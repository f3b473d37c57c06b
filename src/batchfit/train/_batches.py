"""Cutting a global batch into micro-batches along the sample dimension."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch


def batch_len(batch: Any) -> int:
    """Samples in ``batch``; every field must agree.

    A tensor, a mapping and a tuple (or a list of tensors, as DataLoader's collate gives for
    ``(x, y)`` samples) are records of fields split along dim 0; any other sequence is a list
    of samples.

    Example:
        >>> batch_len({"x": torch.zeros(6, 3), "y": torch.zeros(6), "tag": "train"})
        6
        >>> batch_len([{"text": "a"}, {"text": "b"}])
        2
    """
    lengths = sorted(set(_lengths(batch)))
    if not lengths:
        raise ValueError(
            "the batch holds nothing to split: give a tensor, a mapping or tuple of tensors, "
            "or a list of samples"
        )
    if len(lengths) > 1:
        raise ValueError(
            f"the fields of the batch have different lengths {lengths}: every tensor in a "
            "mapping, tuple or list of tensors is split along dim 0 and must hold one entry "
            "per sample (for per-sample tensors of varying length, pass a list of dicts)"
        )
    return lengths[0]


def slice_batch(batch: Any, start: int, stop: int) -> Any:
    """Samples ``start:stop`` of ``batch`` (views of tensors, no copies).

    Example:
        >>> slice_batch((torch.arange(6), torch.arange(6) * 10), 2, 4)
        (tensor([2, 3]), tensor([20, 30]))
    """
    if isinstance(batch, torch.Tensor):
        return batch[start:stop]
    if isinstance(batch, Mapping):
        return {key: slice_batch(value, start, stop) for key, value in batch.items()}
    if _is_record(batch):
        values = [slice_batch(value, start, stop) for value in batch]
        if hasattr(batch, "_fields"):  # a NamedTuple takes its fields as arguments
            return type(batch)(*values)
        return type(batch)(values)
    if isinstance(batch, Sequence) and not isinstance(batch, str | bytes):
        return batch[start:stop]
    return batch  # a scalar or a string travels with every micro-batch


def _is_record(batch: Any) -> bool:
    if isinstance(batch, tuple):
        return True
    return (
        isinstance(batch, list) and bool(batch) and all(isinstance(v, torch.Tensor) for v in batch)
    )


def _lengths(batch: Any) -> list[int]:
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0:
            return []
        return [batch.shape[0]]
    if isinstance(batch, Mapping):
        return [n for value in batch.values() for n in _lengths(value)]
    if _is_record(batch):
        return [n for value in batch for n in _lengths(value)]
    if isinstance(batch, Sequence) and not isinstance(batch, str | bytes):
        return [len(batch)]
    return []
