"""Which weights peft's LoRA wraps (``ModelInfo.lora_groups``): the modules a run names,
peft's ``all-linear`` shorthand, and one line naming the model's modules where a target
matches none."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar

from batchfit.errors import UsageError


class _Weight(Protocol):
    """What is read of a ``ParamGroup`` here."""

    @property
    def pattern(self) -> str: ...
    @property
    def module(self) -> str: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def leaf(self) -> str: ...
    @property
    def kind(self) -> str: ...
    @property
    def is_matrix_weight(self) -> bool: ...


ParamGroup = TypeVar("ParamGroup", bound=_Weight)

# the module classes peft's LoRA layers replace (``LoraModel._create_new_module``)
LORA_MODULES = frozenset({"Linear", "Conv1D", "Embedding", "Linear8bitLt", "Linear4bit"})


def linear_weights(params: Sequence[ParamGroup]) -> list[ParamGroup]:
    """The weights of the linear modules (``nn.Linear``, GPT-2's ``Conv1D``) but the output
    head's: what peft's ``all-linear`` wraps."""
    return [
        g
        for g in params
        if g.pattern.endswith("weight")
        and g.module in ("Linear", "Conv1D")
        and len(g.shape) == 2
        and g.kind != "head"
    ]


def all_linear(params: Sequence[_Weight]) -> tuple[str, ...]:
    """peft's ``all-linear``: every linear module's name but the output head's."""
    return tuple(sorted({g.leaf for g in linear_weights(params)}))


def wrapped(
    name: str, params: Sequence[ParamGroup], wanted: tuple[str, ...], defaults: bool
) -> list[ParamGroup]:
    """The 2-D weights of LoRA-capable modules whose path is a target or ends with
    ``.target`` (peft's ``check_target_module_exists``).

    Raises:
        UsageError: a target matches no module (``defaults``: LoRA's default targets).
    """
    groups = []
    matched = set()
    for group in params:
        if not group.pattern.endswith("weight") or group.module not in LORA_MODULES:
            continue
        if len(group.shape) != 2:
            continue
        path = group.pattern.rsplit(".", 1)[0]
        for target in wanted:
            if path == target or path.endswith("." + target):
                groups.append(group)
                matched.add(target)
                break
    missing = [t for t in wanted if t not in matched]
    if not missing:
        return groups
    leaves = sorted({g.leaf for g in params if g.is_matrix_weight} - {"*", ""})
    modules = (
        f"its linear modules are: {', '.join(leaves)}"
        if leaves
        else "it has no linear module LoRA could wrap"
    )
    if defaults:
        raise UsageError(
            f"{name} has no module matching LoRA's default targets "
            f"({','.join(missing)}): name them with --lora-targets; {modules}"
        )
    verb = "matches" if len(missing) == 1 else "match"
    raise UsageError(
        f"--lora-targets {','.join(missing)} {verb} no linear module of {name}; {modules}"
    )
