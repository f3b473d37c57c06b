"""Splitting global batches along the sample dimension."""

from __future__ import annotations

import pytest
import torch

from batchfit.train._batches import batch_len, slice_batch


def test_nested_fields_split_together() -> None:
    batch = {"inputs": (torch.arange(6), {"mask": torch.ones(6, 2)}), "step": 3}
    assert batch_len(batch) == 6
    part = slice_batch(batch, 4, 8)
    assert part["inputs"][0].tolist() == [4, 5]
    assert part["inputs"][1]["mask"].shape == (2, 2)
    assert part["step"] == 3


def test_list_of_tensors_is_fields_list_of_samples_is_samples() -> None:
    assert batch_len([torch.zeros(5, 2), torch.zeros(5)]) == 5
    samples = [{"ids": torch.arange(n)} for n in (3, 1, 4)]
    assert batch_len(samples) == 3
    assert slice_batch(samples, 1, 3) == samples[1:3]


def test_slices_are_views() -> None:
    x = torch.zeros(4, 3)
    slice_batch((x,), 0, 2)[0].add_(1)
    assert x[:2].sum() == 6


@pytest.mark.parametrize("batch", [torch.tensor(3.0), {"a": "text"}, ()])
def test_nothing_to_split(batch: object) -> None:
    with pytest.raises(ValueError, match="nothing to split"):
        batch_len(batch)
