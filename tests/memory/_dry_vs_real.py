"""One check shared by the trace's tests: a dry run allocates what the real CPU step does."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from batchfit.memory.trace import dry_run as trace
from batchfit.memory.trace import hf as _hf_trace
from batchfit.models import ModelInfo
from batchfit.spec import TrainingSetup

# Checkpointing stashes a few KB per layer (RNG state) that only the fake run sees.
CKPT_SLACK_BYTES = 64 * 1024


def real_and_dry(
    info: ModelInfo, setup: TrainingSetup, *, micro: int, seq: int
) -> tuple[Any, Any, Any]:
    """The step's parts, its traced moments on real CPU tensors, and on fake ones."""
    setup = setup.resolved(device="cpu", bf16_supported=True)
    torch.manual_seed(0)
    parts = _hf_trace.step_parts(info, setup, micro=micro, seq=seq, emulate_cuda=False)
    real = trace.run_steps(
        parts.model,
        parts.optimizer,
        parts.make_batch,
        parts.loss_of,
        autocast_dtype=parts.autocast_dtype,
        loop=setup.loop,
    )
    fake = _hf_trace.trace_once(
        info,
        setup,
        micro=micro,
        seq=seq,
        device="cpu",
        workspace=0,
        depth=None,
        grad_accum_steps=1,
    )
    return parts, real, fake


def assert_dry_run_matches_real(
    info: ModelInfo, setup: TrainingSetup, *, micro: int, seq: int, rel: float = 0.01
) -> Any:
    """Every moment of the dry run within ``rel`` (or the checkpointing slack) of the real one;
    returns the step's parts for further checks."""
    parts, real, fake = real_and_dry(info, setup, micro=micro, seq=seq)
    fake_by = {p.key: p for p in fake.phases}
    assert set(fake_by) == {p.key for p in real.phases}
    for phase in real.phases:
        tolerance = max(rel * phase.total, CKPT_SLACK_BYTES if setup.grad_ckpt else 0)
        assert fake_by[phase.key].total == pytest.approx(phase.total, abs=tolerance), phase.key
    return parts
