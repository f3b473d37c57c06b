"""``estimate()``: one entry point over the engines, with input checks shared by all of them."""

from __future__ import annotations

from typing import Literal

from batchfit.errors import UsageError
from batchfit.hardware import GpuSpec
from batchfit.memory.types import MemoryEstimate
from batchfit.models import ModelInfo
from batchfit.spec import TrainingSetup

Engine = Literal["analytic", "trace"]


def check_workload(model: ModelInfo, micro_batch_size: int, seq_len: int) -> list[str]:
    """Validate batch and sequence against the model; return warnings.

    Raises:
        UsageError: non-positive sizes, or a sequence beyond learned position embeddings.
    """
    if not isinstance(micro_batch_size, int) or micro_batch_size < 1:
        raise UsageError(f"--micro-batch must be a positive integer, got {micro_batch_size!r}")
    if not isinstance(seq_len, int) or seq_len < 1:
        raise UsageError(f"--seq-len must be a positive integer, got {seq_len!r}")
    limit = model.arch.max_positions
    if limit is not None and seq_len > limit:
        if model.arch.positional == "learned":
            raise UsageError(
                f"--seq-len {seq_len} is longer than {model.name}'s {limit} learned positions: "
                f"use --seq-len {limit} or less"
            )
        return [
            f"--seq-len {seq_len} exceeds {model.name}'s {limit} trained positions: "
            "rope scaling must extend them"
        ]
    return []


def estimate(
    model: ModelInfo,
    setup: TrainingSetup,
    *,
    micro_batch_size: int,
    seq_len: int,
    device: Literal["cpu", "cuda"] = "cuda",
    gpu: GpuSpec | None = None,
    engine: Engine = "analytic",
    grad_accum_steps: int = 1,
) -> MemoryEstimate:
    """Memory of one training step of ``model`` under ``setup``, per GPU (or on the CPU).

    Example:
        >>> from batchfit.models import resolve_model
        >>> est = estimate(resolve_model("gpt2"), TrainingSetup(), micro_batch_size=4,
        ...                seq_len=256, device="cpu")
        >>> est.engine, est.peak_bytes > est.components["weights"]
        ('analytic', True)
    """
    warnings = check_workload(model, micro_batch_size, seq_len)
    kwargs = {
        "micro_batch_size": micro_batch_size,
        "seq_len": seq_len,
        "device": device,
        "gpu": gpu,
        "grad_accum_steps": grad_accum_steps,
    }
    if engine == "trace":
        from batchfit.memory._hf_trace import estimate_trace

        result = estimate_trace(model, setup, **kwargs)  # type: ignore[arg-type]
    elif engine == "analytic":
        from batchfit.memory.analytic import estimate_analytic

        result = estimate_analytic(model, setup, **kwargs)  # type: ignore[arg-type]
    else:
        raise UsageError(f"--engine {engine!r} is not one of: trace, analytic")
    if warnings:
        from dataclasses import replace

        result = replace(result, warnings=(*warnings, *result.warnings))
    return result
