"""The trace engine: the real training step run on fake tensors, every allocation counted.

- ``dry_run``: the step under ``FakeTensorMode``, at one or two depths (``tracker`` counts,
  ``moments`` says which moment and which layer each allocation belongs to);
- ``unroll``: a shallow dry run's allocation history rebuilt at the model's full depth, for the
  caching allocator's replay;
- ``hf``: a Hugging Face model built from its config; ``module``: the user's own ``nn.Module``;
- ``fsdp``: FSDP2 under a fake process group;
- ``estimate``: results (from a dry run, or read back from the cache through ``result``) turned
  into a ``MemoryEstimate``;
- ``timeline``: one dry run of the whole step as its allocation stream by category, for the
  picture and the snapshot ``views.timeline`` draws.

Importing the package imports nothing else, so a cached result is read without torch. The dry
run's names (``run_steps``, ``training_steps``, ``fake_mode``, ``layer_stacks``, ``quiet``)
still resolve here, from ``dry_run``, on first use.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_DRY_RUN_NAMES = frozenset({"fake_mode", "layer_stacks", "quiet", "run_steps", "training_steps"})


def __getattr__(name: str) -> Any:
    if name in _DRY_RUN_NAMES:
        return getattr(import_module("batchfit.memory.trace.dry_run"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
