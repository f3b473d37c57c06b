"""Two CPU ranks under ``torchrun`` (gloo) with FSDP2 (``fully_shard``): accumulation over
unequal micro-batches and ranks equals one full-batch step (clipped by the global norm), only
the last micro-step reduce-scatters, and a real OOM on one rank shrinks both in the same step.

``_fsdp_worker.py`` runs every scenario, in the test run's one launch of the rank scenarios
(``tests/_rank_scenarios.py``); the tests read its output.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests._rank_scenarios import scenario_out
from tests._tiny import VOCAB, linear_stack, token_batches
from tests.train._fsdp_worker import CLIP

pytestmark = pytest.mark.slow

# The worker's scenarios (see its docstring) and the reference's learning rate.
LR = 0.5


@pytest.fixture(scope="module")
def fsdp_out(request: pytest.FixtureRequest) -> Path:
    return scenario_out(request, "fsdp")


def _records(out: Path) -> list[dict[str, Any]]:
    return [json.loads((out / f"record{rank}.json").read_text()) for rank in (0, 1)]


def _clipped_full_batch_steps(model: torch.nn.Module) -> tuple[list[float], list[float]]:
    """One process, the whole global batch: mean loss, clip to CLIP, SGD. Losses and norms."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, norms = [], []
    for ids, labels in token_batches(2, 8, seed=5):
        loss = F.cross_entropy(model(ids).reshape(-1, VOCAB), labels.reshape(-1))
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses, norms


def test_unequal_items_per_rank_and_micro_batch_equal_the_full_batch(fsdp_out: Path) -> None:
    reference = linear_stack()
    losses, norms = _clipped_full_batch_steps(reference)
    assert min(norms) > CLIP  # clipping acted, so a per-shard norm would have shown
    for rank, record in enumerate(_records(fsdp_out)):
        steps = record["native"][:-1]
        assert [s["loss"] for s in steps] == pytest.approx(losses, rel=1e-6)
        assert [s["grad_norm"] for s in steps] == pytest.approx(norms, rel=1e-5)
        state = torch.load(fsdp_out / f"native{rank}.pt")
        for key, value in reference.state_dict().items():
            torch.testing.assert_close(state[key], value, atol=1e-6, rtol=0)


def test_only_the_last_micro_step_reduce_scatters(fsdp_out: Path) -> None:
    for record in _records(fsdp_out):
        for step in record["native"][:-1]:
            first, last = step["reduce_scatters"]
            assert first == 0
            assert last == 3  # one per sharded layer: embedding and two linears


def test_the_modules_sync_flags_are_put_back(fsdp_out: Path) -> None:
    for record in _records(fsdp_out):
        for scenario in ("native", "oom"):
            flags = record[scenario][-1]["flags_after"]
            assert flags and all(f == [True, True, True] for f in flags)


def test_oom_on_one_rank_shrinks_every_rank_in_the_same_step(fsdp_out: Path) -> None:
    records = _records(fsdp_out)
    for record in records:
        steps = record["oom"][:-1]
        assert [(s["micro_batch_size"], s["ooms"]) for s in steps] == [(8, 1), (8, 0)]
        small = record["small"][:-1]
        assert [(s["micro_batch_size"], s["ooms"]) for s in small] == [(8, 0), (8, 0)]
        assert [s["loss"] for s in steps] == pytest.approx([s["loss"] for s in small], rel=1e-6)
    # A real allocator error under rank 1's OS limit; rank 0 learnt of it through the flag.
    (warning0,) = records[0]["oom"][-1]["warnings"]
    (warning1,) = records[1]["oom"][-1]["warnings"]
    assert "another rank" in warning0
    assert "DefaultCPUAllocator" in warning1
    for rank in (0, 1):
        oom = torch.load(fsdp_out / f"oom{rank}.pt")
        small_state = torch.load(fsdp_out / f"small{rank}.pt")
        assert oom.keys() == small_state.keys()
        for key, value in small_state.items():
            torch.testing.assert_close(oom[key], value, atol=1e-6, rtol=0)
