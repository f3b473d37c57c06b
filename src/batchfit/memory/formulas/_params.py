"""Parameters, gradients and optimizer state: what is stored, what is trained (before sharding)."""

from __future__ import annotations

from dataclasses import dataclass

from batchfit._units import human_count
from batchfit.memory.types import Line
from batchfit.models import ModelInfo
from batchfit.optimizers import ParamTensor, get_optimizer
from batchfit.spec import TrainingSetup

# QLoRA NF4 with double quantisation: 4 bits + 8-bit absmax per 64-block + fp32 absmax per
# 256 of those (Dettmers et al. 2023, QLoRA, section 3: 0.127 bits of constants per param).
NF4_BYTES_PER_PARAM = 0.5 + 1 / 64 + 4 / (64 * 256)
# Trainable tensors by shape and kind: what an optimizer's state and step depend on.
Shapes = list[ParamTensor]


@dataclass(frozen=True)
class ParamBytes:
    """Bytes per parameter of one precision setup (before sharding)."""

    weight: int
    grad: int
    state_elem: int  # optimizer state element size
    master: int  # separate fp32 master copy (fp16 mixed precision, ZeRO's K=12 includes it)


# peft keeps adapters in fp32 (autocast_adapter_dtype=True) whatever the base dtype;
# --lora-dtype bf16/fp16 (litgpt bf16-true) stores them, their gradients and states in 16-bit.
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def adapter_bytes(lora_dtype: str) -> ParamBytes:
    """Bytes per adapter parameter: weight, gradient and optimizer state in ``lora_dtype``."""
    size = DTYPE_BYTES[lora_dtype]
    return ParamBytes(size, size, size, 0)


def frozen_bytes(setup: TrainingSetup) -> int:
    """Bytes per frozen base parameter under LoRA: ``--frozen-dtype``, or auto: the 16-bit
    dtype a 16-bit precision loads it in (``torch_dtype``), fp32 under fp32."""
    if setup.frozen_dtype != "auto":
        return DTYPE_BYTES[setup.frozen_dtype]
    return 4 if setup.precision == "fp32" else 2


def param_bytes(precision: str) -> ParamBytes:
    """fp32 4/4/4; amp (fp32 weights, autocast) 4/4/4; bf16 2/2/2; fp16 2/2/4 + 4 master.

    Example:
        >>> param_bytes("bf16")
        ParamBytes(weight=2, grad=2, state_elem=2, master=0)
    """
    if precision in ("fp32", "amp-fp16", "amp-bf16"):
        return ParamBytes(4, 4, 4, 0)
    if precision == "bf16":
        return ParamBytes(2, 2, 2, 0)
    return ParamBytes(2, 2, 4, 4)  # fp16 weights + fp32 master + fp32 states (ZeRO paper)


def optimizer_state_bytes(shape: tuple[int, ...], optimizer: str, state_elem: int) -> float:
    """Optimizer state of one parameter tensor (``batchfit.optimizers``' registered spec).

    Example:
        >>> optimizer_state_bytes((4096, 4096), "adamw", 4)
        134217728
        >>> optimizer_state_bytes((4096, 4096), "adafactor", 4)  # factored: rows + cols
        32768
    """
    return get_optimizer(optimizer).state(ParamTensor(shape), state_elem)


@dataclass(frozen=True)
class _Weights:
    """The weights step: stored bytes, what trains, and at what bytes per trained parameter."""

    weights: float
    trainable: int
    shapes: Shapes
    per_param: ParamBytes
    lines: tuple[Line, ...]
    warnings: tuple[str, ...] = ()


@dataclass(frozen=True)
class Params:
    """Weights, gradients and optimizer state of one GPU before sharding, with their lines."""

    weights: float
    grads: float
    states: float
    trainable: int
    trainable_shapes: Shapes
    grad_bytes: int  # per trainable parameter
    state_elem: int
    lora_targets: tuple[str, ...] | None  # None when every parameter trains
    lines: tuple[Line, ...]
    warnings: tuple[str, ...]


