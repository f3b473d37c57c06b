"""Advice on a setup for its GPU: kernels it cannot run, precisions it should not use."""

from __future__ import annotations

from batchfit.hardware import GpuSpec
from batchfit.memory.device.totals import Device
from batchfit.spec import TrainingSetup


def advice(setup: TrainingSetup, device: Device, gpu: GpuSpec | None) -> list[str]:
    """Warnings about ``setup`` (resolved) on ``gpu``; none on the CPU or for an unknown GPU."""
    warnings = []
    if setup.attention == "flash" and device == "cuda":
        sm = gpu.sm if gpu else (8, 0)
        if sm is None or sm < (8, 0) or setup.precision == "fp32":
            warnings.append(
                "flash attention needs an sm80+ GPU and 16-bit inputs: PyTorch runs the "
                "memory-efficient kernel here, which keeps the same output + log-sum-exp"
            )
    if setup.precision in ("fp16", "amp-fp16") and gpu is not None and gpu.bf16:
        warnings.append(f"{gpu.name} supports bf16: amp-bf16 needs no GradScaler")
    if setup.precision in ("bf16", "amp-bf16") and gpu is not None and not gpu.bf16:
        warnings.append(f"{gpu.name} has no native bf16: use amp-fp16 with a GradScaler")
    if setup.sharding == "fsdp" and setup.num_gpus == 1:
        warnings.append(
            "--sharding fsdp with --num-gpus 1: nothing to shard (one rank holds every shard); "
            "add --num-gpus N"
        )
    elif setup.num_gpus == 1 and setup.offload == "none" and setup.sharding != "none":
        # ZeRO on one GPU earns its keep only by offloading (ZeRO-Offload)
        what = "nothing to synchronise" if setup.sharding == "ddp" else "nothing to shard"
        warnings.append(
            f"--sharding {setup.sharding} with --num-gpus 1: {what} (one rank holds it all); "
            "add --num-gpus N, or --offload with ZeRO"
        )
    return warnings
