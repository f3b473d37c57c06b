"""Step time of a training step: FLOPs of the step, an achievable utilisation, the optimizer
step as memory traffic, a per-layer launch overhead, and with several GPUs the communication
compute cannot hide; CPU offload's transfers and CPU optimizer. Steps that run
on the CPU itself: ``_cpu.py``, over a measured CPU profile.

The model, per optimizer micro-step::

    seconds = layers x launch + FLOPs / (peak x utilisation(width)) + exposed communication

and once per optimizer step the update (memory traffic over this rank's share of the
parameters, or the CPU's under offload) and the communication nothing hides. The update's
traffic is counted from the implementation's source, not fitted: a fused kernel's 7 element
accesses a parameter for AdamW, PyTorch's foreach default 20, and gradient clipping's 3 where
the framework clips (``optimizer_accesses``).

Calibrated on three step-time sweeps on an H100 (``benchmarks/data/gpu_validate_h100.json``:
llama-3.2-1b, qwen2.5-0.5b, gpt2 at several micro-batches) and checked on the 25 other cases
measured there (``docs/benchmarks.md``). The communication terms (``_comm.py``: what moves when;
here: how long it takes over the catalog's links and how much compute hides) are not
calibrated on measured multi-GPU steps yet.
"""

from __future__ import annotations

from batchfit.errors import UsageError
from batchfit.hardware import CpuSpec, GpuSpec
from batchfit.lengths import sample_tokens
from batchfit.models import ModelInfo
from batchfit.optimizers import get_optimizer
from batchfit.spec import TrainingSetup, is_deepspeed
from batchfit.speed._comm import comm_bytes_per_step as comm_bytes_per_step
from batchfit.speed._comm import traffic
from batchfit.speed._cpu import cpu_step_time
from batchfit.speed._step import StepFlops, model_trainable, step_flops, traced_step_flops
from batchfit.speed._step import StepTime as StepTime
from batchfit.workload import Workload

# Utilisation of the tensor cores' dense peak that a step's matmuls reach, by generation: the
# ceiling for wide models. Hopper 0.50: llama-3.2-1b (width 2048) reached 0.35 at the margin on
# an H100 (0.50 x 2048 / (2048 + 900)); published H100 runs sit at 0.34-0.46 and
# A100 runs at 0.54-0.68 (wider models), hence Ampere 0.62. Others: between, a guess.
U_MAX = {
    "volta": 0.55,
    "turing": 0.5,
    # Ampere 0.80: llm-foundry's published A100 runs (the calibration half of
    # benchmarks/data/published_throughput.json) reach hardware utilisations of 0.7-0.77 for
    # wide models with checkpointing (MFU 0.55-0.58 x 4/3 recompute)
    "ampere": 0.80,
    "ada": 0.55,
    "hopper": 0.5,
    "blackwell": 0.45,
    "cdna2": 0.45,
    "cdna3": 0.45,
}
# Width at which a model reaches half the ceiling (narrow matmuls underuse the GPU):
# qwen2.5-0.5b (width 896) reached 0.30 at the margin on the H100, llama-3.2-1b (2048) 0.35,
# at micro-steps of up to 16k tokens. Longer micro-steps give narrow matmuls more rows: the
# half width shrinks as the square root of the tokens beyond that (MPT-125m, width 768, at
# 64k tokens a micro-step reached MFU 0.44 on A100s, llm-foundry's table).
HALF_WIDTH = 900
HALF_WIDTH_TOKENS = 16384
# fp32 matmuls run on the CUDA cores (PyTorch's default, allow_tf32=False): gpt2 reached 0.54
# of the H100's 67 TFLOP/s non-tensor peak.
U_FP32 = 0.54
# The GPU waits on Python and kernel launches: seconds per layer per micro-step, from the
# sweeps' intercepts (a line through the points without checkpointing) less the optimizer step
# at its foreach count (the sweeps ran torch's default AdamW): llama-3.2-1b 1.6 ms,
# qwen2.5-0.5b 3.4 ms under autocast, 2.6 ms the least-squares value (log error) over the
# sweeps' eight autocast points; gpt2 fp32 1.3 ms. Casts add kernels. (With AdamW taken as a
# fused kernel's 7 accesses the same intercepts give 3.1, 3.8 and 1.5 ms; then 3.0 and 1.5.)
LAUNCH_S_PER_LAYER = {"amp": 2.6e-3, "plain": 1.3e-3}
# The optimizer step is memory-bound: elements it streams per trainable parameter, at the
# state's element size, as its registered spec counts them (batchfit.optimizers ``Accesses``).
# Gradient clipping by norm before the update: torch's clip_grad_norm_ (torch/nn/utils/
# clip_grad.py) reads every gradient for _foreach_norm, then scales each in place with
# _foreach_mul_ whether or not the norm exceeds the limit: 3 accesses a trainable parameter.
CLIP_ACCESSES = 3
# Which loops clip by default is the framework preset's trait (``Preset.clips_grad_norm``).
BANDWIDTH_EFFICIENCY = 0.8  # of the catalog's peak bandwidth, for long streaming kernels
# torch.compile's fused kernels: +16-23% throughput on published FSDP runs (torchtitan's
# Llama 3.1 8B on H100s +16%, IBM fms-fsdp's 7B on A100s +21%)
COMPILE_SPEEDUP = 1.19

