"""Plans that use the GPUs: on several GPUs the planner compares DDP,
ZeRO-1/2/3 and FSDP2 (each with the ladder's lean loss and checkpointing) and takes the largest
micro-batch, then the least communication; the exports and the launch line describe that run.
The analytic engine answers (the trace is not the subject)."""

from __future__ import annotations

import json
import os

import pytest

from batchfit.errors import UsageError
from batchfit.export import accelerate_config, deepspeed_config, launch_command
from batchfit.hardware import get_gpu
from batchfit.memory.formulas.deepspeed import ZERO
from batchfit.models import resolve_model
from batchfit.plan import TIME_TOLERANCE, Plan, make_plan
from batchfit.spec import TrainingSetup
from tests._cli import run_cli

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # read when deepspeed is first imported

SHARDED = {"zero1", "zero2", "zero3", "fsdp"}


def _plan(model: str, gpu: str, gpus: int, **kwargs: object) -> Plan:
    return make_plan(
        resolve_model(model),
        get_gpu(gpu),
        TrainingSetup(num_gpus=gpus),
        seq_len=2048,
        global_batch_tokens=1048576,
        engine="analytic",
        **kwargs,  # type: ignore[arg-type]
    )


@pytest.fixture(scope="module")
def llama8b_8x() -> Plan:
    return _plan("llama-3.1-8b", "h100-80gb", 8)


def test_8x_h100_shards_and_runs_a_large_micro_batch(llama8b_8x: Plan):
    """Not ZeRO-1 at micro-batch 1 where the plan's own table says ZeRO-2 fits 7."""
    names = {t.name for t in llama8b_8x.techniques}
    assert names & SHARDED
    assert llama8b_8x.micro_batch_size > 1
    assert llama8b_8x.fits


def test_more_gpus_never_train_slower_per_gpu(llama8b_8x: Plan):
    """4 GPUs must not plan better than 8; ranked by time, 8 GPUs each
    train at least as fast as 4 do, within the time model's tie band."""
    four = _plan("llama-3.1-8b", "h100-80gb", 4)
    per_gpu = [p.speed_json()["tokens_per_s_per_gpu"] or 0.0 for p in (llama8b_8x, four)]
    assert per_gpu[0] >= per_gpu[1] * (1 - TIME_TOLERANCE)


def test_no_exact_option_is_faster(llama8b_8x: Plan):
    """The plan is the fastest exact option (offload aside) by the time model, and with the
    non-checkpointed sharding rungs in the ladder it needs no recompute on 8 x H100."""
    offload = {"offload-optimizer", "offload-optimizer+params", "fsdp-cpu-offload"}
    chosen = llama8b_8x.step_seconds or 0.0
    for alt in llama8b_8x.alternatives:
        if alt.step_seconds and all(
            t.kind == "exact" and t.name not in offload for t in alt.techniques
        ):
            assert alt.step_seconds >= chosen * (1 - TIME_TOLERANCE), alt
    assert not llama8b_8x.setup.grad_ckpt
    # every sharding option was compared, FSDP2 among them, with its communication
    compared = {t.name for a in llama8b_8x.alternatives for t in a.techniques} & SHARDED
    assert compared == SHARDED
    assert all(a.comm_bytes_per_step > 0 for a in llama8b_8x.alternatives)


def test_3b_on_4x_a100_40gb_is_not_micro_batch_1():
    """Not micro-batch 1 with checkpointing + ZeRO-1 where ZeRO-3/FSDP allow more."""
    plan = _plan("llama-3.2-3b", "a100-40gb", 4)
    assert plan.micro_batch_size >= 16
    assert {t.name for t in plan.techniques} & SHARDED


def test_equal_sizes_go_to_the_least_communication():
    """gpt2 fits its whole per-GPU batch everywhere: no checkpointing, and of the options that
    tie on time the simplest, then the one that sends least (DeepSpeed's bf16 ZeRO-1/2:
    2 x Psi x 2 B, DDP under AMP 4 B)."""
    plan = make_plan(
        resolve_model("gpt2"),
        get_gpu("a100-80gb"),
        TrainingSetup(num_gpus=4),
        seq_len=512,
        global_batch=32,
        engine="analytic",
    )
    assert plan.micro_batch_size == 8 and not plan.setup.grad_ckpt
    from batchfit.speed._comm import comm_bytes_per_step

    est = plan.estimate
    mine = comm_bytes_per_step(est.setup, est.total_params, est.trainable_params)
    ties = [
        a
        for a in plan.alternatives
        if a.max_micro_batch >= 8
        and not a.setup.grad_ckpt
        and a.step_seconds
        and a.step_seconds <= (plan.step_seconds or 0) * (1 + TIME_TOLERANCE)
    ]
    # within the time model's tie band: the fewest techniques, then the least sent
    assert all(len(plan.techniques) <= len(a.techniques) for a in ties)
    same = [a for a in ties if len(a.techniques) == len(plan.techniques)]
    assert all(mine <= a.comm_bytes_per_step for a in same)


