"""The probe's estimates around its trials: the first size and the bytes a sample adds (the
trace engine's prediction), a budget too small for one step, the setup the steps run, and the
measured peak recorded beside the estimate for calibration."""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import TYPE_CHECKING, Any

import torch

from batchfit import calibration
from batchfit._units import human_bytes
from batchfit.errors import UsageError
from batchfit.hardware import GpuSpec, catalog_gpu, get_gpu
from batchfit.memory import estimate as _estimate
from batchfit.memory.trace import dry_run as trace
from batchfit.memory.trace import hf as _hf_trace
from batchfit.optimizers import get_optimizer
from batchfit.search._trials import SearchResult
from batchfit.workload import Device, Workload

if TYPE_CHECKING:
    from batchfit.models import ModelInfo
    from batchfit.spec import TrainingSetup

# The first trial aims this far below the predicted limit: the trace's worst error against real
# CPU steps is 1.2% (docs/benchmarks.md); on CUDA, unmeasured here, the margin is wider.
START_MARGIN = {"cpu": 0.02, "cuda": 0.05}


def run_setup(info: ModelInfo, asked: TrainingSetup, device_type: str) -> TrainingSetup:
    """The setup the probe's steps run on ``device_type``: the defaults resolved for it, the
    attention the model class runs."""
    return dataclasses.replace(
        asked.resolved(
            device="cpu" if device_type == "cpu" else "cuda",
            bf16_supported=device_type == "cpu" or torch.cuda.is_bf16_supported(),
        ),
        attention=info.resolve_attention(asked.attention),  # what the model class runs
    )


def calibration_record(
    result: SearchResult,
    info: Any,
    setup: Any,
    seq_len: int,
    device_type: str,
    device_kind: str,
    gpu: GpuSpec | None = None,
) -> calibration.Record | None:
    """The largest measured peak of ``result`` beside the trace engine's estimate for the same
    setup and micro-batch, as a calibration record; None when no size fitted. On a catalog
    ``gpu`` the record also keeps that size's measured step beside the time model's.

    The estimate is the one the probe's prediction makes (``device_type`` says which kernels
    it emulates); on the CPU this builds the record all the same, for the tests: the probe
    only keeps CUDA's (a CPU peak is resident memory, not comparable).
    """
    measured = [t for t in result.trials if t.ok and t.peak_bytes is not None]
    if not measured:
        return None
    largest = max(measured, key=lambda t: (t.micro_batch_size, t.peak_bytes or 0))
    device: Device = "cpu" if device_type == "cpu" else "cuda"
    workload = Workload(
        largest.micro_batch_size, seq_len, device, gpu if device == "cuda" else None
    )
    est = _estimate.estimate(info, setup, workload=workload, engine="trace")
    predicted = est.speed_json()["step_seconds"]
    measured_seconds = None
    if predicted and largest.samples_per_s:  # a step of one micro-batch, no accumulation
        measured_seconds = largest.micro_batch_size / largest.samples_per_s
    return calibration.Record(
        source="probe",
        model=info.name,
        setup=calibration.setup_key(est),
        device=device_kind,
        estimated_bytes=est.peak_bytes,
        measured_bytes=int(largest.peak_bytes or 0),
        estimated_seconds=predicted if measured_seconds else None,
        measured_seconds=measured_seconds,
    )


def record_calibration(
    result: SearchResult, info: Any, setup: Any, seq_len: int, device: Any
) -> list[str]:
    """A CUDA probe's measurement joins the calibration file (``batchfit calibration``);
    the note that says so."""
    name = torch.cuda.get_device_name(device)
    # the catalog's name joins the records of plans made for this GPU (plan --headroom auto)
    known = catalog_gpu(name, torch.cuda.get_device_properties(device).total_memory)
    kind = known or name.lower()
    spec = get_gpu(known) if known else None  # the time model's figures are the catalog's
    record = calibration_record(result, info, setup, seq_len, "cuda", kind, spec)
    if record is None or not calibration.append(record):
        return []
    return [
        f"the measured peak of the largest size beside the trace's estimate "
        f"({record.error:+.1%}) is recorded for `batchfit calibration`"
    ]


