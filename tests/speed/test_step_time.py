"""The step-time model (``batchfit.speed``) against the H100 sweeps it
was calibrated on, and its contract in estimate/plan JSON."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from batchfit.hardware import get_gpu
from batchfit.models import resolve_model
from batchfit.spec import TrainingSetup
from batchfit.speed import step_time
from tests._cli import run_cli

MEASURED = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "gpu_validate_h100.json"
H100 = get_gpu("h100-80gb")


def _sweep_points() -> list[tuple[str, int, str, int, bool, float]]:
    raw = json.loads(MEASURED.read_text())
    points = []
    for key, res in raw["results"].items():
        if key.startswith("sweep"):
            for p in res["points"]:
                median = statistics.median(p["step_seconds"])
                points.append(
                    (res["model"], res["seq"], res["precision"], p["micro"], p["grad_ckpt"], median)
                )
    return points


@pytest.mark.parametrize(
    ("model", "seq", "precision", "micro", "ckpt", "measured"), _sweep_points()
)
def test_calibration_sweeps_within_20_percent(model, seq, precision, micro, ckpt, measured):
    setup = TrainingSetup(precision=precision, grad_ckpt=ckpt).resolved(
        device="cuda", bf16_supported=True
    )
    predicted = step_time(resolve_model(model), setup, H100, micro_batch_size=micro, seq_len=seq)
    assert predicted is not None
    assert predicted.step_seconds() == pytest.approx(measured, rel=0.2)


def test_the_model_moves_the_right_way():
    info = resolve_model("llama-3.2-1b")

    def seconds(**fields: object) -> float:
        setup = TrainingSetup(precision="amp-bf16", **fields)  # type: ignore[arg-type]
        t = step_time(info, setup, H100, micro_batch_size=4, seq_len=2048)
        assert t is not None
        return t.step_seconds()

    assert seconds(grad_ckpt=True) > seconds()  # recompute
    assert seconds(method="lora") < seconds()  # no weight gradients, tiny optimizer step
    t = step_time(info, TrainingSetup(precision="amp-bf16"), H100, micro_batch_size=4, seq_len=2048)
    assert t is not None and t.step_seconds(8) == pytest.approx(
        8 * t.micro_seconds + t.optimizer_seconds
    )
    slow = step_time(
        info, TrainingSetup(precision="amp-bf16"), get_gpu("a10"), micro_batch_size=4, seq_len=2048
    )
    assert slow is not None and slow.step_seconds() > t.step_seconds()


def test_no_prediction_where_the_model_does_not_apply():
    vit = resolve_model("vit-base-patch16-224")
    assert (
        step_time(vit, TrainingSetup(precision="amp-bf16"), H100, micro_batch_size=8, seq_len=224)
        is None
    )


def _setup(**kw: object) -> TrainingSetup:
    return TrainingSetup(precision="amp-bf16", **kw)  # type: ignore[arg-type]


def test_several_gpus_add_the_communication_compute_does_not_hide():
    llama = resolve_model("llama-3.1-8b")
    fsdp = _setup(num_gpus=8, sharding="fsdp")
    one = step_time(llama, _setup(), H100, micro_batch_size=1, seq_len=512)
    node = step_time(llama, fsdp, H100, micro_batch_size=1, seq_len=512)
    assert one is not None and node is not None
    # FSDP gathers 2 x 16 GB of bf16 parameters a micro-step: over NVLink (450 GB/s) about
    # 0.08 s, hidden by the 0.15 s micro-step
    assert node.comm_micro_seconds == 0
    # each rank updates an eighth of the parameters
    assert node.optimizer_seconds - node.comm_step_seconds < one.optimizer_seconds / 4
    # over PCIe (31.5 GB/s, L40S) or the network between nodes (50 GB/s a GPU) it shows
    l40s = step_time(llama, fsdp, get_gpu("l40s"), micro_batch_size=1, seq_len=512)
    nodes = step_time(
        llama, _setup(num_gpus=16, sharding="fsdp"), H100, micro_batch_size=1, seq_len=512
    )
    assert l40s is not None and l40s.comm_micro_seconds > 0.5
    assert nodes is not None and nodes.comm_micro_seconds > 0.5
    assert nodes.step_seconds() > node.step_seconds()


def test_zero_stages_and_ddp_communicate_as_the_zero_paper_counts():
    gpt2 = resolve_model("gpt2")
    ddp = step_time(gpt2, _setup(num_gpus=8), H100, micro_batch_size=1, seq_len=128)
    zero1 = step_time(
        gpt2, _setup(num_gpus=8, sharding="zero1"), H100, micro_batch_size=1, seq_len=128
    )
    assert ddp is not None and zero1 is not None
    # ZeRO-1 gathers the updated parameters after the step, which nothing hides
    assert zero1.comm_step_seconds > 0


def test_offload_moves_the_update_to_the_cpu():
    llama = resolve_model("llama-3.1-8b")
    on_gpu = step_time(
        llama, _setup(num_gpus=8, sharding="zero3"), H100, micro_batch_size=4, seq_len=2048
    )
    offloaded = step_time(
        llama,
        _setup(num_gpus=8, sharding="zero3", offload="optimizer"),
        H100,
        micro_batch_size=4,
        seq_len=2048,
    )
    assert on_gpu is not None and offloaded is not None
    assert offloaded.offload_seconds > 0.5  # 1e9 parameters at 1e9 a second, and the copies
    assert offloaded.step_seconds() > on_gpu.step_seconds()


def _json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, object]:
    code, out, err = run_cli([*args, "--engine", "analytic", "--json"], capsys)
    assert code == 0, err
    data: dict[str, object] = json.loads(out)
    return data


def test_estimate_and_plan_json_carry_the_time(capsys):
    workload = ("gpt2", "-s", "512")
    est = _json(capsys, "estimate", *workload, "-b", "8", "--gpu", "a100-40gb")
    assert est["step_seconds"] > 0 and est["tokens_per_s_per_gpu"] > 0 and 0 < est["mfu"] < 1
    plan = _json(capsys, "plan", *workload, "--gpu", "a100-40gb", "--global-batch", "64")
    assert plan["step_seconds"] > est["step_seconds"]  # accumulation: several micro-steps
    cpu = _json(capsys, "estimate", *workload, "-b", "8", "--device", "cpu")
    # no GPU: timed on this machine's CPU profile where one was measured
    from batchfit.hardware import host_cpu

    assert (cpu["step_seconds"] is None) == (host_cpu() is None)


def test_the_optimizer_step_streams_what_its_implementation_reads():
    # one GPU, pure bf16, full fine-tune: the update is memory traffic over the parameters
    llama = resolve_model("llama-3.2-3b")
    l40s = get_gpu("l40s")

    def update_seconds(**fields: object) -> float:
        setup = TrainingSetup(precision="bf16", **fields)  # type: ignore[arg-type]
        t = step_time(llama, setup, l40s, micro_batch_size=4, seq_len=210)
        assert t is not None
        return t.optimizer_seconds

    from batchfit.speed import BANDWIDTH_EFFICIENCY, optimizer_accesses

    # torch's default on CUDA is foreach: eight kernels, 20 element accesses a parameter
    # (torch/optim/adam.py _multi_tensor_adam), against the fused kernel's 7
    foreach = update_seconds()
    bandwidth = l40s.bandwidth_gb_s * 1e9 * BANDWIDTH_EFFICIENCY
    assert foreach == pytest.approx(20 * 2 * llama.total_params / bandwidth)
    assert update_seconds(optimizer_impl="foreach") == foreach
    assert update_seconds(optimizer_impl="for-loop") == foreach  # the same operations
    assert update_seconds(optimizer_impl="fused") == pytest.approx(foreach * 7 / 20)
    # HF Trainer clips at max_grad_norm 1.0 every step: 3 more accesses of each gradient
    hf = TrainingSetup(precision="bf16", framework="hf-trainer", optimizer_impl="fused")
    assert optimizer_accesses(hf) == 7 + 3
    # DeepSpeed's engine runs its fused Adam whatever --optimizer-impl says
    ds = TrainingSetup(precision="bf16", num_gpus=8, sharding="zero2")
    assert optimizer_accesses(ds) == 7
    # other optimizers: SGD with momentum's foreach buf.mul_, add_, param add_ = 8
    assert optimizer_accesses(TrainingSetup(optimizer="sgd-momentum")) == 8
    assert optimizer_accesses(TrainingSetup(optimizer="adamw-8bit")) == 4
