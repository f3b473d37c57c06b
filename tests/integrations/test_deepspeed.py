"""``DeepSpeedMicroBatcher`` on a real DeepSpeed engine: two CPU ranks under ``torchrun`` (gloo,
``DS_ACCELERATOR=cpu``), ZeRO stages 0 and 1. A real OOM on one rank (``RLIMIT_DATA``) shrinks
both in the same step, the engine's config is rebuilt around the same ``train_batch_size``,
and the parameters equal a run at the smaller micro-batch from the start.

``_deepspeed_worker.py`` runs both stages, in the test run's one launch of the rank scenarios
(``tests/_rank_scenarios.py``); the tests read its output.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests._rank_scenarios import scenario_out

pytest.importorskip("deepspeed")


@pytest.fixture(scope="module")
def ds_out(request: pytest.FixtureRequest) -> Path:
    return scenario_out(request, "deepspeed")


def _records(out: Path, stage: int) -> list[dict[str, Any]]:
    return [json.loads((out / f"record{rank}_zero{stage}.json").read_text()) for rank in (0, 1)]


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1])
def test_oom_on_one_rank_shrinks_every_rank_and_rebuilds_the_engine(
    ds_out: Path, stage: int
) -> None:
    for record in _records(ds_out, stage):
        oom, small = record["oom"], record["small"]
        assert [(s["micro_batch_size"], s["grad_accum_steps"], s["ooms"]) for s in oom[:-1]] == [
            (8, 2, 1),
            (8, 2, 0),
        ]
        assert oom[-1] == {"micro": 8, "gas": 2, "train_batch_size": 32, "global_steps": 2}
        assert [s["loss"] for s in oom[:-1]] == pytest.approx(
            [s["loss"] for s in small[:-1]], rel=1e-6
        )
    states = {
        (name, rank): torch.load(ds_out / f"{name}{rank}_zero{stage}.pt")
        for name in ("oom", "small")
        for rank in (0, 1)
    }
    reference = states["small", 0]
    for state in states.values():  # both ranks, both runs: one set of parameters
        for key, value in reference.items():
            torch.testing.assert_close(state[key], value, atol=1e-6, rtol=0)


def _engine(stage: int, world: int, micro: int = 4, gas: int = 2) -> Any:
    """The config reads of an engine, for the checks that happen before any step."""
    return SimpleNamespace(
        dp_world_size=world,
        zero_optimization_stage=lambda: stage,
        train_micro_batch_size_per_gpu=lambda: micro,
        gradient_accumulation_steps=lambda: gas,
        train_batch_size=lambda: micro * gas * world,
        module=torch.nn.Linear(2, 1),
    )


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_stages_that_communicate_in_a_micro_step_are_refused_on_several_ranks(
    stage: int,
) -> None:
    from batchfit.integrations.deepspeed import DeepSpeedMicroBatcher

    with pytest.raises(ValueError, match=f"ZeRO stage {stage} communicates"):
        DeepSpeedMicroBatcher(_engine(stage, world=2))
    assert DeepSpeedMicroBatcher(_engine(stage, world=1)).micro_batch_size == 4


def test_a_batch_of_another_size_is_refused() -> None:
    from batchfit.integrations.deepspeed import DeepSpeedMicroBatcher

    batcher = DeepSpeedMicroBatcher(_engine(0, world=2))
    with pytest.raises(ValueError, match=r"holds 6 samples.*8 per rank"):
        batcher.run(torch.zeros(6, 2), lambda micro: micro.sum())
