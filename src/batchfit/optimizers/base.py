"""What batchfit knows about an optimizer, as one value, and the registry that holds them.

An ``OptimizerSpec`` answers every question the engines ask of an optimizer: the state it keeps
for a parameter tensor (which may depend on the tensor's kind: Muon-style optimizers treat
hidden matrices apart from embeddings and the head), what its ``step()`` allocates on top, the
memory it streams per trainable parameter (the step-time model), the real optimizer the dry run
builds, its learning-rate rule and where that rule comes from, its names in the configs batchfit
exports, and the shardings it runs under. ``register`` refuses a second spec under a name.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from batchfit.errors import UsageError

if TYPE_CHECKING:  # torch only for the dry run's factory; the formulas never import it
    import torch

# How an optimizer's step is implemented: torch.optim's fused kernel, its multi-tensor
# ``foreach`` kernels or its per-parameter loop. Optimizers outside torch.optim have one.
Impl = Literal["fused", "foreach", "for-loop"]
TORCH_IMPLS: tuple[Impl, ...] = ("fused", "foreach", "for-loop")
ALL_SHARDINGS = frozenset({"none", "ddp", "zero1", "zero2", "zero3", "fsdp"})
# bitsandbytes' 8-bit optimizers (bnb/optim/optimizer.py, Optimizer8bit.init_state): one byte a
# state element plus an fp32 absmax per 256-element block; tensors under min_8bit_size = 4096
# elements keep fp32 states.
BNB_BLOCK = 256
BNB_MIN_8BIT_SIZE = 4096


@dataclass(frozen=True)
class ParamTensor:
    """Trainable tensors of one shape and kind: ``count`` of them, each ``shape``.

    ``kind`` is the model's name for the group (``embedding``, ``head``, ``norm``,
    ``attention``, ``mlp``, ``experts``, ``other``), ``lora`` for adapters, ``flat`` for a
    sharded optimizer's flat 1-D partition (DeepSpeed ZeRO), where shapes are gone.
    """

    shape: tuple[int, ...]
    count: int = 1
    kind: str = "other"

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class StepContext:
    """What an optimizer's step temporaries depend on besides the tensors themselves."""

    tensors: Sequence[ParamTensor]
    impl: Impl  # resolved: never "auto"
    state_elem: int  # bytes of one state element
    grad_bytes: int  # bytes of one gradient element

    @property
    def total(self) -> int:
        """Trainable elements in all the tensors."""
        return sum(t.numel * t.count for t in self.tensors)

    @property
    def largest(self) -> int:
        """Elements of the largest tensor: a per-parameter loop's temporaries follow it."""
        return max((t.numel for t in self.tensors), default=0)


@dataclass(frozen=True)
class LrRule:
    """How the learning rate follows the global batch, and the source of that rule.

    ``scaling`` is ``linear`` (rate times the batch ratio) or ``sqrt`` (times its square
    root). ``source`` names the paper; None means no published rule covers the optimizer, and
    the plan says the rule is a first guess, giving ``unsourced_why``. ``adam_betas``: Adam's
    β1, β2 and ε are rescaled with the batch as well (Malladi et al. 2022).
    """

    scaling: Literal["linear", "sqrt"]
    source: str | None
    adam_betas: bool = False
    unsourced_why: str = ""


@dataclass(frozen=True)
class ExportNames:
    """The optimizer's names in the configs batchfit writes.

    ``hf_optim``: ``TrainingArguments(optim=...)`` (transformers' ``OptimizerNames``), None
    where transformers has none (the export then leaves ``optim`` out and warns that the
    script must hand the optimizer to the Trainer);
    ``hf_optim_fused``: the same under ``--optimizer-impl fused``, None where there is no fused
    name; ``hf_optim_args``: ``optim_args``; ``weight_decay``: written to both configs so they
    agree; ``deepspeed_type``: DeepSpeed's ``optimizer.type``, None where DeepSpeed has none
    (the Trainer's optimizer is then handed to DeepSpeed).
    """

    hf_optim: str | None
    hf_optim_fused: str | None = None
    hf_optim_args: str | None = None
    weight_decay: float = 0.0
    deepspeed_type: str | None = None


@dataclass(frozen=True)
class Accesses:
    """Elements the update streams through memory per trainable parameter (step-time model).

    ``kernel``: the implementation a GPU runs when it is not a foreach step or loop (the
    fused kernel, bitsandbytes', transformers'); ``unfused``: the multi-tensor (foreach) step
    and the per-parameter loop, which run one kernel per operation, given exactly when
    ``foreach`` is among the spec's ``impls`` (None otherwise); ``cpu``: the per-parameter loop
    the CPU runs. Each count cites the loop it is counted from.
    """

    kernel: int
    unfused: int | None
    cpu: int


StateBytes = Callable[[ParamTensor, int], float]
Temporaries = Callable[[StepContext], tuple[float, str]]
Factory = Callable[["list[torch.nn.Parameter]", Impl], "torch.optim.Optimizer"]