# Collectives. A node is 8 GPUs (HGX / DGX boards); between nodes each GPU has its own NIC
# (rail-optimised), per direction: DGX H100 and DGX B200 8 x ConnectX-7 400 Gb/s, DGX A100
# 8 x ConnectX-6 200 Gb/s (NVIDIA DGX user guides); Volta-era clusters 100 Gb/s EDR; AMD MI300X
# platforms 400 Gb/s, MI250X (Frontier) 200 Gb/s; anything else 100 GbE.
GPUS_PER_NODE = 8
NETWORK_GB_S = {
    "hopper": 50.0,
    "blackwell": 50.0,
    "ampere": 25.0,
    "volta": 12.5,
    "cdna3": 50.0,
    "cdna2": 25.0,
}
DEFAULT_NETWORK_GB_S = 12.5
# NCCL's bus bandwidth on large messages reaches about three quarters of the link's peak
# (nccl-tests' all_reduce_perf busbw on DGX A100 / H100 boards); an assumption, uncalibrated.
COLLECTIVE_EFFICIENCY = 0.75
# Of a collective's time that runs beside compute (DDP's bucketed all-reduce during backward,
# FSDP's prefetched all-gathers), the share compute hides: communication kernels take SMs and
# memory bandwidth from the compute they overlap. An assumption, uncalibrated.
OVERLAP = 0.8
# The host link CPU offload crosses, per direction (PCIe x16 of the generation the platform
# uses: 3.0 for Volta/Turing, 4.0 for Ampere/Ada/MI250X, 5.0 for Hopper/Blackwell/MI300X),
# at the efficiency of pinned-memory copies.
HOST_LINK_GB_S = {
    "pascal": 15.75,
    "volta": 15.75,
    "turing": 15.75,
    "ampere": 31.5,
    "ada": 31.5,
    "cdna2": 31.5,
    "hopper": 63.0,
    "blackwell": 63.0,
    "cdna3": 63.0,
}
HOST_COPY_EFFICIENCY = 0.8
# DeepSpeed's CPU-Adam (ZeRO-Offload, Ren et al. 2021) streams the fp32 master weights, the
# gradients and both moments through the CPU's vector units: parameters updated per second
# per GPU process. An assumption (a few cores per GPU process with AVX-512), uncalibrated.
CPU_ADAM_PARAMS_PER_S = 1.0e9


