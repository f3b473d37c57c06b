"""What the device adds to a step's allocated peak, and the ``MemoryEstimate`` that reports it.

Every engine (formulas, a trace of a Hugging Face model, a trace of the user's module) ends the
same way: cuBLAS workspaces inside the allocator, the caching allocator's reserve (never capped by
the card), the CUDA context and NCCL buffers outside it. This module is that ending, written once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from batchfit._units import BYTES_IN_MIB
from batchfit.hardware import GpuSpec
from batchfit.memory.types import Line, MemoryEstimate
from batchfit.spec import TrainingSetup
from batchfit.workload import Device as Device  # re-exported: the engines name it from here
from batchfit.workload import Workload

# cuBLAS workspace per handle (aten/src/ATen/cuda/CublasHandlePool.cpp, default
# CUBLAS_WORKSPACE_CONFIG): 4096 KiB * 2 + 16 KiB * 8 before Hopper, 32 MiB on sm90+.
# One handle per thread: the forward thread and autograd's backward thread.
CUBLAS_WORKSPACE_BYTES = {
    "pre-hopper": 4096 * 1024 * 2 + 16 * 1024 * 8,
    "hopper+": 32 * BYTES_IN_MIB,
}
CUBLAS_HANDLES = 2
# What a training process holds outside the caching allocator (nvidia-smi's figure for the
# process minus memory_reserved): the CUDA context with lazy module loading (the default since
# CUDA 11.7 / PyTorch 1.13) plus the kernels each library loads on first use, in MiB.
# hopper: measured (benchmarks/gpu_validate.py, H100 80GB HBM3, driver 580.159.04, torch
#   2.11.0+cu130): 610 after CUDA init, 676 after cuBLAS, 694 after SDPA, 742-758 in training.
# ada: 426 after init on an RTX 6000 Ada, torch 2.10.0+cu130 (unslothai/unsloth-zoo#1053),
#   plus first-use kernels as on the H100 (+148; vLLM measured +0.16-0.20 GiB after init,
#   vllm-project/vllm#12126, #14447): inferred.
# ampere: 256 for an idle RTX 3090 process, torch 2.7.1+cu128 (invoke-ai/InvokeAI#9413),
#   plus +0.20 GiB on 24 GB cards (vllm-project/vllm#14447): inferred; an A100-40GB training
#   run's nvidia-smi minus peak reserved was 0.34-0.5 GiB (unslothai/unsloth#1186).
# All sources and their stacks: docs/cuda-context-sources.md.
# blackwell: a bare context of 555 on an RTX PRO 6000 (ggml-org/llama.cpp#23604), plus
#   PyTorch's and first-use kernels as on the H100: inferred.
# pascal/volta/turing: no lazy-loading figures are published; eager-loading ones (567-719,
#   1006-1341, 877: pytorch/pytorch#55277, #28394, #49877) scaled by the 0.41 that lazy loading
#   left of one eager context (pytorch/pytorch#86509: 616 -> 254): inferred. AMD: a guess.
CUDA_CONTEXT_MIB = {
    "pascal": 300,
    "volta": 450,
    "turing": 400,
    "ampere": 456,
    "ada": 574,
    "hopper": 758,
    "blackwell": 703,
    "cdna2": 450,
    "cdna3": 550,
}
# NCCL: NCCL_BUFFSIZE 4 MiB per channel and peer, both directions, up to 32 channels, plus
# its kernels; an assumption until measured.
NCCL_BYTES = 512 * BYTES_IN_MIB
# Reserved over allocated for the analytic engine: segment rounding and fragmentation.
# An assumption; the trace engine replays allocations through an allocator simulation.
FRAGMENTATION = 0.05


class GpuExtras(NamedTuple):
    """cuBLAS workspaces (allocated), CUDA context and NCCL buffers (outside the allocator)."""

    workspace: int
    context: int
    nccl: int


def gpu_extras(gpu: GpuSpec | None, setup: TrainingSetup) -> GpuExtras:
    """The fixed CUDA costs of a step on ``gpu`` (an Ampere card when unknown).

    Example:
        >>> from batchfit.hardware import get_gpu
        >>> gpu_extras(get_gpu("h100-80gb"), TrainingSetup()).workspace == 2 * 32 * 2**20
        True
    """
    arch = gpu.architecture if gpu else "ampere"
    hopper_plus = arch in ("hopper", "blackwell")
    workspace = CUBLAS_HANDLES * CUBLAS_WORKSPACE_BYTES["hopper+" if hopper_plus else "pre-hopper"]
    context = CUDA_CONTEXT_MIB.get(arch, 500) * BYTES_IN_MIB
    nccl = NCCL_BYTES if setup.num_gpus > 1 else 0
    return GpuExtras(workspace, context, nccl)


def workspace_line(workspace: int) -> Line:
    """The accounting row of the cuBLAS workspaces."""
    return Line(
        "other",
        "cuBLAS workspaces",
        workspace,
        f"{CUBLAS_HANDLES} handles x {workspace // CUBLAS_HANDLES:,} B",
    )


def fits_on_card(device_total_bytes: int, gpu_bytes: int, headroom_bytes: int = 0) -> bool:
    """Whether a step fits: its whole device total, plus ``headroom_bytes``, within the card.

    Nothing of the reserve is cut to make it fit, and a fit leaves something free: a step that
    fills the card to the byte does not fit (any allocation outside the estimate fails it).

    Example:
        >>> fits_on_card(11 << 30, 12 << 30), fits_on_card(12 << 30, 12 << 30)
        (True, False)
        >>> fits_on_card(11 << 30, 12 << 30, headroom_bytes=2 << 30)
        False
    """
    free_bytes = gpu_bytes - device_total_bytes
    return free_bytes > 0 and free_bytes >= headroom_bytes


def analytic_reserve(peak: int) -> int:
    """The analytic engine's guess of the reserve: the peak plus fragmentation, in 2 MiB."""
    multiple = 2 * BYTES_IN_MIB
    return -(-int(peak * (1 + FRAGMENTATION)) // multiple) * multiple


@dataclass(frozen=True)
class DeviceTotals:
    """A step's allocated peak, what the allocator reserves for it, and what sits outside."""

    peak: int
    reserved: int
    context: int = 0
    nccl: int = 0

    @property
    def device_total(self) -> int:
        """What nvidia-smi shows: the reserve, the CUDA context and NCCL's buffers."""
        return self.reserved + self.context + self.nccl


def device_totals(
    peak: int, reserved: int, device: Device, gpu: GpuSpec | None, setup: TrainingSetup
) -> DeviceTotals:
    """``reserved`` (an engine's guess), plus the costs outside the allocator.

    The reserve is never capped by the card: when the allocator would have to free its cache to
    fit, the step runs at the edge, and a verdict "fits" must not rest on that.
    On the CPU nothing is added: reserved and device total are the peak.
    """
    if device != "cuda":
        return DeviceTotals(peak, peak)
    extras = gpu_extras(gpu, setup)
    return DeviceTotals(peak, reserved, extras.context, extras.nccl)


def device_name(device: Device, gpu: GpuSpec | None) -> str:
    """``cpu``, ``cuda`` or ``cuda:<gpu>``, as MemoryEstimate.device reports it."""
    if device == "cpu":
        return "cpu"
    return f"cuda:{gpu.name}" if gpu else "cuda"


@dataclass(frozen=True)
class StepMemory:
    """What an engine found for one step, before the device's totals are added."""

    components: dict[str, int]
    peak_phase: str
    activation_peak_bytes: int
    total_params: int
    trainable_params: int
    host_bytes: int = 0
    lines: tuple[Line, ...] = ()
    warnings: tuple[str, ...] = ()
    extras: dict[str, Any] = field(default_factory=dict)


def assemble(
    step: StepMemory,
    totals: DeviceTotals,
    *,
    model: str,
    engine: str,
    setup: TrainingSetup,
    workload: Workload,
) -> MemoryEstimate:
    """The one place a ``MemoryEstimate`` is put together, for the step ``workload`` sized."""
    return MemoryEstimate(
        model=model,
        engine=engine,
        device=device_name(workload.device, workload.gpu),
        micro_batch_size=workload.micro_batch_size,
        seq_len=workload.seq_len,
        setup=setup,
        components=step.components,
        peak_bytes=totals.peak,
        reserved_bytes=totals.reserved,
        device_total_bytes=totals.device_total,
        total_params=step.total_params,
        trainable_params=step.trainable_params,
        peak_phase=step.peak_phase,
        host_bytes=step.host_bytes,
        activation_peak_bytes=step.activation_peak_bytes,
        lines=step.lines,
        warnings=step.warnings,
        extras=step.extras,
    )
