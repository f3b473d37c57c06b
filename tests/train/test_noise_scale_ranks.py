"""Two gloo ranks under ``torchrun`` measure the same noise scale as one process that runs the
same micro-batches: each rank's hooks see its local micro-batch gradients (DDP before its
reducer, FSDP2 on the unsharded parameters before the reduce-scatter), and the sums ride on
the step's one all-reduce. ``_gns_worker.py`` runs in the test run's one launch of the rank
scenarios (``tests/_rank_scenarios.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from batchfit.train import Accumulator, cross_entropy_sum
from tests._rank_scenarios import scenario_out
from tests._tiny import linear_stack, token_batches
from tests.train._ddp_worker import LR, shard
from tests.train._gns_worker import SLICES

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gns_out(request: pytest.FixtureRequest) -> Path:
    return scenario_out(request, "gns")


@pytest.fixture(scope="module")
def records(gns_out: Path) -> list[dict[str, list[float | None]]]:
    return [json.loads((gns_out / f"gns{rank}.json").read_text()) for rank in (0, 1)]


def _one_process(slices: list[tuple[int, int]]) -> list[float | None]:
    """Both ranks' micro-batches as micro-steps of one process, with the same global batch."""
    model = linear_stack()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    acc = Accumulator(model, opt, 2 * len(slices), noise_scale=True, noise_scale_ema=0.5)
    values = []
    for batch in token_batches(3, 8, seed=5):
        for rank in (0, 1):
            ids, labels = shard(batch, rank, 2)
            for start, stop in slices:
                with acc.micro_step() as micro:
                    acc.backward(*cross_entropy_sum(model(ids[start:stop]), labels[start:stop]))
        assert micro.result is not None
        values.append(micro.result.noise_scale)
    return values


@pytest.mark.parametrize("name", list(SLICES))
def test_two_ranks_equal_one_process(
    records: list[dict[str, list[float | None]]], name: str
) -> None:
    expected = _one_process(SLICES[name])
    assert all(v is not None and v > 0 for v in expected)
    for record in records:
        assert record[name] == pytest.approx(expected, rel=1e-5)


def test_ranks_agree(records: list[dict[str, list[float | None]]]) -> None:
    """Every rank reads the same all-reduced sums: bit-identical values."""
    assert records[0] == records[1]