def _peak_flops(gpu: GpuSpec, precision: str) -> float | None:
    if precision == "fp32":
        return (gpu.fp32_tflops or 0) * 1e12 or None
    # GeForce fp16 figures are fp16-accumulate; training accumulates in fp32 as bf16 does
    peak = gpu.bf16_tflops_dense or gpu.fp16_tflops_dense
    return peak * 1e12 if peak else None


def step_time(
    model: ModelInfo,
    setup: TrainingSetup,
    gpu: GpuSpec | CpuSpec,
    *,
    micro_batch_size: int | None = None,
    seq_len: int | None = None,
    workload: Workload | None = None,
    flops_per_sample: tuple[float, ...] | None = None,
) -> StepTime | None:
    """The predicted time of one optimizer step on ``gpu`` (``setup`` resolved), per rank, or
    None where the model does not apply: an image model without ``flops_per_sample``, a GPU
    without a peak figure, several GPUs on a GPU without a link figure. A catalog CPU profile
    (``CpuSpec``) in place of the GPU times a step on that CPU (``batchfit.speed._cpu``: fp32
    steps of token models only).

    ``flops_per_sample``: what the dry run counted for each sample in a micro-step (the trace
    engine's ``extras``): forward FLOPs, backward FLOPs with any recompute, and the bytes the
    other operators move forward and backward. An image model's step is timed from them on a
    GPU, operator class by operator class: the matmuls, convolutions and attention at the
    generation's utilisation ceiling, the rest as memory traffic (the formulas count token
    models only); a token model's keeps the formulas' count, on which the coefficients were
    calibrated.

    The sizes are ``micro_batch_size`` and ``seq_len``, or a ``workload``'s; ``gpu`` names the
    hardware either way (a CPU profile is not a workload's device), so the workload's device
    and GPU are not read. A workload's ``--lengths`` set the tokens a micro-batch computes:
    with dynamic padding, the expected longest sample of a micro-batch
    (``LengthsSummary.timed_length``), not the longest sample of the dataset.

    Example:
        >>> from batchfit.hardware import get_gpu
        >>> from batchfit.models import resolve_model
        >>> t = step_time(resolve_model("llama-3.2-1b"), TrainingSetup(precision="amp-bf16"),
        ...               get_gpu("h100-80gb"), micro_batch_size=8, seq_len=2048)
        >>> 0.3 < t.step_seconds() < 0.5  # measured on an H100: 0.409 s
        True

    Raises:
        UsageError: both a ``workload`` and sizes, or neither.
    """
    micro_batch_size, seq_len = _sizes(workload, micro_batch_size, seq_len)
    if workload is not None:
        seq_len = max(1, round(sample_tokens(workload.lengths, seq_len, micro_batch_size)))
    if model.arch.family == "vision":
        if isinstance(gpu, CpuSpec) or not flops_per_sample or not all(flops_per_sample[:2]):
            return None
        flops = traced_step_flops(model, setup, flops_per_sample)
        return _gpu_step_time(model, setup, gpu, micro_batch_size, seq_len, flops)
    if isinstance(gpu, CpuSpec):
        return cpu_step_time(model, setup, gpu, micro_batch_size=micro_batch_size, seq_len=seq_len)
    return _gpu_step_time(model, setup, gpu, micro_batch_size, seq_len)


