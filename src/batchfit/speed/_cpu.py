"""Step time of a training step on the CPU: the same FLOPs as on a GPU, over the
catalog CPU profile's measured matmul rate and memory bandwidth (``catalog/cpus.json``,
``scripts/measure_cpu_profile.py``).

Per micro-step::

    seconds = FLOPs / (peak x util) x (1 + half_rows / tokens)
              + elementwise passes x activation bytes / bandwidth

and once per optimizer step the update, PyTorch's per-parameter loop streaming each tensor
through memory (its registered ``Accesses.cpu``, counted from the loop's source, not fitted).

The three coefficients below were fitted (least squares on relative error) on the calibration
half of ``benchmarks/cpu_step_time.py`` only: fp32 AdamW steps of gen-gpt2-small,
gen-llama-gqa-small, gen-qwen2-tied-small (seq 128) and the probe's GPT-2-like model (seq 256)
at micro-batch 1-16, in CPU time on one thread of a 2-core Xeon (AVX-512, AMX), against its
profile ``intel-xeon-1t``; the other four models check them (``docs/benchmarks.md``: median
|error| 8% calibration, 14% evaluation). Only fp32 steps in one process were measured: other
precisions (autocast's casts, AMX bf16 kernels), CPU ranks and ``--compile`` are not
predicted, nor is a multi-thread step checked (the machine's cores were shared).
"""

from __future__ import annotations

from batchfit.hardware import CpuSpec
from batchfit.models import ModelInfo
from batchfit.optimizers import get_optimizer
from batchfit.spec import TrainingSetup
from batchfit.speed._step import StepTime, model_trainable, step_flops

# Fitted on the calibration half of benchmarks/cpu_step_time.py (see the module docstring;
# 20 steps, median |error| 8%, worst -16%). A per-layer launch term, as on a GPU, came out
# negative there (on the CPU the kernels are the time, not their launches) and is left out.
UTIL = 0.636  # of the profile's 2048^3 matmul rate that a step's matmuls reach at many rows
HALF_ROWS = 64.0  # tokens in a micro-step at which the matmuls run at half that rate
ELEMENTWISE_PASSES = 30.0  # 4-byte passes over each layer's width and the logits, per token
# the fitted terms, in the order benchmarks/cpu_step_time.py fits them
FEATURES = ("compute_at_peak_seconds", "compute_per_row_seconds", "elementwise_seconds")


def cpu_terms(
    model: ModelInfo, setup: TrainingSetup, cpu: CpuSpec, *, micro_batch_size: int, seq_len: int
) -> dict[str, float]:
    """The terms the coefficients multiply (``FEATURES``) and the unfitted optimizer time.

    Example:
        >>> from batchfit.hardware import get_cpu
        >>> from batchfit.models import resolve_model
        >>> t = cpu_terms(resolve_model("gpt2"), TrainingSetup(), get_cpu("intel-xeon-2t"),
        ...               micro_batch_size=1, seq_len=128)
        >>> round(t["compute_at_peak_seconds"] / t["compute_per_row_seconds"])  # tokens
        128
    """
    arch = model.arch
    flops = step_flops(model, setup, seq_len)
    tokens = micro_batch_size * seq_len
    at_peak = flops.per_token * tokens / (cpu.fp32_gflops * 1e9)
    bandwidth = cpu.bandwidth_gb_s * 1e9
    # what elementwise kernels stream: each layer's width-sized activations and the logits
    # (norms, residual adds, activation functions, softmax; forward and backward)
    width_elements = flops.layers * arch.hidden_size
    if model.task in ("causal-lm", "masked-lm"):
        width_elements += arch.vocab_size
    trainable = model_trainable(model, setup)
    accesses = get_optimizer(setup.optimizer).accesses.cpu
    return {
        "compute_at_peak_seconds": at_peak,
        "compute_per_row_seconds": at_peak / tokens,
        "elementwise_seconds": 4.0 * tokens * width_elements / bandwidth,
        "optimizer_seconds": accesses * 4.0 * trainable / bandwidth,
    }


def cpu_step_time(
    model: ModelInfo, setup: TrainingSetup, cpu: CpuSpec, *, micro_batch_size: int, seq_len: int
) -> StepTime | None:
    """The predicted time of one fp32 optimizer step on ``cpu`` (None for what was not
    measured: other precisions, several processes, ``--compile``, offload).

    Example:
        >>> from batchfit.hardware import get_cpu
        >>> from batchfit.models import resolve_model
        >>> fp32 = TrainingSetup(precision="fp32")
        >>> t = cpu_step_time(resolve_model("gpt2"), fp32, get_cpu("intel-xeon-2t"),
        ...                   micro_batch_size=4, seq_len=128)
        >>> t.step_seconds() > t.optimizer_seconds > 0
        True
    """
    if setup.precision != "fp32" or setup.num_gpus > 1 or setup.compile:
        return None
    if setup.offload != "none":
        return None
    terms = cpu_terms(model, setup, cpu, micro_batch_size=micro_batch_size, seq_len=seq_len)
    micro = (
        terms["compute_at_peak_seconds"] / UTIL
        + terms["compute_per_row_seconds"] * HALF_ROWS / UTIL
        + ELEMENTWISE_PASSES * terms["elementwise_seconds"]
    )
    return StepTime(
        micro_seconds=micro,
        optimizer_seconds=terms["optimizer_seconds"],
        tokens_per_micro_step=micro_batch_size * seq_len,
        model_flops_per_token=step_flops(model, setup, seq_len).model_per_token,
        peak_flops=cpu.fp32_gflops * 1e9,
    )
