"""Two CPU ranks under ``torchrun`` (gloo): accumulation over micro-steps *and* ranks with
unequal token counts equals one full-batch step, and an OOM on one rank shrinks both.

``_ddp_worker.py`` runs every scenario, in the test run's one launch of the rank scenarios
(``tests/_rank_scenarios.py``); the tests read its output.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._rank_scenarios import scenario_out
from tests._tiny import full_batch_steps, linear_stack, token_batches
from tests.train._ddp_worker import LR, shard

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ddp_out(request: pytest.FixtureRequest) -> Path:
    return scenario_out(request, "ddp")


def _records(out: Path) -> list[dict[str, Any]]:
    return [json.loads((out / f"record{rank}.json").read_text()) for rank in (0, 1)]


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR)


def _assert_params(out: Path, name: str, reference: torch.nn.Module) -> None:
    for rank in (0, 1):
        state = torch.load(out / f"{name}{rank}.pt")
        for key, value in reference.state_dict().items():
            torch.testing.assert_close(state[key], value, atol=1e-6, rtol=0)


def test_unequal_token_counts_equal_the_full_batch(ddp_out: Path) -> None:
    batches = token_batches(2, 8, seed=5)
    counts = [int((shard(batches[0], r, 2)[1] != -100).sum()) for r in (0, 1)]
    assert counts[0] > counts[1]  # the ranks really hold different numbers of tokens
    reference = linear_stack()
    losses = full_batch_steps(reference, batches, make_opt=_sgd)
    _assert_params(ddp_out, "native", reference)
    for record in _records(ddp_out):
        steps = record["native"]
        assert [s["loss"] for s in steps] == pytest.approx(losses, rel=1e-6)
        assert steps[0]["num_items"] == sum(counts)


def test_oom_on_one_rank_shrinks_every_rank_in_the_same_step(ddp_out: Path) -> None:
    for record in _records(ddp_out):
        assert [(s["micro_batch_size"], s["ooms"]) for s in record["oom"]] == [(4, 1), (4, 0)]
    reference = linear_stack()
    losses = full_batch_steps(reference, token_batches(2, 32, seed=6), make_opt=_sgd)
    _assert_params(ddp_out, "oom", reference)
    for record in _records(ddp_out):
        assert [s["loss"] for s in record["oom"]] == pytest.approx(losses, rel=1e-6)