@pytest.mark.parametrize("gpus", [1, 4, 8])
def test_deepspeed_export_is_the_planned_run(gpus: int, monkeypatch: pytest.MonkeyPatch):
    plan = make_plan(
        resolve_model("llama-3.1-8b"),
        get_gpu("h100-80gb"),
        TrainingSetup(num_gpus=gpus, sharding="zero3" if gpus > 1 else "none"),
        seq_len=4096,
        global_batch_tokens=1048576,
        engine="analytic",
    )
    assert plan.setup.sharding in ("zero1", "zero2", "zero3")  # DeepSpeed plans on 1, 4, 8
    config = deepspeed_config(plan)
    zero = config["zero_optimization"]
    assert zero["stage"] == int(plan.setup.sharding[-1])
    assert config["bf16"]["enabled"] == (plan.setup.precision in ("amp-bf16", "bf16"))
    assert ("offload_optimizer" in zero) == (plan.setup.offload != "none")
    assert ("offload_param" in zero) == (plan.setup.offload == "optimizer+params")
    assert zero["reduce_bucket_size"] == ZERO.reduce_bucket_size
    ds_config = pytest.importorskip("deepspeed.runtime.config")
    monkeypatch.setattr(ds_config.dist, "get_rank", lambda *args, **kwargs: 0)
    from tests.export.test_parsers import _DataParallelOnly

    cfg = ds_config.DeepSpeedConfig(config, mpu=_DataParallelOnly(gpus))
    assert cfg.zero_optimization_stage == zero["stage"]
    assert cfg.bfloat16_config.enabled == config["bf16"]["enabled"]
    assert cfg.train_micro_batch_size_per_gpu == plan.micro_batch_size
    assert cfg.gradient_accumulation_steps == plan.grad_accum_steps
    assert cfg.zero_config.reduce_bucket_size == ZERO.reduce_bucket_size
    assert (
        launch_command(plan) == f"deepspeed --num_gpus {gpus} train.py --deepspeed ds_config.json"
    )
    # the accounting is DeepSpeed's 16-bit one: 2 B weights whole (1-2) or partitioned (3)
    n = plan.estimate.total_params
    per_gpu = 2 * n if plan.setup.sharding != "zero3" else 2 * -(-n // gpus)
    if plan.setup.offload != "optimizer+params":
        assert plan.estimate.components["weights"] == per_gpu


def test_accelerate_fsdp2_config_loads(tmp_path):
    pytest.importorskip("accelerate")
    import yaml
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.utils import FullyShardedDataParallelPlugin

    plan = make_plan(
        resolve_model("gpt2"),
        get_gpu("a100-40gb"),
        TrainingSetup(num_gpus=4, sharding="fsdp"),
        seq_len=1024,
        global_batch=64,
        engine="analytic",
    )
    data = accelerate_config(plan)
    assert data["fsdp_config"]["fsdp_version"] == 2
    path = tmp_path / "accelerate.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    cfg = load_config_from_file(str(path))
    fsdp = {k.removeprefix("fsdp_"): v for k, v in cfg.fsdp_config.items()}
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=fsdp["version"],
        reshard_after_forward=fsdp["reshard_after_forward"],
        cpu_offload=fsdp["offload_params"],
    )
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True
    assert launch_command(plan, "accelerate", "a.yaml") == (
        "accelerate launch --config_file a.yaml train.py"
    )


def test_plan_json_carries_the_launch_line(capsys):
    args = ["plan", "gpt2", "--gpu", "a100-40gb", "--seq-len", "512", "--global-batch", "64"]
    code, out, _ = run_cli([*args, "--num-gpus", "4", "--engine", "analytic", "--json"], capsys)
    assert code == 0
    data = json.loads(out)
    assert data["exports"]["launch"].startswith(("torchrun --nproc-per-node 4", "deepspeed"))
    assert "comm_bytes_per_step" in data["alternatives"][0]


def test_fsdp_on_one_gpu_says_nothing_to_shard():
    plan = make_plan(
        resolve_model("gpt2"),
        get_gpu("a100-40gb"),
        TrainingSetup(sharding="fsdp"),
        seq_len=512,
        global_batch=16,
        engine="analytic",
    )
    assert any("nothing to shard" in w for w in plan.warnings)


def test_a_world_size_that_does_not_divide_names_the_nearest():
    with pytest.raises(UsageError, match=r"num_gpus 4, 5, 10"):
        make_plan(
            resolve_model("gpt2"),
            get_gpu("a100-40gb"),
            TrainingSetup(num_gpus=8),
            seq_len=512,
            global_batch=100,
            engine="analytic",
        )