def _gpu_step_time(
    model: ModelInfo,
    setup: TrainingSetup,
    gpu: GpuSpec,
    micro_batch_size: int,
    seq_len: int,
    traced: StepFlops | None = None,
) -> StepTime | None:
    """``step_time`` on a GPU: compute, launches, the exposed collectives and offload copies;
    from the ``traced`` FLOPs where given, else the formulas'."""
    arch = model.arch
    peak = _peak_flops(gpu, setup.precision)
    if peak is None or not gpu.bandwidth_gb_s:
        return None
    link = collective_gb_s(gpu, setup.num_gpus)
    if setup.num_gpus > 1 and link is None:
        return None
    # an image model's step counts images (``StepTime.tokens_per_micro_step``)
    tokens = micro_batch_size * (1 if arch.family == "vision" else seq_len)
    flops = traced or step_flops(model, setup, seq_len)
    layers, recompute_share = flops.layers, flops.recompute_share
    flops_per_token, model_flops_per_token = flops.per_token, flops.model_per_token
    rows = _matmul_rows(model, micro_batch_size, seq_len)
    util = _utilisation(setup, gpu, arch.hidden_size, rows)
    bandwidth = gpu.bandwidth_gb_s * 1e9 * BANDWIDTH_EFFICIENCY
    # the other operators' memory traffic, where a dry run counted it: then the matmuls run at
    # the generation's ceiling (the width's discount stands for that traffic in the formulas);
    # LoRA's adapters and QLoRA's dequantisation stream memory beside the matmuls
    moved = (flops.bytes_per_token + flops.adapter_bytes_per_token) * tokens
    moved = (moved + flops.dequant_bytes) / bandwidth
    if flops.bytes_per_token and setup.precision != "fp32":
        util = U_MAX.get(gpu.architecture, 0.5)
    # DeepSpeed's stages run the 16-bit module without autocast (memory/formulas/deepspeed.py), but
    # its engine's per-parameter hooks cost launches too: counted as autocast's
    amp = setup.precision in ("amp-bf16", "amp-fp16")
    # recomputed layers launch their forward kernels again (about a third of a layer's)
    launch = LAUNCH_S_PER_LAYER["amp" if amp else "plain"] * layers * (1 + recompute_share / 3)
    launch *= flops.launch_scale
    compute = flops_per_token * tokens / (peak * util) + moved
    if setup.compile:
        compute /= COMPILE_SPEEDUP
    backward_share = flops.backward_share
    trainable = model_trainable(model, setup)
    # sharded optimizers (ZeRO, FSDP) update this rank's partition only
    shard = setup.num_gpus if is_deepspeed(setup) or setup.sharding == "fsdp" else 1
    element = 2 if setup.precision in ("bf16", "fp16") else 4
    opt_bytes = optimizer_accesses(setup) * element * trainable / shard
    update = opt_bytes / bandwidth
    comm_micro = comm_step = 0.0
    if link is not None:
        comm_micro, comm_step = _comm_seconds(
            model, setup, link, trainable, launch + compute, backward_share
        )
    offload, fetch, accumulate = _offload_parts(
        model, setup, gpu, trainable, shard, launch + compute, backward_share, recompute_share
    )
    if setup.offload != "none":  # the CPU updates the offloaded state
        update = 0.0
    return StepTime(
        micro_seconds=launch + compute + comm_micro + fetch,
        optimizer_seconds=update + comm_step + offload,
        tokens_per_micro_step=tokens,
        model_flops_per_token=model_flops_per_token,
        peak_flops=peak,
        comm_micro_seconds=comm_micro,
        comm_step_seconds=comm_step,
        offload_seconds=offload,
        offload_micro_seconds=fetch,
        offload_accum_seconds=accumulate,
    )


