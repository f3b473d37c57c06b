"""Class weights (Cui et al. 2019) and the weighted loss sum whose ``num_items`` is the weight
sum, so a weighted mean stays exact under accumulation."""

from __future__ import annotations

import logging
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from batchfit.train import class_weights, cross_entropy_sum


def test_schemes_by_hand() -> None:
    labels = torch.tensor([0] * 90 + [1] * 9 + [2])
    inverse = class_weights(labels)
    torch.testing.assert_close(
        inverse, torch.tensor([1 / 90, 1 / 9, 1.0]) * 3 / (1 / 90 + 1 / 9 + 1)
    )
    sqrt = class_weights(labels, scheme="sqrt_inverse")
    assert float(sqrt[2] / sqrt[0]) == pytest.approx(math.sqrt(90))
    beta = 0.99
    effective = class_weights(labels, scheme="effective_number", beta=beta)
    raw = torch.tensor([(1 - beta) / (1 - beta**n) for n in (90, 9, 1)])
    torch.testing.assert_close(effective, raw * 3 / raw.sum())


def test_effective_number_limits() -> None:
    labels = torch.tensor([0] * 50 + [1] * 5)
    assert class_weights(labels, scheme="effective_number", beta=0.0).tolist() == [1.0, 1.0]
    torch.testing.assert_close(
        class_weights(labels, scheme="effective_number", beta=1 - 1e-9),
        class_weights(labels, scheme="inverse"),
        atol=1e-5,
        rtol=0,
    )


@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.integers(0, 6), min_size=1, max_size=200),
    st.sampled_from(["inverse", "sqrt_inverse", "effective_number"]),
)
def test_mean_one_and_rarer_weighs_more(labels: list[int], scheme: str) -> None:
    weights = class_weights(labels, 7, scheme=scheme)  # type: ignore[arg-type]
    counts = torch.bincount(torch.tensor(labels), minlength=7)
    present = counts > 0
    assert float(weights[present].mean()) == pytest.approx(1.0, rel=1e-5)
    assert (weights[~present] == 0).all()
    order = torch.argsort(counts[present])
    w = weights[present][order]
    assert (w[:-1] >= w[1:] - 1e-6).all()


def test_absent_classes_and_ignore_index(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="batchfit.train.weights"):
        weights = class_weights(torch.tensor([[0, 0, 2], [2, -100, -100]]), 4)
    assert weights.tolist() == [1.0, 0.0, 1.0, 0.0]
    assert "classes [1, 3] have no samples" in caplog.text


@pytest.mark.parametrize(
    ("labels", "kwargs", "match"),
    [
        ([0, 1], {"scheme": "balanced"}, "not one of"),
        ([0, 1], {"scheme": "effective_number", "beta": 1.0}, r"beta must be in \[0, 1\)"),
        (torch.tensor([0.0, 1.0]), {}, "class indices"),
        ([0, 5], {"num_classes": 3}, "out of range"),
        ([0, -1], {}, "negative class -1"),
        ([-100, -100], {}, "nothing to count"),
        ([], {}, "labels is empty"),
        (torch.tensor([], dtype=torch.long), {}, "labels is empty"),
        ([True, False, True], {}, r"booleans.*labels\.long\(\)"),
        (torch.tensor([0, 1]) > 0, {}, r"booleans.*labels\.long\(\)"),
        ([0, 1], {"num_classes": True}, "num_classes must be a positive integer"),
        ([0, 1], {"num_classes": 2.0}, "num_classes must be a positive integer"),
        ([0, 2**24], {}, "pass num_classes="),
    ],
)
def test_bad_input(labels: object, kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match) as info:
        class_weights(labels, **kwargs)  # type: ignore[arg-type]
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("labels", [["a", "b"], None, [[0, 1], [2]]])
def test_labels_that_are_not_numbers(labels: object) -> None:
    with pytest.raises(TypeError, match="rectangular list of int class indices") as info:
        class_weights(labels)  # type: ignore[arg-type]
    assert "\n" not in str(info.value)


def test_large_ids_are_counted_by_sorting() -> None:
    """Past the bincount table, the sort gives the same weights (and logs a bounded list)."""
    labels = [3, 3, 100_000]
    weights = class_weights(labels, 100_001)
    assert weights.shape == (100_001,)
    assert weights.nonzero().reshape(-1).tolist() == [3, 100_000]
    torch.testing.assert_close(weights[[3, 100_000]], torch.tensor([2 / 3, 4 / 3]))
    small = class_weights([0, 0, 1])
    torch.testing.assert_close(small, weights[[3, 100_000]])


