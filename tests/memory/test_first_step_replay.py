"""A CUDA dry run's first step, rebuilt from the primed run, is the whole first step it replaces.

The allocator's reserve follows a whole first step then the measured one. Running the first
step costs as much as the measured one; rebuilding it from the measured step's forward and
backward and the optimizer's priming step gives the allocator the same allocations.
"""

import json
from typing import Any

import pytest
import torch

from batchfit.memory.device.allocator import simulate
from tests._tiny import TINY_LLAMA_JSON
from tests.memory._cuda_trace import cuda_trace, runs


def _traced(config: Any, options: dict[str, Any], whole: bool) -> Any:
    return cuda_trace(str(config), options, whole_first_step=whole)


@pytest.fixture(scope="module")
def configs(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The tiny Llama's config path at 1 layer (its seven linears, norms, embedding and head:
    parameters enough to order) and at 3 (FSDP's prefetch has a middle layer to gather ahead
    of)."""
    paths = {}
    for layers in (1, 3):
        path = tmp_path_factory.mktemp(f"llama{layers}") / "config.json"
        path.write_text(json.dumps({**json.loads(TINY_LLAMA_JSON), "num_hidden_layers": layers}))
        paths[layers] = path
    return paths


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
    configs: Any, options: dict[str, Any]
) -> None:
    config = configs[3 if options.get("sharding") == "fsdp" else 1]
    whole, rebuilt = (_traced(config, options, whole) for whole in (True, False))
    assert runs(rebuilt.events) == runs(whole.events)
    assert rebuilt.reserved_bytes == whole.reserved_bytes
    assert rebuilt.reserved_bytes == simulate(whole.events).reserved_bytes
    assert rebuilt.peak.total == whole.peak.total


def test_gradients_kept_across_steps_run_the_first_step_whole(
    configs: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``zero_grad`` that zeroes instead of dropping (torch before 2.0): a real first step
    allocates the gradients in its backward, which a primed run does not show."""
    zero = torch.optim.Optimizer.zero_grad
    monkeypatch.setattr(
        torch.optim.Optimizer, "zero_grad", lambda self, set_to_none=True: zero(self, False)
    )
    whole, rebuilt = (_traced(configs[1], {}, whole) for whole in (True, False))
    assert rebuilt.events == whole.events and rebuilt.reserved_bytes == whole.reserved_bytes
