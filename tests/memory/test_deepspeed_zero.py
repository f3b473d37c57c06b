"""DeepSpeed ZeRO accounting: batchfit's model states against DeepSpeed's own
estimators, the 16-bit layout under ``bf16.enabled``, and one source for buckets and config.

DeepSpeed's ``estimate_zero2_model_states_mem_needs`` / ``estimate_zero3_model_states_mem_needs``
(what ``estimate_zero{2,3}_model_states_mem_needs_all_cold`` print) count, per GPU:

- ZeRO-2: ``2N`` 16-bit parameters + ``18N/dp`` (16-bit gradient partition 2, fp32 gradient
  partition 4, fp32 master 4, Adam 8); under offload only the ``2N`` parameters.
- ZeRO-3: ``4 x largest_layer`` (the gathered largest module and its full gradient) + ``18N/dp``;
  ``+ 2N/dp`` only under optimizer offload; only ``4 x largest_layer`` under parameter offload.

batchfit follows the buffers of ``stage_1_and_2.py`` / ``stage3.py`` and lands on the same
formulas where the assumptions coincide; the differences, each exact:

- ZeRO-2: none in the model states. batchfit adds the ``reduce_bucket_size`` gradient bucket
  (``contiguous_gradients``, 5e8 elements x 2 B = 0.93 GiB), which the estimators leave out; it
  is not a model state and is left out of this comparison too (it is in the estimate's ``other``).
- ZeRO-3: batchfit adds the prefetched parameters (``stage3_prefetch_bucket_size`` 5e7 x 2 B =
  0.09 GiB; ``partitioned_param_coordinator`` fetches ahead) and the persistent parameters kept
  whole on every GPU (those under ``stage3_param_persistence_threshold``: norms and biases,
  ``mark_persistent_parameters``); the estimators count neither.
- ZeRO-3 without offload: the estimator's ``18N/dp`` has 2 B per parameter for the step's
  gradient copy; ``stage3.py`` ``_prepare_fp32_grad_for_sub_group`` casts the 16-bit gradient
  partition to fp32 (4 B), one ``sub_group_size`` (1e9 elements) at a time. batchfit counts
  ``4 x min(N/dp, 1e9)``: +2 B per parameter while the partition is under one sub-group.
- The estimators assume 16-bit parameters with fp32 master weights and Adam; the setups compared
  here are those (``--precision amp-bf16 --optimizer adamw``).
"""

from __future__ import annotations

import math
import os
from typing import Any

import pytest

from batchfit.export import deepspeed_config
from batchfit.hardware import get_gpu
from batchfit.memory.formulas._params import parameters
from batchfit.memory.formulas.analytic import estimate_analytic
from batchfit.memory.formulas.deepspeed import (
    ZERO,
    deepspeed_states,
    largest_module_params,
    persistent_params,
)
from batchfit.models import ModelInfo, resolve_model
from batchfit.plan import make_plan
from batchfit.spec import TrainingSetup
from batchfit.workload import Workload

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # read when deepspeed is first imported

MODELS = ("gpt2", "llama-3.2-1b", "llama-3.1-8b")
CASES = (  # (stage, offload, GPUs)
    ("zero2", "none", 8),
    ("zero2", "optimizer", 8),
    ("zero3", "none", 8),
    ("zero3", "optimizer", 8),
    ("zero3", "optimizer+params", 8),
)
GIB = 1 << 30


def batchfit_model_states(model: ModelInfo, stage: str, offload: str, gpus: int) -> float:
    """Per-GPU model states: parameters, gradients, master + moments, the step's fp32 gradient
    partition and (ZeRO-3) the gathered parameters; the gradient bucket left out."""
    setup = TrainingSetup(
        precision="amp-bf16", optimizer="adamw", sharding=stage, offload=offload, num_gpus=gpus
    )  # type: ignore[arg-type]
    ds = deepspeed_states(model, setup, parameters(model, setup))
    assert ds.step_temps is not None
    bucket = ZERO.reduce_bucket_size * 2
    return ds.weights + ds.grads + ds.states + ds.step_temps[0] + ds.fixed - bucket


