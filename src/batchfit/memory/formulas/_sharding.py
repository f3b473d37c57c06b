"""Sharding and offload under torch (DDP, FSDP2): what one GPU keeps of the model states.

DeepSpeed's ZeRO stages keep another layout (16-bit weights and gradients, an fp32 master
partition in the optimizer): ``deepspeed`` counts them and returns the same ``Sharded`` value.
"""

from __future__ import annotations

from dataclasses import dataclass

from batchfit.memory.formulas._params import Params
from batchfit.memory.types import Line
from batchfit.models import ModelInfo
from batchfit.spec import TrainingSetup


@dataclass(frozen=True)
class Sharded:
    """Model states per GPU after ZeRO / FSDP and offload, and the fixed costs they bring."""

    weights: float
    grads: float
    states: float
    host: float  # CPU RAM the offload takes, per GPU process
    fixed: float  # gathered parameters, DDP's gradient buckets
    shard: int  # how many GPUs divide the sharded states (1: none)
    lines: tuple[Line, ...]
    warnings: tuple[str, ...]
    # the optimizer step's temporaries per GPU and why, where the sharding decides them
    # (DeepSpeed's cast of the gradient partition); None: the optimizer's own (_peak)
    step_temps: tuple[float, str] | None = None
    # the lines describe the model states whole (DeepSpeed's layout), replacing _params' lines
    own_lines: bool = False
    # the gradient buffer lives through the whole step (ZeRO-3's grad_partitions_flat_buffer is
    # allocated once), not only from backward on
    grads_held: bool = False


def shard_and_offload(
    model: ModelInfo, setup: TrainingSetup, params: Params, compute_bytes: int
) -> Sharded:
    """Divide by the GPUs that share the states (FSDP2), move offloaded ones to the host."""
    sharding = setup.sharding
    shard = setup.num_gpus if sharding == "fsdp" else 1
    weights, grads, states = params.weights, params.grads, params.states
    lines: list[Line] = []
    warnings: list[str] = []

    def divided(component: str, value: float, what: str) -> float:
        lines.append(
            Line(component, f"{sharding}: divided by {shard} GPUs", int(value / shard), what)
        )
        return value / shard

    if shard > 1:
        states = divided("optimizer_state", states, f"optimizer state / {shard}")
        grads = divided("gradients", grads, f"gradients / {shard}")
        weights = divided("weights", weights, f"weights / {shard}")
    host = 0.0
    if setup.offload in ("optimizer", "optimizer+params"):
        host += states
        lines.append(_offloaded("optimizer_state", states))
        states = 0
    if setup.offload == "optimizer+params":
        host += weights
        lines.append(_offloaded("weights", weights))
        weights = 0
    fixed, fixed_lines = _fixed_costs(model, setup, shard, grads, compute_bytes)
    return Sharded(
        weights=weights,
        grads=grads,
        states=states,
        host=host,
        fixed=fixed,
        shard=shard,
        lines=(*lines, *fixed_lines),
        warnings=tuple(warnings),
    )


def _offloaded(component: str, value: float) -> Line:
    return Line(
        component, "offloaded to CPU RAM", -int(value), f"{int(value):,} B move to host memory"
    )


def _fixed_costs(
    model: ModelInfo, setup: TrainingSetup, shard: int, grads: float, compute_bytes: int
) -> tuple[float, list[Line]]:
    """Gathered layers (FSDP / parameter offload) and DDP's gradient buckets."""
    fixed = 0.0
    lines = []
    gathers = setup.sharding == "fsdp" and shard > 1
    if gathers or setup.offload == "optimizer+params":
        layer_params = _largest_layer_params(model)
        gathered = 2 * layer_params * compute_bytes
        fixed += gathered
        lines.append(
            Line(
                "other",
                "gathered parameters (current + prefetched layer)",
                int(gathered),
                f"2 x {layer_params:,} params x {compute_bytes} B",
            )
        )
    if setup.sharding == "ddp" and setup.num_gpus > 1:
        fixed += grads
        lines.append(
            Line(
                "other",
                "DDP gradient buckets",
                int(grads),
                "a second copy of the gradients (gradient_as_bucket_view=False)",
            )
        )
    return fixed, lines


def _largest_layer_params(model: ModelInfo) -> int:
    """Parameters of one repeated layer (those whose pattern has a ``*``), or the largest."""
    layer = sum(g.numel for g in model.params if "*" in g.pattern)
    return layer or max((g.total for g in model.params), default=0)