def counted_step_time(
    flops_per_sample: tuple[float, ...],
    setup: TrainingSetup,
    gpu: GpuSpec,
    micro_batch_size: int,
    trainable_params: int,
) -> StepTime | None:
    """The step time of the user's own module on one GPU, from what its dry run counted
    (``flops_per_sample`` as ``step_time`` takes it): the matmuls, convolutions and attention
    at the generation's utilisation ceiling, the other operators' bytes over the card's
    bandwidth, the optimizer's update as memory traffic; as an image model's step, without the
    per-layer launch cost (an own module names no layers). None on several GPUs, with offload,
    or where the GPU has no peak figure. Its "tokens" are its samples.

    Example:
        >>> from batchfit.hardware import get_gpu
        >>> t = counted_step_time((2e9, 4e9, 0.0, 0.0), TrainingSetup(precision="amp-bf16"),
        ...                       get_gpu("a100-80gb"), 100, 10**6)
        >>> round(t.micro_seconds * 1e3, 2)  # 600 GFLOPs at 0.8 x 312 TFLOP/s
        2.4
    """
    peak = _peak_flops(gpu, setup.precision)
    if peak is None or not gpu.bandwidth_gb_s or not all(flops_per_sample[:2]):
        return None
    if setup.num_gpus > 1 or setup.offload != "none":
        return None
    forward, backward, *moved = flops_per_sample
    bandwidth = gpu.bandwidth_gb_s * 1e9 * BANDWIDTH_EFFICIENCY
    util = U_FP32 if setup.precision == "fp32" else U_MAX.get(gpu.architecture, 0.5)
    compute = (forward + backward) * micro_batch_size / (peak * util)
    traffic = sum(moved) * micro_batch_size / bandwidth
    element = 2 if setup.precision in ("bf16", "fp16") else 4
    update = optimizer_accesses(setup) * element * trainable_params / bandwidth
    return StepTime(
        micro_seconds=compute + traffic,
        optimizer_seconds=update,
        tokens_per_micro_step=micro_batch_size,
        model_flops_per_token=3.0 * forward,
        peak_flops=peak,
    )


def _sizes(
    workload: Workload | None, micro_batch_size: int | None, seq_len: int | None
) -> tuple[int, int]:
    """(micro-batch, sample size): the workload's, or the two keywords, exactly one of them."""
    if workload is not None and micro_batch_size is None and seq_len is None:
        return workload.micro_batch_size, workload.seq_len
    if workload is None and micro_batch_size is not None and seq_len is not None:
        return micro_batch_size, seq_len
    raise UsageError(
        "step_time needs micro_batch_size= and seq_len=, or a workload= in their place"
    )


def _matmul_rows(model: ModelInfo, micro_batch_size: int, seq_len: int) -> int:
    """Rows of the step's matrix multiplies: its tokens; an image model's patches (a
    convolutional one's positions at a 4-pixel stride, where its stem cuts the image)."""
    arch = model.arch
    if arch.family != "vision":
        return micro_batch_size * seq_len
    side = seq_len // (arch.patch_size if arch.patch_size > 1 else 4)
    return micro_batch_size * max(side, 1) ** 2


def _utilisation(setup: TrainingSetup, gpu: GpuSpec, width: int, tokens: int) -> float:
    """Share of the dense peak the step's matmuls reach: a constant in fp32; in 16-bit the
    generation's ceiling, scaled by the width over the width plus the half-width (wider with
    fewer tokens)."""
    if setup.precision == "fp32":
        return U_FP32
    half: float = HALF_WIDTH * min(1.0, (HALF_WIDTH_TOKENS / tokens) ** 0.5)
    return U_MAX.get(gpu.architecture, 0.5) * width / (width + half)


def _comm_seconds(
    model: ModelInfo,
    setup: TrainingSetup,
    link: float,
    trainable: float,
    compute_micro: float,
    backward_share: float,
) -> tuple[float, float]:
    """Communication compute does not hide: per micro-step, and once per optimizer step."""
    moved = traffic(setup, model.total_params, int(trainable))
    ring = (setup.num_gpus - 1) / setup.num_gpus / (link * 1e9 * COLLECTIVE_EFFICIENCY)
    comm_micro = _exposed((moved.micro_gather + moved.micro_reduce) * ring, compute_micro)
    last = (moved.last_backward_gather + moved.last_backward_reduce) * ring
    comm_step = _exposed(last, compute_micro * backward_share)
    comm_step += moved.after_step_gather * ring
    return comm_micro, comm_step


