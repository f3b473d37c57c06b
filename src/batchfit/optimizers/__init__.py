"""Optimizers: one registered ``OptimizerSpec`` each, asked by every engine.

The memory formulas ask for its state and step temporaries, the dry run for the optimizer to
build, the step-time model for its memory traffic, the planner for its learning-rate rule and
what it may swap to, the exports for its names, and ``TrainingSetup`` for the shardings it
runs under. Adding an optimizer is one ``register(OptimizerSpec(...))`` (CONTRIBUTING.md).

Example:
    >>> from batchfit.optimizers import ParamTensor, get_optimizer
    >>> get_optimizer("adamw").state_bytes([ParamTensor((4096, 4096))], state_elem=4)
    134217728
"""

from __future__ import annotations

from batchfit.optimizers import builtin as _builtin  # noqa: F401  (registers the built-ins)
from batchfit.optimizers.base import (
    ALL_SHARDINGS,
    Accesses,
    ExportNames,
    Impl,
    LrRule,
    OptimizerSpec,
    ParamTensor,
    StepContext,
    get_optimizer,
    make_optimizer,
    register,
    registered,
)

# The names registered when batchfit is imported: the CLI's choices.
OPTIMIZERS: tuple[str, ...] = registered()

__all__ = [
    "ALL_SHARDINGS",
    "OPTIMIZERS",
    "Accesses",
    "ExportNames",
    "Impl",
    "LrRule",
    "OptimizerSpec",
    "ParamTensor",
    "StepContext",
    "get_optimizer",
    "make_optimizer",
    "register",
    "registered",
]
