"""A CUDA dry run's first step, rebuilt from the primed run, is the whole first step it replaces.

The allocator's reserve follows a whole first step then the measured one. Running the first
step costs as much as the measured one; rebuilding it from the measured step's forward and
backward and the optimizer's priming step gives the allocator the same allocations.
"""

import json
from itertools import groupby
from typing import Any

import pytest
import torch

from batchfit.hardware import get_gpu
from batchfit.memory.device.allocator import simulate
from batchfit.memory.device.totals import gpu_extras
from batchfit.memory.formulas.analytic import resolve_setup
from batchfit.memory.trace.hf import trace_once
from batchfit.models import resolve_model
from batchfit.spec import TrainingSetup
from tests._tiny import TINY_LLAMA_JSON


def _runs(events: tuple[tuple[int, int], ...]) -> list[Any]:
    """The sizes in order, each run of consecutive frees as a sorted run (the order in which
    ``zero_grad`` and the collector free a batch of tensors is not the step's)."""
    sizes = [delta for _key, delta in events if delta]
    return [
        sorted(group) if freeing else list(group)
        for freeing, group in groupby(sizes, key=lambda delta: delta < 0)
    ]


def _traced(config: Any, options: dict[str, Any], whole: bool) -> Any:
    model, gpu = resolve_model(str(config)), get_gpu("a100-40gb")
    setup = resolve_setup(model, TrainingSetup(**options), "cuda", gpu)
    return trace_once(
        model,
        setup,
        micro=2,
        seq=32,
        device="cuda",
        workspace=gpu_extras(gpu, setup).workspace,
        depth=None,
        grad_accum_steps=2,
        whole_first_step=whole,
    )


@pytest.fixture
def tiny_llama(tmp_path: Any) -> Any:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**json.loads(TINY_LLAMA_JSON), "num_hidden_layers": 3}))
    return config


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"method": "lora", "grad_ckpt": True},
        {"optimizer": "adamw-8bit", "loss": "chunked"},
        {"sharding": "fsdp", "num_gpus": 2},
    ],
    ids=["adamw", "lora-ckpt", "8bit-chunked", "fsdp2"],
)
def test_the_rebuilt_first_step_allocates_as_the_whole_one(
    tiny_llama: Any, options: dict[str, Any]
) -> None:
    whole, rebuilt = (_traced(tiny_llama, options, whole) for whole in (True, False))
    assert _runs(rebuilt.events) == _runs(whole.events)
    assert rebuilt.reserved_bytes == whole.reserved_bytes
    assert rebuilt.reserved_bytes == simulate(whole.events).reserved_bytes
    assert rebuilt.peak.total == whole.peak.total


def test_gradients_kept_across_steps_run_the_first_step_whole(
    tiny_llama: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``zero_grad`` that zeroes instead of dropping (torch before 2.0): a real first step
    allocates the gradients in its backward, which a primed run does not show."""
    zero = torch.optim.Optimizer.zero_grad
    monkeypatch.setattr(
        torch.optim.Optimizer, "zero_grad", lambda self, set_to_none=True: zero(self, False)
    )
    whole, rebuilt = (_traced(tiny_llama, {}, whole) for whole in (True, False))
    assert rebuilt.events == whole.events and rebuilt.reserved_bytes == whole.reserved_bytes
