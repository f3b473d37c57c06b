"""What the training callbacks share (Transformers' and Lightning's ``PeakMemoryCallback``):
one optimizer step's peak memory and speed, the warning when a run drifts above its plan, the
plan's model checked against the model being trained, and the calibration record a CUDA run
with a plan leaves at its end."""

from __future__ import annotations

import logging
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from batchfit import calibration
from batchfit._memwatch import PROC_STATUS, status_bytes
from batchfit._units import BYTES_IN_GIB, human_count
from batchfit.hardware import catalog_gpu
from batchfit.integrations._plan_file import PlanFigures, plan_figures
from batchfit.plan import Plan

_PROC_CLEAR_REFS = Path("/proc/self/clear_refs")
# A model whose parameter count is this far from the plan's is another model. Legitimate gaps
# are far smaller: LoRA adapters are in the plan's count, resized vocabularies add a few rows.
# Near neighbours differ by more: Mistral-7B vs Llama-2-7B 7%, gpt2 vs distilgpt2 34%.
MODEL_MISMATCH_FRACTION = 0.05
# steps left out of a run's measured step time: the first ones warm up (the allocator grows,
# kernels are chosen, a compiled model compiles)
WARMUP_STEPS = 2


@dataclass(frozen=True)
class StepMemory:
    """One optimizer step as measured: its peak memory (CUDA: also the allocator's peak
    reserve) and throughput (None where the samples of the step are not known)."""

    step: int
    peak_bytes: int
    seconds: float
    samples_per_s: float | None
    reserved_bytes: int | None = None