def deepspeed_estimator(model: ModelInfo, stage: str, offload: str, gpus: int) -> float:
    """GPU bytes from DeepSpeed's estimator functions (the numbers its ``_all_cold`` print)."""
    pytest.importorskip("deepspeed")
    if stage == "zero2":
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

        _, gpu = estimate_zero2_model_states_mem_needs(
            model.total_params, gpus, 1, cpu_offload=offload != "none"
        )
        return float(gpu)
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    _, gpu3, _ = estimate_zero3_model_states_mem_needs(
        model.total_params,
        largest_module_params(model),
        gpus,
        1,
        cpu_offload=offload != "none",
        cpu_offload_params=offload == "optimizer+params",
    )
    return float(gpu3)


def why(model: ModelInfo, stage: str, offload: str, gpus: int) -> tuple[float, str]:
    """The expected difference (bytes) and its reason."""
    if stage == "zero2":
        return 0.0, "same buffers (the 0.93 GiB reduce bucket is outside model states)"
    extra = 2 * (ZERO.prefetch_bucket_size + persistent_params(model))
    reason = "prefetch bucket (5e7 x 2 B) and persistent small params, not in the estimator"
    if offload == "none":
        part = math.ceil(model.total_params / gpus)
        extra += 4 * min(part, ZERO.sub_group_size) - 2 * part
        reason += "; the step's fp32 gradient copy of one sub-group (4 B) vs the estimator's 2 B"
    return float(extra), reason


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize(("stage", "offload", "gpus"), CASES)
def test_model_states_match_deepspeeds_estimator(name: str, stage: str, offload: str, gpus: int):
    model = resolve_model(name)
    ours = batchfit_model_states(model, stage, offload, gpus)
    theirs = deepspeed_estimator(model, stage, offload, gpus)
    extra, _ = why(model, stage, offload, gpus)
    # ceil(N / dp) partitions against DeepSpeed's int(18 N / dp): a few bytes apart
    assert ours - theirs == pytest.approx(extra, abs=64)


def table() -> list[dict[str, Any]]:
    """The rows of docs/benchmarks.md's comparison.

    ``PYTHONPATH=src python -m tests.memory.test_deepspeed_zero`` prints them.
    """
    rows = []
    for name in MODELS:
        model = resolve_model(name)
        for stage, offload, gpus in CASES:
            ours = batchfit_model_states(model, stage, offload, gpus)
            theirs = deepspeed_estimator(model, stage, offload, gpus)
            rows.append(
                {
                    "model": name,
                    "stage": stage,
                    "offload": offload,
                    "gpus": gpus,
                    "batchfit": ours / GIB,
                    "deepspeed": theirs / GIB,
                    "why": why(model, stage, offload, gpus)[1],
                }
            )
    return rows


def test_llama8b_bf16_deepspeed_keeps_16bit_weights_and_gradients():
    """ZeRO-2 + offload with bf16 keeps 16-bit weights and gradients, not fp32 ones."""
    model = resolve_model("llama-3.1-8b")
    setup = TrainingSetup(precision="amp-bf16", sharding="zero2", offload="optimizer")
    est = estimate_analytic(
        model, setup, Workload(micro_batch_size=1, seq_len=4096, gpu=get_gpu("h100-80gb"))
    )
    n = model.total_params
    assert est.components["weights"] == 2 * n  # bf16 parameters, whole on the one GPU
    assert est.components["gradients"] == 0  # reduced into the CPU partition
    assert est.components["optimizer_state"] == 0
    assert est.host_bytes == (4 + 8 + 4) * n  # fp32 master, Adam moments, fp32 gradients
    labels = [ln.label for ln in est.lines]
    assert "16-bit parameters" in labels and "ZeRO gradient bucket (contiguous_gradients)" in labels


