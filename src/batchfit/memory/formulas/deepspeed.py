"""DeepSpeed ZeRO 1/2/3: what one GPU holds of the model states, following DeepSpeed's buffers.

``--sharding zero1|zero2|zero3`` means DeepSpeed (``fsdp`` is FSDP2, ``ddp`` torch DDP). With
``bf16.enabled`` / ``fp16.enabled`` DeepSpeed casts the module to 16-bit and runs it without
autocast; its ZeRO optimizer keeps the 16-bit parameters and gradients on the GPU and a flat fp32
master partition with the optimizer's moments beside it (on the GPU, or in CPU RAM under
``offload_optimizer``). Every coefficient below cites the DeepSpeed 0.19 code it follows
(``deepspeed/runtime/zero/stage_1_and_2.py`` for stages 1-2, ``stage3.py`` and
``partition_parameters.py`` for stage 3, ``config.py`` for the defaults).

The bucket sizes are ``ZERO``'s: ``zero_optimization`` writes the same numbers into the exported
config, so the accounting and the config describe one run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from batchfit._units import human_count
from batchfit.memory.formulas._params import Params, _frozen_base, optimizer_state_bytes
from batchfit.memory.formulas._sharding import Sharded
from batchfit.memory.types import Line
from batchfit.models import ModelInfo
from batchfit.spec import TrainingSetup, is_deepspeed, zero_stage


@dataclass(frozen=True)
class ZeroSettings:
    """ZeRO buffer sizes (elements), as ``runtime/zero/config.py`` defaults them."""

    reduce_bucket_size: int = 500_000_000  # DeepSpeedZeroConfig.reduce_bucket_size = 5e8
    allgather_bucket_size: int = 500_000_000  # DeepSpeedZeroConfig.allgather_bucket_size = 5e8
    contiguous_gradients: bool = True  # DeepSpeedZeroConfig.contiguous_gradients = True
    prefetch_bucket_size: int = 50_000_000  # stage3_prefetch_bucket_size = 5e7
    max_live_parameters: int = 1_000_000_000  # stage3_max_live_parameters = 1e9
    param_persistence_threshold: int = 100_000  # stage3_param_persistence_threshold = 1e5
    sub_group_size: int = 1_000_000_000  # DeepSpeedZeroConfig.sub_group_size = 1e9

    @staticmethod
    def overlap_comm(stage: int) -> bool:
        """config.py ``overlap_comm_valid``: None becomes True for stage 3 only."""
        return stage == 3


ZERO = ZeroSettings()


def model_bytes(precision: str) -> int:
    """Bytes of a parameter as DeepSpeed holds the module: engine.py ``get_data_types`` casts it
    to fp16 (``fp16.enabled``) or bf16 (``bf16.enabled``), else fp32."""
    return 4 if precision == "fp32" else 2


def compute_precision(precision: str) -> str:
    """What the module computes in under DeepSpeed: the 16-bit module runs without autocast."""
    if precision == "fp32":
        return "fp32"
    return "bf16" if precision in ("amp-bf16", "bf16") else "fp16"


def _master_bytes(precision: str) -> int:
    """The master partition's element: fp32, or bf16 under pure bf16 (precision_config.py
    ``bf16_master_weights_and_grads``, which the export sets for ``--precision bf16``)."""
    return 2 if precision == "bf16" else 4


def precision_config(setup: TrainingSetup) -> dict[str, Any]:
    """The ``bf16`` / ``fp16`` sections of a DeepSpeed config for ``setup``'s precision."""
    bf16: dict[str, Any] = {"enabled": setup.precision in ("amp-bf16", "bf16")}
    if setup.precision == "bf16" and is_deepspeed(setup):
        # pure bf16: master weights, gradients and optimizer states in bf16 (ZeRO only)
        bf16 |= {"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
    fp16 = {"enabled": setup.precision in ("amp-fp16", "fp16"), "loss_scale": 0}
    return {"bf16": bf16, "fp16": fp16}


def zero_optimization(setup: TrainingSetup) -> dict[str, Any]:
    """The ``zero_optimization`` section: the stage, offload and the buffers ``ZERO`` counts."""
    stage = zero_stage(setup)
    zero: dict[str, Any] = {"stage": stage}
    if stage:
        zero |= {
            "overlap_comm": ZERO.overlap_comm(stage),
            "contiguous_gradients": ZERO.contiguous_gradients,
            "reduce_bucket_size": ZERO.reduce_bucket_size,
        }
    if stage in (1, 2):
        zero["allgather_bucket_size"] = ZERO.allgather_bucket_size
    if stage == 3:
        zero |= {
            "stage3_prefetch_bucket_size": ZERO.prefetch_bucket_size,
            "stage3_max_live_parameters": ZERO.max_live_parameters,
            "stage3_param_persistence_threshold": ZERO.param_persistence_threshold,
            "sub_group_size": ZERO.sub_group_size,
        }
    if setup.offload in ("optimizer", "optimizer+params"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if setup.offload == "optimizer+params":
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return zero


def largest_module_params(model: ModelInfo) -> int:
    """Parameters of the largest single module (the embedding or head of an LLM): what ZeRO-3
    gathers at once, as ``stage3.py`` ``model_to_params`` measures it for its estimator."""
    per_module: dict[str, int] = {}
    for g in model.params:
        owner = g.pattern.rsplit(".", 1)[0]
        per_module[owner] = per_module.get(owner, 0) + g.numel
    return max(per_module.values(), default=0)


def persistent_params(model: ModelInfo) -> int:
    """Parameters ZeRO-3 never partitions: each one under stage3_param_persistence_threshold
    (parameter_offload.py ``mark_persistent_parameters``: norms, biases)."""
    return sum(g.total for g in model.params if g.numel < ZERO.param_persistence_threshold)


def frozen_base_warning(setup: TrainingSetup) -> str | None:
    """What ZeRO-3 does with LoRA's frozen base (partition_parameters.py / parameter_offload.py
    ``_convert_to_zero_parameters`` converts every module parameter, trainable or not)."""
    if setup.sharding != "zero3" or not setup.is_lora:
        return None
    return (
        "ZeRO-3 partitions LoRA's frozen base too (DeepSpeed converts every parameter, trainable "
        "or not): it is all-gathered layer by layer in forward and backward, so the adapters "
        "pay ZeRO-3's communication; zero2 keeps the base whole on each GPU"
    )


def deepspeed_states(model: ModelInfo, setup: TrainingSetup, params: Params) -> Sharded:
    """Per-GPU model states of a DeepSpeed ZeRO run (``setup`` resolved), with their lines.

    Example:
        >>> from batchfit.models import resolve_model
        >>> from batchfit.memory.formulas._params import parameters
        >>> m = resolve_model("gpt2")
        >>> s = TrainingSetup(precision="amp-bf16", sharding="zero2", num_gpus=4)
        >>> ds = deepspeed_states(m, s, parameters(m, s))
        >>> ds.weights == 2 * m.total_params  # 16-bit parameters, whole on every GPU
        True
    """
    stage, dp = zero_stage(setup), setup.num_gpus
    n = params.trainable
    part = math.ceil(n / dp)
    w16 = model_bytes(setup.precision)
    master = _master_bytes(setup.precision)
    offload_opt = setup.offload in ("optimizer", "optimizer+params")
    offload_par = setup.offload == "optimizer+params"
    where = "CPU RAM (offload_optimizer)" if offload_opt else f"GPU, 1/{dp} each"
    lines: list[Line] = []
    warnings = [w for w in (frozen_base_warning(setup),) if w]
    if stage < 3 and dp == 1 and not offload_opt:
        warnings.append(f"--sharding {setup.sharding} on one GPU divides nothing")

    weights, weight_lines = _parameters_16bit(model, setup, stage, n, dp, w16)
    lines += weight_lines
    grads, grad_line = _gradients_16bit(stage, n, dp, w16, offload_opt)
    lines.append(grad_line)
    master_b, states_b, opt_lines = _master_partition(setup, stage, n, dp, w16, where)
    lines += opt_lines

    # At the step the reduced 16-bit gradient partition is cast to the master dtype
    # (stage_1_and_2.py: flat_grad_partition.to(single_partition_of_fp32_groups[i].dtype));
    # .to() of the same dtype is no copy. Under offload it lives in CPU RAM.
    # Stage 3 steps one sub-group at a time (stage3.py _prepare_fp32_grad_for_sub_group).
    step_elems = min(part, ZERO.sub_group_size) if stage == 3 else part
    step_grads = float(step_elems * master) if master != w16 else 0.0
    host = 0.0
    if offload_opt:
        host = master_b + states_b + step_grads
        step_grads = 0.0
    if offload_par:
        host += part * w16
    fixed, fixed_lines = _buffers(model, setup, stage, w16)
    return Sharded(
        weights=weights,
        grads=grads,
        states=0.0 if offload_opt else master_b + states_b,
        host=host,
        fixed=fixed,
        shard=dp,
        lines=(*lines, *fixed_lines),
        warnings=tuple(warnings),
        step_temps=(
            step_grads,
            f"{8 * master}-bit copy of the gradient partition for the step "
            f"({step_elems:,} x {master} B"
            + (", one sub_group_size at a time)" if stage == 3 else ")"),
        ),
        own_lines=True,
        grads_held=stage == 3,  # stage3.py allocates grad_partitions_flat_buffer at init
    )


def _parameters_16bit(
    model: ModelInfo, setup: TrainingSetup, stage: int, n: int, dp: int, w16: int
) -> tuple[float, list[Line]]:
    """The 16-bit parameters one GPU holds (and LoRA's frozen base), with their lines."""
    part = math.ceil(n / dp)
    offload_par = setup.offload == "optimizer+params"
    lines: list[Line] = []
    # 16-bit parameters: stage 1/2 flatten them whole on every GPU (stage_1_and_2.py
    # bit16_groups_flat); stage 3 keeps a 1/dp partition (stage3.py fp16_partitioned_groups_flat)
    # on the GPU, or in CPU RAM under offload_param.
    if stage < 3:
        weights = float(n * w16)
        why = f"{n:,} x {w16} B, whole on every GPU (bit16_groups_flat)"
    else:
        weights = 0.0 if offload_par else float(part * w16)
        why = f"{n:,} / {dp} x {w16} B (fp16_partitioned_groups_flat)" + (
            ", in CPU RAM (offload_param)" if offload_par else ""
        )
    label = "16-bit parameters" if w16 == 2 else "fp32 parameters (no bf16/fp16 enabled)"
    lines.append(
        Line("weights", f"{label}{' (adapters)' if setup.is_lora else ''}", int(weights), why)
    )
    if setup.is_lora:
        base, base_lines = _frozen_base(model, setup)
        if stage == 3:
            # partition_parameters.py: frozen parameters are partitioned like trainable ones
            base = 0.0 if offload_par else base / dp
            base_lines = [
                Line(ln.component, f"{ln.label}, partitioned", int(base), f"{ln.formula} / {dp}")
                for ln in base_lines[:1]
            ]
        weights += base
        lines += base_lines
    return weights, lines


def _gradients_16bit(
    stage: int, n: int, dp: int, w16: int, offload_opt: bool
) -> tuple[float, Line]:
    """The 16-bit gradients one GPU holds, with their line."""
    part = math.ceil(n / dp)
    # 16-bit gradients: stage 1 holds them whole until the reduce at the accumulation boundary
    # (stage_1_and_2.py reduce_gradients); stage 2 copies each into its 1/dp partition
    # (grads_in_partition); stage 3 into grad_partitions_flat_buffer (1/dp, on the CPU under
    # offload_optimizer). Under offload, stage 2 sends them to the CPU partition instead
    # (async_accumulate_grad_in_cpu_via_gpu).
    if stage == 1:
        grads = float(n * w16)
        grad_why = f"{n:,} x {w16} B, whole until the reduce at the accumulation boundary"
    elif offload_opt:
        grads = 0.0
        grad_why = "reduced straight into the CPU partition (offload_optimizer)"
    else:
        grads = float(part * w16)
        buffer = "grads_in_partition" if stage == 2 else "grad_partitions_flat_buffer"
        grad_why = f"{n:,} / {dp} x {w16} B ({buffer})"
    return grads, Line("gradients", f"{8 * w16}-bit gradients", int(grads), grad_why)


def _master_partition(
    setup: TrainingSetup, stage: int, n: int, dp: int, w16: int, where: str
) -> tuple[float, float, list[Line]]:
    """The optimizer's flat partition: the master copy's bytes and its states' bytes (both
    counted even when offloaded), with their lines."""
    part = math.ceil(n / dp)
    master = _master_bytes(setup.precision)
    state_elem = master  # bf16_optimizer_states: the moments in bf16 with the bf16 master
    offload_opt = setup.offload in ("optimizer", "optimizer+params")
    lines: list[Line] = []
    # The optimizer's partition: fp32 master (stage_1_and_2.py single_partition_of_fp32_groups,
    # stage3.py fp32_partitioned_groups_flat: clones, even of fp32 parameters) and the moments
    # the optimizer keeps on that flat 1-D partition.
    master_b = float(part * master)
    # stage3.py _create_fp32_partitions: a master of the partition's own dtype on the same
    # device is the 16-bit partition itself, no clone (stage 1/2 always clone)
    shares = stage == 3 and master == w16 and not offload_opt
    if shares:
        master_b = 0.0
    states_b = float(optimizer_state_bytes((part,), setup.optimizer, state_elem))
    lines.append(
        Line(
            "optimizer_state",
            f"{8 * master}-bit master partition",
            0 if offload_opt else int(master_b),
            f"{n:,} / {dp} x {master} B, in {where}"
            if not shares
            else "the bf16 parameter partition itself (no clone)",
        )
    )
    lines.append(
        Line(
            "optimizer_state",
            f"{setup.optimizer} on the master partition",
            0 if offload_opt else int(states_b),
            f"{human_count(part)} elements (one flat 1-D partition), {state_elem} B states, "
            f"in {where}",
        )
    )
    return master_b, states_b, lines


def _buffers(
    model: ModelInfo, setup: TrainingSetup, stage: int, w16: int
) -> tuple[float, list[Line]]:
    """ZeRO's communication buffers and, for stage 3, the gathered parameters."""
    lines = []
    fixed = 0.0
    if ZERO.contiguous_gradients:
        # stage_1_and_2.py setup_buckets: one reduce_bucket_size buffer, a second with
        # overlap_comm; stage3.py: one ipg bucket buffer of reduce_bucket_size
        count = 2 if stage < 3 and ZERO.overlap_comm(stage) else 1
        bucket = ZERO.reduce_bucket_size  # allocated whole, however small the model
        bucket_b = float(count * bucket * w16)
        fixed += bucket_b
        lines.append(
            Line(
                "other",
                "ZeRO gradient bucket (contiguous_gradients)",
                int(bucket_b),
                f"{count} x reduce_bucket_size {bucket:,} x {w16} B",
            )
        )
    if stage == 3:
        largest = largest_module_params(model)
        # stage3 fetches a module's parameters when it runs and prefetches the next ones up
        # to stage3_prefetch_bucket_size, never past stage3_max_live_parameters
        # (partitioned_param_coordinator.py fetch_sub_module)
        ahead = min(ZERO.prefetch_bucket_size, max(ZERO.max_live_parameters - largest, 0))
        live = float((largest + ahead) * w16)
        persistent = float(persistent_params(model) * w16)
        # a module's full 16-bit gradient exists before it is reduce-scattered (the
        # estimator's second 2 B of largest_layer_memory = 4 x largest_layer_params)
        module_grad = 0.0 if setup.is_lora else float(largest * w16)  # frozen: no gradient
        fixed += live + persistent + module_grad
        lines += [
            Line(
                "other",
                "gathered parameters (largest module + prefetch)",
                int(live),
                f"({largest:,} + {ahead:,} prefetched) x {w16} B, <= stage3_max_live_parameters",
            ),
            Line(
                "other",
                "one module's full gradient before reduce-scatter",
                int(module_grad),
                f"{largest:,} x {w16} B",
            ),
            Line(
                "other",
                "persistent parameters (never partitioned)",
                int(persistent),
                "each one under stage3_param_persistence_threshold "
                f"{ZERO.param_persistence_threshold:,}",
            ),
        ]
    return fixed, lines