class StepWatch:
    """Measures optimizer steps on one device and compares their peaks with a plan.

    The callbacks inherit it and call :meth:`start_run`, :meth:`begin_step` and
    :meth:`end_step` from their framework's hooks. On CUDA a step's peak is
    ``torch.cuda.max_memory_allocated`` since the step began (what a plan's ``peak_bytes``
    predicts), beside ``max_memory_reserved``. On a Linux CPU it is the step's peak resident
    set (``VmHWM``, reset each step) above what the process held at the start besides the
    model: an approximation, for runs without a GPU.

    Args:
        plan: A ``Plan``, or the path of the file ``batchfit plan ... --json`` wrote; its
            ``peak_bytes`` is the expected peak.
        expected_peak_bytes: The expected peak, when there is no plan.
        tolerance: Allowed excess over the expected peak, as a fraction.
        check_model: Refuse a plan made for another model (see :func:`check_plan_model`).

    Raises:
        ValueError: ``plan`` is a path that is not a plan's JSON (one line naming it).
    """

    calibration_source = ""  # the callback's name in calibration records

    def __init__(
        self,
        plan: Plan | str | os.PathLike[str] | None = None,
        *,
        expected_peak_bytes: int | None = None,
        tolerance: float = 0.10,
        check_model: bool = True,
    ) -> None:
        if plan is not None and expected_peak_bytes is not None:
            raise ValueError("give a plan or expected_peak_bytes, not both")
        if not tolerance >= 0:
            raise ValueError(f"tolerance must be >= 0, got {tolerance!r}")
        self.plan = plan
        self.planned: PlanFigures | None = None if plan is None else plan_figures(plan)
        self.expected_peak_bytes = (
            self.planned.peak_bytes if self.planned is not None else expected_peak_bytes
        )
        self.tolerance = tolerance
        self.check_model = check_model
        self.history: list[StepMemory] = []
        self.drifted_steps: list[int] = []
        self._cuda = False
        self._device = torch.device("cpu")
        self._cpu_baseline = 0
        self._start = 0.0
        self._warned_at = 0
        self._measured_gpu: str | None = None  # the CUDA device's catalog name (or its own)
        # the framework module's logger (batchfit.integrations.hf, .lightning)
        self._logger = logging.getLogger(type(self).__module__)

    def check_model_against_plan(self, model: object) -> None:
        """Refuse ``model`` when the plan was made for another (unless ``check_model`` is off)."""
        planned = self.planned
        if planned is not None and self.check_model and isinstance(model, torch.nn.Module):
            check_plan_model(planned, model, type(self).__name__, self._logger)

    def start_run(self, device: torch.device, model: object) -> None:
        """Before the first step: the device, and on the CPU what the process holds besides
        the model (the model's bytes count in every step's peak, as in an estimate's)."""
        self._device = device
        self._cuda = device.type == "cuda"
        if self._cuda:
            name = torch.cuda.get_device_name(device)
            total = torch.cuda.get_device_properties(device).total_memory
            self._measured_gpu = catalog_gpu(name, total) or name
        else:
            model_bytes = 0
            if isinstance(model, torch.nn.Module):
                tensors = [*model.parameters(), *model.buffers()]
                model_bytes = sum(t.numel() * t.element_size() for t in tensors)
            self._cpu_baseline = _status_bytes("VmRSS") - model_bytes

    def begin_step(self) -> None:
        """Restart the peak counters and the clock."""
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(self._device)
        elif _PROC_CLEAR_REFS.exists():
            _PROC_CLEAR_REFS.write_text("5")  # resets VmHWM to the current RSS
        self._start = time.perf_counter()

    def end_step(self, step: int, samples: int | None) -> StepMemory:
        """Read the step's peak; log it; warn when it drifted above the plan."""
        seconds = time.perf_counter() - self._start
        reserved = None
        if self._cuda:
            peak = int(torch.cuda.max_memory_allocated(self._device))
            reserved = int(torch.cuda.max_memory_reserved(self._device))
        else:
            peak = max(0, _status_bytes("VmHWM") - self._cpu_baseline)
        speed = None if samples is None else samples / max(seconds, 1e-9)
        record = StepMemory(step, peak, seconds, speed, reserved)
        self.history.append(record)
        self._logger.info(
            "step %d: peak %.3f GiB%s",
            step,
            peak / BYTES_IN_GIB,
            "" if speed is None else f", {speed:.1f} samples/s",
        )
        self._warn_on_drift(record)
        return record

    def _warn_on_drift(self, record: StepMemory) -> None:
        expected = self.expected_peak_bytes
        peak = record.peak_bytes
        if expected is None or peak <= expected * (1 + self.tolerance):
            return
        self.drifted_steps.append(record.step)
        if peak > self._warned_at:  # once, then again only at a new high
            self._warned_at = int(peak * (1 + self.tolerance))
            self._logger.warning(
                "step %d peaked at %.3f GiB, %.0f%% over the planned %.3f GiB: the run "
                "drifted from its plan (longer sequences? a different setup?)",
                record.step,
                peak / BYTES_IN_GIB,
                100 * (peak / expected - 1),
                expected / BYTES_IN_GIB,
            )

    def metrics(self) -> dict[str, float]:
        """The latest step as logged values: ``peak_memory_gib``, ``reserved_memory_gib``
        (CUDA) and ``samples_per_s``; empty before the first step."""
        if not self.history:
            return {}
        last = self.history[-1]
        values = {"peak_memory_gib": round(last.peak_bytes / BYTES_IN_GIB, 4)}
        if last.reserved_bytes is not None:
            values["reserved_memory_gib"] = round(last.reserved_bytes / BYTES_IN_GIB, 4)
        if last.samples_per_s is not None:
            values["samples_per_s"] = round(last.samples_per_s, 3)
        return values

    def record_calibration(self) -> bool:
        """A CUDA run with a plan: its largest step peak beside the plan's, one calibration
        record (``batchfit calibration``; CPU runs measure RSS, not comparable: nothing).

        A run on another GPU than the plan's leaves no record, and says so in one log line:
        the plan's figures are for its GPU (attention kernels and workspaces follow the
        device), so the gap would measure the GPUs' difference, not the estimate's error,
        and ``plan --headroom auto`` would learn it for the wrong card.
        """
        planned = self.planned
        if planned is None or not self._cuda or not self.history:
            return False
        measured_gpu = self._measured_gpu
        if measured_gpu is not None and measured_gpu != planned.gpu:
            self._logger.info(
                "no calibration record: the plan is for %s but the run is on %s (a plan for "
                "this GPU would calibrate it)",
                planned.gpu,
                measured_gpu,
            )
            return False
        largest = max(self.history, key=lambda r: r.peak_bytes)
        reserved = [r.reserved_bytes for r in self.history if r.reserved_bytes is not None]
        # the step time beside the plan's: the median step after the first two (warm-up,
        # the allocator growing, compilation), all of them in a shorter run
        timed = self.history[WARMUP_STEPS:] or self.history
        measured = statistics.median(r.seconds for r in timed)
        recorded = calibration.append(
            calibration.Record(
                source=self.calibration_source,
                model=planned.model,
                setup=planned.setup_key,
                device=planned.gpu,
                estimated_bytes=planned.peak_bytes,
                measured_bytes=largest.peak_bytes,
                reserved_bytes=max(reserved) if reserved else None,
                estimated_seconds=planned.step_seconds,
                measured_seconds=measured if planned.step_seconds and measured > 0 else None,
            )
        )
        if recorded:
            self._logger.info("recorded the run's peak beside its plan for `batchfit calibration`")
        return recorded


