"""A setup following a framework's conventions (``--framework``; the presets: ``presets.py``).

An explicit option (``--loop``, ``--loss``, ``--lora-dtype``, ``--frozen-dtype``,
``--optimizer-impl``, ``--precision``) overrides its preset value.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from batchfit.presets import FRAMEWORKS, PRESETS, Preset
from batchfit.spec import TrainingSetup, check_choice

__all__ = ["FRAMEWORKS", "PRESETS", "Preset", "adapter_defaults", "with_framework"]


def with_framework(
    setup: TrainingSetup, framework: str, explicit: frozenset[str] = frozenset()
) -> TrainingSetup:
    """``setup`` following ``framework``'s conventions, except the fields in ``explicit``
    (what the user set on purpose, which wins over the preset).

    Example:
        >>> s = with_framework(TrainingSetup(method="lora"), "litgpt")
        >>> s.loop, s.loss_label, s.lora_dtype
        ('keep-outputs', 'chunked:128t', 'bf16')
        >>> with_framework(TrainingSetup(loop="trainer"), "litgpt", frozenset({"loop"})).loop
        'trainer'
    """
    preset = PRESETS[check_choice("--framework", framework, FRAMEWORKS)]
    values = {k: v for k, v in preset.values.items() if k not in explicit}
    if "loss" in explicit:  # --loss names its own chunking
        values = {k: v for k, v in values.items() if not k.startswith("loss_chunk")}
    if not setup.is_lora:  # adapter and frozen dtypes describe LoRA only
        values.pop("lora_dtype", None)
        values.pop("frozen_dtype", None)
    return replace(setup, framework=preset.name, **values)


def adapter_defaults(setup: TrainingSetup) -> dict[str, Any]:
    """The preset's adapter and frozen-base dtypes, for a full fine-tune the planner switches to
    LoRA (``with_framework`` leaves them out while the method is full).

    Example:
        >>> adapter_defaults(with_framework(TrainingSetup(), "litgpt"))
        {'lora_dtype': 'bf16', 'frozen_dtype': 'auto'}
        >>> adapter_defaults(TrainingSetup())
        {}
    """
    if setup.framework is None or setup.is_lora:
        return {}
    values = PRESETS[setup.framework].values
    return {k: values[k] for k in ("lora_dtype", "frozen_dtype") if k in values}