def test_zero_stages_shard_what_deepspeed_shards():
    model = resolve_model("llama-3.2-1b")
    n, dp = model.total_params, 4

    def states(stage: str) -> dict[str, int]:
        setup = TrainingSetup(precision="amp-bf16", sharding=stage, num_gpus=dp)  # type: ignore[arg-type]
        est = estimate_analytic(
            model, setup, Workload(micro_batch_size=1, seq_len=512, grad_accum_steps=2)
        )
        return est.components

    one, two, three = states("zero1"), states("zero2"), states("zero3")
    part = math.ceil(n / dp)
    assert one["weights"] == two["weights"] == 2 * n  # stage 1/2: 16-bit params whole
    assert three["weights"] == 2 * part
    assert one["gradients"] == 2 * n  # ZeRO-1 partitions only the optimizer
    assert two["gradients"] == three["gradients"] == 2 * part
    assert one["optimizer_state"] == two["optimizer_state"] == three["optimizer_state"]
    assert one["optimizer_state"] == (4 + 8) * part


def test_zero3_lora_says_the_frozen_base_is_partitioned():
    model = resolve_model("llama-3.2-1b")
    setup = TrainingSetup(precision="amp-bf16", method="lora", sharding="zero3", num_gpus=4)
    est = estimate_analytic(model, setup, Workload(micro_batch_size=1, seq_len=512))
    assert any("ZeRO-3 partitions LoRA's frozen base" in w for w in est.warnings)
    base = next(ln for ln in est.lines if ln.label.startswith("frozen base"))
    assert base.num_bytes == pytest.approx(2 * model.total_params / 4, rel=1e-6)


def test_exported_buckets_are_the_counted_ones():
    model = resolve_model("llama-3.2-1b")
    setup = TrainingSetup(precision="amp-bf16", sharding="zero3", num_gpus=4)
    plan = make_plan(
        model,
        get_gpu("a100-40gb"),
        setup,
        seq_len=1024,
        global_batch=64,
        engine="analytic",
        micro_batch_size=2,
    )
    zero = deepspeed_config(plan)["zero_optimization"]
    assert zero["reduce_bucket_size"] == ZERO.reduce_bucket_size
    assert zero["stage3_prefetch_bucket_size"] == ZERO.prefetch_bucket_size
    assert zero["stage3_max_live_parameters"] == ZERO.max_live_parameters
    assert zero["stage3_param_persistence_threshold"] == ZERO.param_persistence_threshold
    bucket = next(ln for ln in plan.estimate.lines if ln.label.startswith("ZeRO gradient bucket"))
    assert bucket.num_bytes == zero["reduce_bucket_size"] * 2  # bf16.enabled: 2 B a gradient
    assert deepspeed_config(plan)["bf16"]["enabled"] is True


def test_pure_bf16_zero_exports_bf16_master_weights(monkeypatch: pytest.MonkeyPatch):
    model = resolve_model("gpt2")
    setup = TrainingSetup(precision="bf16", sharding="zero2", num_gpus=2)
    plan = make_plan(
        model, get_gpu("a100-40gb"), setup, seq_len=512, global_batch=32, engine="analytic"
    )
    config = deepspeed_config(plan)
    assert config["bf16"] == {
        "enabled": True,
        "bf16_master_weights_and_grads": True,
        "bf16_optimizer_states": True,
    }
    ds_config = pytest.importorskip("deepspeed.runtime.config")
    monkeypatch.setattr(ds_config.dist, "get_rank", lambda *args, **kwargs: 0)
    from tests.export.test_parsers import _DataParallelOnly

    cfg = ds_config.DeepSpeedConfig(config, mpu=_DataParallelOnly(2))
    assert cfg.bfloat16_config.bf16_master_weights_and_grads


if __name__ == "__main__":
    print("| model | stage | offload | batchfit GiB | DeepSpeed estimator GiB | difference | why |")
    print("|---|---|---|---:|---:|---:|---|")
    for r in table():
        diff = r["batchfit"] - r["deepspeed"]
        print(
            f"| {r['model']} | {r['stage']} x {r['gpus']} | {r['offload']} | "
            f"{r['batchfit']:.2f} | {r['deepspeed']:.2f} | {diff:+.2f} | {r['why']} |"
        )
