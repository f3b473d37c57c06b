"""Plan: global batch -> micro-batch x accumulation x GPUs, exactly; the LR; what makes it fit.

The planner's rooms, in this folder: ``request.py`` (``PlanRequest``: the inputs, checked),
``_make.py`` (``make_plan``: the steps of a plan), ``_choice.py`` (the choice among the
ladder's options), ``_target.py`` (one plan's fixed inputs: what fits, how long a step
takes), ``_warnings.py`` (the plan's warnings), ``_ladder.py`` (the technique ladder),
``_max_micro_batch.py`` (the largest micro-batch that fits), ``_divisors.py`` (micro-batches
that divide the batch), ``_lr_scaling.py`` (the LR rule), ``_value.py`` (the ``Plan`` value)
and ``_fit_table.py`` (``batchfit gpus``).
This module names what they offer. ``TIME_TOLERANCE`` and ``OFFLOAD_MARGIN`` live in
``_ladder.py`` and are read from there each time a plan is made (``_choice.py``).
"""

from __future__ import annotations

from batchfit.plan._batch_laws import BatchAdvice as BatchAdvice
from batchfit.plan._batch_laws import model_batch_laws as model_batch_laws
from batchfit.plan._choice import MAX_QUIET_ACCUM as MAX_QUIET_ACCUM
from batchfit.plan._divisors import largest_divisor_at_most as largest_divisor_at_most
from batchfit.plan._fit_table import FIT_RULE as FIT_RULE
from batchfit.plan._fit_table import FitRow, fit_table
from batchfit.plan._gpu_count import DEFAULT_MAX_GPUS
from batchfit.plan._ladder import OFFLOAD_MARGIN as OFFLOAD_MARGIN
from batchfit.plan._ladder import TIME_TOLERANCE as TIME_TOLERANCE
from batchfit.plan._ladder import Technique
from batchfit.plan._lr_scaling import parse_betas as parse_betas
from batchfit.plan._lr_scaling import scale_learning_rate
from batchfit.plan._make import make_plan, make_plan_auto
from batchfit.plan._max_micro_batch import DEFAULT_HEADROOM_BYTES, PRUNE_MARGIN
from batchfit.plan._target import _Target as _Target  # benchmarks/plan_choice.py times with it
from batchfit.plan._throughput import ProbeFile as ProbeFile
from batchfit.plan._throughput import probe_identity as probe_identity
from batchfit.plan._throughput import read_probe as read_probe
from batchfit.plan._value import Alternative, Plan
from batchfit.plan.request import PlanRequest, samples_from_target

__all__ = [
    "DEFAULT_HEADROOM_BYTES",
    "DEFAULT_MAX_GPUS",
    "PRUNE_MARGIN",
    "Alternative",
    "FitRow",
    "Plan",
    "PlanRequest",
    "Technique",
    "fit_table",
    "make_plan",
    "make_plan_auto",
    "samples_from_target",
    "scale_learning_rate",
]