def parameter_count(model: torch.nn.Module) -> int:
    """The model's parameters as its plan counts them: each shared tensor once, a sharded or
    quantised one at its full size (DeepSpeed ZeRO-3's ``ds_numel``, bitsandbytes' 4-bit
    ``quant_state.shape``; an FSDP2 DTensor's ``numel`` is already the full size).

    Example:
        >>> parameter_count(torch.nn.Linear(3, 2))
        8
    """
    total = 0
    for p in model.parameters():  # each Parameter object once (tied weights are one)
        ds_numel = getattr(p, "ds_numel", None)
        shape = getattr(getattr(p, "quant_state", None), "shape", None)
        if isinstance(ds_numel, int):
            total += ds_numel
        elif shape is not None:
            total += torch.Size(shape).numel()
        else:
            total += p.numel()
    return total


def check_plan_model(
    plan: Plan | PlanFigures,
    model: torch.nn.Module,
    who: str,
    logger: logging.Logger | None = None,
) -> None:
    """Refuse a plan made for another model: the parameter counts must agree to within
    ``MODEL_MISMATCH_FRACTION``. A model without parameters yet (built later, on a meta
    device) is not checked, nor is a plan file whose model does not resolve here and that
    gives no parameter count (``logger`` says so).

    Raises:
        ValueError: one line naming the plan's model and the trained one, with both counts.
    """
    figures = plan_figures(plan) if isinstance(plan, Plan) else plan
    actual = parameter_count(model)
    planned = figures.total_params
    if planned is None:
        (logger or logging.getLogger(__name__)).info(
            "%s: the model is not checked against the plan: the plan file gives no parameter "
            "count and its model %s does not resolve here",
            who,
            figures.model,
        )
        return
    if actual == 0 or planned <= 0:
        return
    if abs(actual - planned) <= MODEL_MISMATCH_FRACTION * planned:
        return
    config = getattr(model, "config", None)
    name = getattr(config, "_name_or_path", "") or getattr(config, "name_or_path", "")
    trained = type(model).__name__ + (f" ({name})" if isinstance(name, str) and name else "")
    raise ValueError(
        f"{who}: the plan is for {figures.model} ({human_count(planned)} parameters) but the "
        f"model being trained is {trained} with {human_count(actual)}: plan this model "
        "(`batchfit plan` with its config.json), or pass check_model=False if it is the same"
    )


def _status_bytes(field: str) -> int:
    """``status_bytes`` on Linux; 0 without procfs: off Linux the CPU peak is not measured."""
    return status_bytes(field) if Path(PROC_STATUS).exists() else 0