@dataclass(frozen=True)
class OptimizerSpec:
    """One optimizer, everything batchfit needs to know about it (``register`` it once).

    Attributes:
        name: the ``--optimizer`` value.
        summary: one line about it (the ladder's reason when the planner swaps to it).
        state: bytes of optimizer state for ONE tensor of a ``ParamTensor`` group, given the
            bytes of a state element (4 under fp32 and AMP, 2 under pure 16-bit).
        state_text: the breakdown line's formula; ``{elem}`` is replaced by the element size.
        temporaries: bytes ``step()`` allocates beyond the state (the most alive at once), and
            why; the dry run checks them against the real optimizer.
        accesses: memory traffic of the update (``Accesses``).
        build: the real optimizer (or an emulation with the same allocations) the dry run and
            the probe step: ``build(params, impl)``.
        lr: its learning-rate rule (``LrRule``).
        export: its names in the exported configs (``ExportNames``).
        impls: the implementations it has; ``--optimizer-impl auto`` picks foreach on CUDA
            when it has one, else its last.
        shardings: the ``--sharding`` values it runs under.
        lighter: an optimizer with smaller state the planner may swap to (it changes
            training, and the plan says so).
        fused_first: the planner tries the fused implementation before anything else (the
            foreach step holds a copy of every parameter; fused costs no time).
        needs_cuda_package: a package whose CUDA kernels the real optimizer needs; where it
            cannot run, the probe steps the emulation and says so.
    """

    name: str
    summary: str
    state: StateBytes
    state_text: str
    temporaries: Temporaries
    accesses: Accesses
    build: Factory
    lr: LrRule
    export: ExportNames
    impls: tuple[Impl, ...] = ("for-loop",)
    shardings: frozenset[str] = field(default=ALL_SHARDINGS)
    lighter: str | None = None
    fused_first: bool = False
    needs_cuda_package: str | None = None

    def __post_init__(self) -> None:
        if not self.name or self.name != self.name.strip().lower():
            raise ValueError(f"optimizer name {self.name!r}: lower case, no spaces")
        if not self.impls or any(i not in TORCH_IMPLS for i in self.impls):
            raise ValueError(f"{self.name}: impls must be taken from {TORCH_IMPLS}")
        if not self.shardings or not self.shardings <= ALL_SHARDINGS:
            raise ValueError(f"{self.name}: shardings must be taken from {sorted(ALL_SHARDINGS)}")
        if self.fused_first and "fused" not in self.impls:
            raise ValueError(f"{self.name}: fused_first needs a fused implementation")

    def state_bytes(self, tensors: Sequence[ParamTensor], state_elem: int) -> float:
        """Optimizer state of all ``tensors`` at ``state_elem`` bytes an element."""
        return sum(self.state(t, state_elem) * t.count for t in tensors)

    def resolve_impl(self, impl: str, on_cuda: bool) -> Impl:
        """The implementation that runs for ``--optimizer-impl impl``.

        ``auto`` is what PyTorch picks (torch/optim/optimizer.py
        ``_default_to_fused_or_foreach``): foreach for CUDA tensors, the per-parameter loop
        on the CPU; an optimizer outside torch.optim runs its one implementation, whatever
        was asked.
        """
        if impl in self.impls:
            return impl
        if impl == "auto" and on_cuda and "foreach" in self.impls:
            return "foreach"
        return self.impls[-1]

    def make(
        self, params: list[torch.nn.Parameter], impl: str, on_cuda: bool
    ) -> torch.optim.Optimizer:
        """The optimizer a user would create for ``--optimizer-impl impl`` (the dry run's)."""
        return self.build(params, self.resolve_impl(impl, on_cuda))

    def check_sharding(self, sharding: str) -> None:
        """Refuse a ``--sharding`` this optimizer does not run under, naming the ones it does."""
        if sharding not in self.shardings:
            allowed = ", ".join(s for s in sorted(ALL_SHARDINGS) if s in self.shardings)
            raise UsageError(
                f"--optimizer {self.name} does not run under --sharding {sharding}: "
                f"use one of {allowed}"
            )


_REGISTRY: dict[str, OptimizerSpec] = {}


def register(spec: OptimizerSpec) -> OptimizerSpec:
    """Add ``spec`` to the registry (once per name); return it."""
    if spec.name in _REGISTRY:
        raise ValueError(f"optimizer {spec.name!r} is registered twice")
    _REGISTRY[spec.name] = spec
    return spec


def registered() -> tuple[str, ...]:
    """The registered names, in registration order (the CLI lists them so)."""
    return tuple(_REGISTRY)


def make_optimizer(
    name: str, params: list[torch.nn.Parameter], impl: str, emulate_cuda: bool
) -> torch.optim.Optimizer:
    """The optimizer a user would create for ``--optimizer name --optimizer-impl impl``."""
    return get_optimizer(name).make(params, impl, on_cuda=emulate_cuda)


def get_optimizer(name: str) -> OptimizerSpec:
    """The spec registered as ``name``; a UsageError listing the names otherwise.

    Example:
        >>> get_optimizer("adamw").lr.scaling
        'sqrt'
    """
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise UsageError(f"--optimizer {name!r} is not one of: {', '.join(_REGISTRY)}") from None