def check_budget(
    info: ModelInfo, setup: TrainingSetup, seq_len: int, device: str, budget: int | None
) -> None:
    """Refuse a budget below what one step at micro-batch 1 needs (analytic engine), before
    any trial runs, with the figure."""
    if budget is None:
        return
    need = _estimate.estimate(
        info,
        setup,
        workload=Workload(1, seq_len, "cpu" if device == "cpu" else "cuda"),
        # the formulas are instant; an image model only the trace models
        engine="trace" if info.arch.family == "vision" else "analytic",
    ).peak_bytes
    if need > budget:
        raise UsageError(
            f"--memory-budget {human_bytes(budget)} is below the {human_bytes(need)} one step of "
            "micro-batch 1 needs (weights, gradients, optimizer state, activations): "
            "give at least that"
        )


def warm_up(info: Any, setup: Any) -> None:
    """One step of a 1-layer copy at a tiny size, before any limit: imports, kernels and thread
    pools are library start-up, not the training state's (the benchmarks' peers do the same)."""
    # an image model: two small images, a few patches each (BatchNorm refuses one value per
    # channel, which one image of a few pixels gives at the end of a ResNet)
    micro, seq = (2, max(32, 2 * info.arch.patch_size)) if info.arch.family == "vision" else (1, 8)
    with trace.quiet():
        tiny = _hf_trace.step_parts(info, setup, micro=micro, seq=seq, emulate_cuda=False, depth=1)
        trace.training_steps(
            tiny.model,
            tiny.optimizer,
            tiny.make_batch,
            tiny.loss_of,
            autocast_dtype=tiny.autocast_dtype,
            steps=1,
            loop=setup.loop,
        )


def predict(
    info: Any, setup: Any, seq_len: int, device_type: str, room: int, high: int | None
) -> tuple[int, int, int]:
    """The first size to try, the peak bytes each sample adds and the peak at micro-batch 1,
    from a dry run of the step.

    The trace engine (the analytic one where the trace does not apply) predicts the peak at
    micro-batch 1 and 8; the start is the largest size whose predicted peak stays
    ``START_MARGIN`` (the trace's error against real steps, and some) below ``room``, checked
    by a prediction on each side, which also gives the slope there.
    """
    cache: dict[int, int] = {}
    device: Device = "cpu" if device_type == "cpu" else "cuda"

    def peak(m: int) -> int:
        if m not in cache:
            workload = Workload(m, seq_len, device)
            cache[m] = _estimate.estimate(info, setup, workload=workload, engine="trace").peak_bytes
        return cache[m]

    slope = max(1, (peak(8) - peak(1)) // 7)
    target = room * (1 - START_MARGIN[device_type])
    cap = high or 1 << 20
    guess = min(cap, max(1, 1 + int((target - peak(1)) // slope)))
    # the line's guess, then a gallop away from it and a bisection: a few predictions
    if peak(guess) <= target:
        lo, hi, step = guess, None, 1
        while hi is None and lo < cap:
            nxt = min(cap, lo + step)
            lo, hi, step = (nxt, None, 2 * step) if peak(nxt) <= target else (lo, nxt, step)
        hi = hi or lo + 1
    else:
        lo, hi, step = 0, guess, 1
        while lo == 0 and hi > 1:
            nxt = max(1, hi - step)
            lo, hi, step = (nxt, hi, step) if peak(nxt) <= target else (0, nxt, 2 * step)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if peak(mid) <= target else (lo, mid)
    n = max(1, lo)
    # The slope where the search starts, unless the line's is smaller: a prediction that jumps
    # between two sizes must not stop the search early (too small a slope costs one OOM).
    return n, max(1, min(peak(n + 1) - peak(n), slope)), peak(1)


def stand_ins(setup: Any) -> list[str]:
    """What the probe's step runs in place of the setup's, when this machine cannot run it."""
    notes = []
    package = get_optimizer(setup.optimizer).needs_cuda_package
    if package is not None and not (
        importlib.util.find_spec(package) is not None and torch.cuda.is_available()
    ):
        notes.append(
            f"{setup.optimizer}: {package} does not run here; an emulation with the same "
            f"state sizes ran, so the peak is close but the speed is not {package}'"
        )
    if setup.method == "qlora":
        notes.append(
            "qlora: bitsandbytes' 4-bit layers are emulated (the same packed storage and "
            "dequantised 16-bit weight per matmul), so the peak is QLoRA's but the speed is not "
            "bitsandbytes'"
        )
    return notes
