"""A CUDA dry run of a config file on an A100-40GB at 2 x 32, two micro-steps: what the
first-step replay and unroll tests compare, and how they compare it."""

from itertools import groupby
from typing import Any

from batchfit.hardware import get_gpu
from batchfit.memory.device.totals import gpu_extras
from batchfit.memory.formulas.analytic import resolve_setup
from batchfit.memory.trace.hf import trace_once
from batchfit.models import resolve_model
from batchfit.spec import TrainingSetup


def cuda_trace(path: str, options: dict[str, Any], **kw: Any) -> Any:
    """``trace_once`` of ``path`` under ``TrainingSetup(**options)``; ``kw`` as its keywords
    (``depth`` defaults to the whole model)."""
    model, gpu = resolve_model(path), get_gpu("a100-40gb")
    setup = resolve_setup(model, TrainingSetup(**options), "cuda", gpu)
    kw.setdefault("depth", None)
    return trace_once(
        model,
        setup,
        micro=2,
        seq=32,
        device="cuda",
        workspace=gpu_extras(gpu, setup).workspace,
        grad_accum_steps=2,
        **kw,
    )


def runs(events: Any) -> list[Any]:
    """The sizes in order, each run of consecutive frees sorted: the order in which
    ``zero_grad`` and the collector free a batch of tensors is their own, and changes neither
    the peak nor the reserve."""
    sizes = [delta for _key, delta in events if delta]
    return [
        sorted(group) if freeing else list(group)
        for freeing, group in groupby(sizes, key=lambda delta: delta < 0)
    ]