def test_many_absent_classes_are_logged_briefly(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="batchfit.train.weights"):
        class_weights([0, 2, 100_000], 200_000)
    shown = "[1, 3, 4, 5, 6, 7, 8, 9, 10, 11]"
    assert f"199997 classes have no samples in labels (the first: {shown})" in caplog.text
    assert len(caplog.text) < 300


def test_cost_follows_the_labels_not_their_values() -> None:
    """Four labels, one of them 4,000,000: only the answer's 16 MB of float32 may be allocated
    (under an OS limit of 48 MiB), and inferring 400,000,001 classes is refused, not tried."""
    code = (
        "import resource, torch\n"
        "from pathlib import Path\n"
        "from batchfit.train import class_weights\n"
        "class_weights([0, 1, 1], 3)\n"  # warm up: allocator, thread pool, logging
        "status = Path('/proc/self/status').read_text().split('VmData:')[1]\n"
        "limit = int(status.split()[0]) * 1024 + 48 * 2**20\n"
        "resource.setrlimit(resource.RLIMIT_DATA, (limit, resource.RLIM_INFINITY))\n"
        "w = class_weights([0, 1, 1, 4_000_000], 4_000_001)\n"
        "print(w.shape[0], round(float(w.sum()), 4))\n"
        "try:\n"
        "    class_weights([0, 400_000_000])\n"
        "except ValueError as e:\n"
        "    print('refused', 'num_classes=' in str(e))\n"
    )
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["4000001", "3.0", "refused", "True"]


def _data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(4, 5, 3, generator=gen)
    target = torch.randint(0, 3, (4, 5), generator=gen)
    target[0, 3:] = -100
    return logits, target, torch.rand(4, 5, generator=gen)


@pytest.mark.parametrize("with_class_weights", [False, True])
def test_loss_sum_over_items_is_torch_mean(with_class_weights: bool) -> None:
    logits, target, _ = _data()
    weights = torch.tensor([0.5, 2.0, 1.0]) if with_class_weights else None
    loss_sum, n = cross_entropy_sum(logits, target, class_weights=weights)
    mean = F.cross_entropy(logits.reshape(-1, 3), target.reshape(-1), weight=weights)
    torch.testing.assert_close(loss_sum / n, mean)
    if weights is None:
        assert int(n) == 18


def test_sample_and_class_weights() -> None:
    logits, target, sample = _data()
    cw = torch.tensor([0.5, 2.0, 1.0])
    loss_sum, n = cross_entropy_sum(logits, target, class_weights=cw, sample_weights=sample)
    valid = target != -100
    per = F.cross_entropy(logits[valid], target[valid], reduction="none")
    w = sample[valid] * cw[target[valid]]
    torch.testing.assert_close(loss_sum, (per * w).sum())
    torch.testing.assert_close(n, w.sum())


def test_sums_add_up_across_micro_batches() -> None:
    """What makes weighted accumulation exact: the pieces add to the whole."""
    logits, target, sample = _data()
    cw = torch.tensor([0.5, 2.0, 1.0])
    whole = cross_entropy_sum(logits, target, class_weights=cw, sample_weights=sample)
    parts = [
        cross_entropy_sum(
            logits[i : i + 1], target[i : i + 1], class_weights=cw, sample_weights=sample[i : i + 1]
        )
        for i in range(4)
    ]
    torch.testing.assert_close(sum(p[0] for p in parts), whole[0])
    torch.testing.assert_close(sum(p[1] for p in parts), whole[1])


def test_shape_mismatch() -> None:
    with pytest.raises(ValueError, match="classes last"):
        cross_entropy_sum(torch.zeros(4, 3, 5), torch.zeros(4, 5, dtype=torch.long))


def test_class_weights_follow_the_logits_dtype():
    # class_weights() returns float32; bf16 logits (autocast) must still work.
    import torch

    from batchfit.train import class_weights, cross_entropy_sum

    target = torch.tensor([0, 1, 1, 2])
    logits = torch.randn(4, 3, dtype=torch.bfloat16)
    loss_sum, items = cross_entropy_sum(logits, target, class_weights=class_weights(target))
    assert loss_sum.dtype == torch.bfloat16 and float(items) > 0