def _offload_parts(
    model: ModelInfo,
    setup: TrainingSetup,
    gpu: GpuSpec,
    trainable: float,
    shard: int,
    compute_micro: float,
    backward_share: float,
    recompute_share: float,
) -> tuple[float, float, float]:
    """CPU offload's seconds: the CPU's update (per step), the parameters' copies up (per
    micro-step), and the gradients' round trip while accumulating (per micro-step but the
    last)."""
    offload = fetch = accumulate = 0.0
    if setup.offload != "none":
        offload = _offload_seconds(model, setup, gpu, trainable / shard)
        # accumulating, the 16-bit gradient partition goes down to CPU RAM and the sum so far
        # comes back up in each micro-step but the last, beside backward's compute
        moved_accum = 2 * 2 * trainable / shard
        accumulate = _exposed(moved_accum / _host_bytes_per_s(gpu), compute_micro * backward_share)
    if setup.offload == "optimizer+params":
        # ZeRO-Infinity / FSDP's CPU offload keep the parameters on the host: every
        # micro-step copies this rank's partition up for forward, again for backward and for
        # each recomputed layer, prefetched beside compute
        copies = 2 + recompute_share
        fetched = (2 if setup.precision != "fp32" else 4) * model.total_params / shard * copies
        fetch = _exposed(fetched / _host_bytes_per_s(gpu), compute_micro)
    return offload, fetch, accumulate


def collective_gb_s(gpu: GpuSpec, num_gpus: int) -> float | None:
    """Per-GPU bandwidth per direction that a ring over ``num_gpus`` runs at: the node's link
    inside one node, the slower of it and the network beyond (None: no figure)."""
    if num_gpus <= 1:
        return None
    if not gpu.link_gb_s:
        return None
    if num_gpus <= GPUS_PER_NODE:
        return gpu.link_gb_s
    return min(gpu.link_gb_s, NETWORK_GB_S.get(gpu.architecture, DEFAULT_NETWORK_GB_S))


def optimizer_accesses(setup: TrainingSetup) -> int:
    """Elements the optimizer step streams per trainable parameter on a GPU: the fused kernel's
    count under ``--optimizer-impl fused`` (and DeepSpeed, whose engine runs its FusedAdam),
    PyTorch's foreach count otherwise (``auto`` is foreach for CUDA tensors; the per-parameter
    loop streams the same); and gradient clipping's where the framework clips by default.

    Example:
        >>> optimizer_accesses(TrainingSetup(optimizer="adamw"))  # torch's foreach AdamW
        20
        >>> optimizer_accesses(TrainingSetup(optimizer="adamw", optimizer_impl="fused"))
        7
        >>> optimizer_accesses(  # HF Trainer: fused AdamW, clipped at max_grad_norm 1.0
        ...     TrainingSetup(framework="hf-trainer", optimizer_impl="fused"))
        10
    """
    accesses = get_optimizer(setup.optimizer).accesses
    fused = setup.optimizer_impl == "fused" or is_deepspeed(setup)
    update = accesses.kernel if fused or accesses.unfused is None else accesses.unfused
    return update + (CLIP_ACCESSES if setup.conventions.clips_grad_norm else 0)


def _exposed(comm_seconds: float, beside_seconds: float) -> float:
    """Communication time that compute running beside it does not hide."""
    return max(0.0, comm_seconds - OVERLAP * beside_seconds)


def _offload_seconds(
    model: ModelInfo, setup: TrainingSetup, gpu: GpuSpec, partition: float
) -> float:
    """CPU offload per optimizer step: the 16-bit gradient partition down to the host, the
    updated 16-bit parameters back up, the CPU's Adam over the fp32 master partition. With
    parameter offload the parameters also go up in every micro-step (``step_time``)."""
    moved = 2 * partition * 2  # gradients down, parameters up, 2 bytes each
    return moved / _host_bytes_per_s(gpu) + partition / CPU_ADAM_PARAMS_PER_S


def _host_bytes_per_s(gpu: GpuSpec) -> float:
    """What one GPU's host link carries, in bytes a second."""
    return HOST_LINK_GB_S.get(gpu.architecture, 15.75) * 1e9 * HOST_COPY_EFFICIENCY