def parameters(model: ModelInfo, setup: TrainingSetup) -> Params:
    """Weights stored, gradients and optimizer state of what trains (``setup`` resolved)."""
    targets = (setup.lora_targets or model.default_lora_targets()) if setup.is_lora else None
    w = _lora_weights(model, setup, targets) if targets is not None else _full_weights(model, setup)
    grads = w.trainable * w.per_param.grad
    lines = [
        *w.lines,
        Line("gradients", "gradients", grads, f"{w.trainable:,} trainable x {w.per_param.grad} B"),
    ]
    elem = w.per_param.state_elem
    optimizer = get_optimizer(setup.optimizer)
    states = optimizer.state_bytes(w.shapes, elem)
    per = optimizer.state_text.format(elem=elem)
    lines.append(
        Line(
            "optimizer_state",
            setup.optimizer,
            int(states),
            f"{human_count(w.trainable)} trainable: {per}",
        )
    )
    if w.per_param.master:
        states += w.trainable * w.per_param.master
        lines.append(
            Line(
                "optimizer_state",
                "fp32 master weights",
                w.trainable * w.per_param.master,
                f"{w.trainable:,} x 4 B (fp16 weights train against an fp32 copy)",
            )
        )
    return Params(
        weights=w.weights,
        grads=grads,
        states=states,
        trainable=w.trainable,
        trainable_shapes=w.shapes,
        grad_bytes=w.per_param.grad,
        state_elem=elem,
        lora_targets=targets,
        lines=tuple(lines),
        warnings=w.warnings,
    )


def _full_weights(model: ModelInfo, setup: TrainingSetup) -> _Weights:
    pb, total = param_bytes(setup.precision), model.total_params
    weights = total * pb.weight
    why = f"{total:,} params x {pb.weight} B ({_weight_why(setup.precision)})"
    return _Weights(
        weights=weights,
        trainable=total,
        shapes=[ParamTensor(g.shape, g.count, g.kind) for g in model.params],
        per_param=pb,
        lines=(Line("weights", "weights", weights, why),),
    )


def _lora_weights(model: ModelInfo, setup: TrainingSetup, targets: tuple[str, ...]) -> _Weights:
    warnings = []
    guessed = model.guessed_targets_warning(setup.lora_targets)
    if guessed:
        warnings.append(guessed)
    lora_n = model.lora_params(setup.lora_rank, targets)
    base, lines = _frozen_base(model, setup)
    per = adapter_bytes(setup.lora_dtype)
    lines.append(
        Line(
            "weights",
            "LoRA adapters",
            lora_n * per.weight,
            f"{lora_n:,} params x {per.weight} B ({setup.lora_dtype}), r={setup.lora_rank} on "
            f"{','.join(targets)}",
        )
    )
    return _Weights(
        weights=base + lora_n * per.weight,
        trainable=lora_n,
        shapes=_lora_shapes(model, setup.lora_rank, targets),
        per_param=per,
        lines=tuple(lines),
        warnings=tuple(warnings),
    )


def _frozen_base(model: ModelInfo, setup: TrainingSetup) -> tuple[float, list[Line]]:
    """Bytes of the frozen base under LoRA (16-bit) or QLoRA (NF4), and its lines."""
    total = model.total_params
    if setup.method == "qlora":
        q = model.quantizable_params(head=setup.conventions.quantizes_head)
        # peft's prepare_model_for_kbit_training casts them to fp32 (presets.Preset.kbit_prepare)
        rest_b = 4 if setup.kbit_upcast else frozen_bytes(setup)
        upcast = ", cast to fp32 by prepare_model_for_kbit_training" if setup.kbit_upcast else ""
        return q * NF4_BYTES_PER_PARAM + (total - q) * rest_b, [
            Line(
                "weights",
                "base, NF4 + double quant",
                int(q * NF4_BYTES_PER_PARAM),
                f"{q:,} params x {NF4_BYTES_PER_PARAM:.4f} B (4-bit + constants)",
            ),
            Line(
                "weights",
                f"base, not quantised ({8 * rest_b}-bit)",
                (total - q) * rest_b,
                f"{total - q:,} params x {rest_b} B (embeddings, norms, output head"
                + (", fused MoE experts" if model.fused_expert_params() else "")
                + f"{upcast})",
            ),
        ]
    # A frozen base needs no fp32 master: peft recipes load it in 16-bit unless fp32.
    base_b = frozen_bytes(setup)
    why = f"{total:,} params x {base_b} B (frozen, no master copy)"
    return total * base_b, [Line("weights", "frozen base", total * base_b, why)]


def _lora_shapes(model: ModelInfo, rank: int, targets: tuple[str, ...]) -> Shapes:
    """Shapes of the LoRA A (r x in) and B (out x r) matrices."""
    shapes: Shapes = []
    for group in model.lora_groups(targets):
        d0, d1 = group.shape
        shapes += [ParamTensor((rank, d1), group.count, "lora")]
        shapes += [ParamTensor((d0, rank), group.count, "lora")]
    return shapes


def _weight_why(precision: str) -> str:
    return {
        "fp32": "fp32",
        "amp-bf16": "fp32 master weights; autocast computes in bf16",
        "amp-fp16": "fp32 master weights; autocast computes in fp16",
        "bf16": "pure bf16",
        "fp16": "fp16 weights; the fp32 master copy is optimizer state",
    }[precision]
