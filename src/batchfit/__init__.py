"""batchfit: what a training step needs, the micro-batch that fits, and exact accumulation.

Public names resolve lazily (PEP 562), so ``import batchfit`` stays cheap and the analytic path
never imports torch or transformers.

Example:
    >>> import batchfit
    >>> model = batchfit.resolve_model("gpt2")
    >>> est = batchfit.estimate(model, batchfit.TrainingSetup(), micro_batch_size=8,
    ...                         seq_len=512, device="cpu", engine="analytic")
    >>> est.components["weights"] == 4 * model.total_params
    True
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

import batchfit.views.html  # noqa: F401  (registers the pages behind the values' _repr_html_)
from batchfit._version import __version__

if TYPE_CHECKING:
    from batchfit.errors import UsageError
    from batchfit.export import export
    from batchfit.frameworks import with_framework
    from batchfit.hardware import GpuSpec, all_gpus, get_gpu
    from batchfit.memory.estimate import estimate
    from batchfit.memory.types import MemoryEstimate
    from batchfit.models import ModelInfo, resolve_model
    from batchfit.plan import Plan, PlanRequest, fit_table, make_plan, scale_learning_rate
    from batchfit.profile import profile_memory
    from batchfit.spec import TrainingSetup
    from batchfit.train import (
        Accumulator,
        MicroBatcher,
        StepResult,
        class_weights,
        cross_entropy_sum,
    )
    from batchfit.workload import Workload

_EXPORTS = {
    "TrainingSetup": "batchfit.spec",
    "ModelInfo": "batchfit.models",
    "resolve_model": "batchfit.models",
    "GpuSpec": "batchfit.hardware",
    "get_gpu": "batchfit.hardware",
    "all_gpus": "batchfit.hardware",
    "MemoryEstimate": "batchfit.memory.types",
    "estimate": "batchfit.memory.estimate",
    "Plan": "batchfit.plan",
    "PlanRequest": "batchfit.plan",
    "make_plan": "batchfit.plan",
    "fit_table": "batchfit.plan",
    "scale_learning_rate": "batchfit.plan",
    "profile_memory": "batchfit.profile",
    "export": "batchfit.export",
    "with_framework": "batchfit.frameworks",
    "UsageError": "batchfit.errors",
    "Accumulator": "batchfit.train",
    "MicroBatcher": "batchfit.train",
    "StepResult": "batchfit.train",
    "class_weights": "batchfit.train",
    "cross_entropy_sum": "batchfit.train",
    "Workload": "batchfit.workload",
}

__all__ = [
    "Accumulator",
    "GpuSpec",
    "MemoryEstimate",
    "MicroBatcher",
    "ModelInfo",
    "Plan",
    "PlanRequest",
    "StepResult",
    "TrainingSetup",
    "UsageError",
    "Workload",
    "__version__",
    "all_gpus",
    "class_weights",
    "cross_entropy_sum",
    "estimate",
    "export",
    "fit_table",
    "get_gpu",
    "make_plan",
    "profile_memory",
    "resolve_model",
    "scale_learning_rate",
    "with_framework",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'batchfit' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
