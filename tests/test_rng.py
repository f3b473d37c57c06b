"""``RngState``: one snapshot of Python's, numpy's and torch's random states, put back whole."""

from __future__ import annotations

import random

import numpy as np
import torch

from batchfit._rng import RngState
from batchfit.search import find_batch_size


def _draws() -> tuple[float, float, float]:
    return random.random(), float(np.random.rand()), float(torch.rand(1))


def test_restore_gives_the_same_draws_everywhere() -> None:
    state = RngState.capture()
    first = _draws()
    _draws()
    state.restore()
    assert _draws() == first


def test_the_search_leaves_numpy_as_it_found_it() -> None:
    """A probe that draws from numpy (augmentation, shuffling) must not move the caller's."""
    np.random.seed(0)
    expected = np.random.rand()
    np.random.seed(0)

    def step_fn(batch: torch.Tensor) -> None:
        np.random.rand(len(batch))

    find_batch_size(step_fn, lambda n: torch.zeros(n, 1), high=4, steps_per_trial=2)
    assert np.random.rand() == expected
