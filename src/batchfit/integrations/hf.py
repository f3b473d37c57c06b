"""Hugging Face Transformers: a plan as ``TrainingArguments``; peak memory and throughput per
step, with a warning when the run needs more memory than its plan said; the gradient noise
scale of a batchfit ``Accumulator``."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from batchfit._memwatch import PROC_STATUS, status_bytes
from batchfit._units import BYTES_IN_GIB
from batchfit.export import export
from batchfit.plan import Plan
from batchfit.train.accumulate import Accumulator

logger = logging.getLogger(__name__)

_PROC_CLEAR_REFS = Path("/proc/self/clear_refs")


def training_arguments(plan: Plan, **overrides: Any) -> TrainingArguments:
    """``TrainingArguments`` for ``plan`` (``export(plan, "hf")``), with ``overrides`` on top.

    Example:
        >>> from batchfit.hardware import get_gpu
        >>> from batchfit.models import resolve_model
        >>> from batchfit.plan import make_plan
        >>> from batchfit.spec import TrainingSetup
        >>> plan = make_plan(resolve_model("gpt2"), get_gpu("rtx-3060"), TrainingSetup(),
        ...                  seq_len=256, global_batch=32, micro_batch_size=8)
        >>> args = training_arguments(plan, output_dir="out", use_cpu=True, bf16=False)
        >>> args.per_device_train_batch_size, args.gradient_accumulation_steps
        (8, 4)
    """
    return TrainingArguments(**{**export(plan, "hf")["training_arguments"], **overrides})


@dataclass(frozen=True)
class StepMemory:
    """One optimizer step as measured: its peak memory and throughput."""

    step: int
    peak_bytes: int
    seconds: float
    samples_per_s: float


class PeakMemoryCallback(TrainerCallback):
    """Log each optimizer step's peak memory and samples/s; warn when the peak drifts.

    On CUDA the peak is ``torch.cuda.max_memory_allocated`` over the step, what a plan's
    ``peak_bytes`` predicts (DESIGN.md). On a Linux CPU it is the step's peak resident set
    (``VmHWM``, reset each step) above what the process held at train start besides the model:
    an approximation, for runs without a GPU. A step whose peak exceeds the expected peak by
    more than ``tolerance`` is logged as a warning (once, then again only at a new high).

    Args:
        plan: Its ``estimate.peak_bytes`` is the expected peak.
        expected_peak_bytes: The expected peak, when there is no plan.
        tolerance: Allowed excess over the expected peak, as a fraction.

    Example:
        >>> callback = PeakMemoryCallback(expected_peak_bytes=8 * 2**30)
        >>> trainer = Trainer(model, args, callbacks=[callback])  # doctest: +SKIP
    """

    def __init__(
        self,
        plan: Plan | None = None,
        *,
        expected_peak_bytes: int | None = None,
        tolerance: float = 0.10,
    ) -> None:
        if plan is not None and expected_peak_bytes is not None:
            raise ValueError("give a plan or expected_peak_bytes, not both")
        if not tolerance >= 0:
            raise ValueError(f"tolerance must be >= 0, got {tolerance!r}")
        self.expected_peak_bytes = (
            plan.estimate.peak_bytes if plan is not None else expected_peak_bytes
        )
        self.plan = plan
        self.tolerance = tolerance
        self.history: list[StepMemory] = []
        self.drifted_steps: list[int] = []
        self._cuda = False
        self._cpu_baseline = 0
        self._start = 0.0
        self._warned_at = 0

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        self._cuda = args.device.type == "cuda"
        if not self._cuda:
            model = kwargs.get("model")
            model_bytes = 0
            if isinstance(model, torch.nn.Module):
                tensors = [*model.parameters(), *model.buffers()]
                model_bytes = sum(t.numel() * t.element_size() for t in tensors)
            self._cpu_baseline = _status_bytes("VmRSS") - model_bytes

    def on_step_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        if self._cuda:
            torch.cuda.reset_peak_memory_stats()
        elif _PROC_CLEAR_REFS.exists():
            _PROC_CLEAR_REFS.write_text("5")  # resets VmHWM to the current RSS
        self._start = time.perf_counter()

    def on_step_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        seconds = time.perf_counter() - self._start
        if self._cuda:
            peak = int(torch.cuda.max_memory_allocated())
        else:
            peak = max(0, _status_bytes("VmHWM") - self._cpu_baseline)
        samples = (
            args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size
        )
        record = StepMemory(state.global_step, peak, seconds, samples / max(seconds, 1e-9))
        self.history.append(record)
        logger.info(
            "step %d: peak %.3f GiB, %.1f samples/s",
            record.step,
            peak / BYTES_IN_GIB,
            record.samples_per_s,
        )
        expected = self.expected_peak_bytes
        if expected is None or peak <= expected * (1 + self.tolerance):
            return
        self.drifted_steps.append(record.step)
        if peak > self._warned_at:
            self._warned_at = int(peak * (1 + self.tolerance))
            logger.warning(
                "step %d peaked at %.3f GiB, %.0f%% over the planned %.3f GiB: the run "
                "drifted from its plan (longer sequences? a different setup?)",
                record.step,
                peak / BYTES_IN_GIB,
                100 * (peak / expected - 1),
                expected / BYTES_IN_GIB,
            )

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, float] | None = None,
        **kwargs: Any,
    ) -> None:
        _log_step_memory(self, logs)

    def on_train_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        if _record_calibration(self):
            logger.info("recorded the run's peak beside its plan for `batchfit calibration`")


def _status_bytes(field: str) -> int:
    """``status_bytes`` on Linux; 0 without procfs: off Linux the CPU peak is not measured."""
    return status_bytes(field) if Path(PROC_STATUS).exists() else 0


def _log_step_memory(callback: PeakMemoryCallback, logs: dict[str, float] | None) -> None:
    """The latest step's peak (GiB) and samples/s into the Trainer's logs, which the
    reporters after this callback (TensorBoard, W&B, CSV) and ``state.log_history`` get."""
    if logs is None or not callback.history:
        return
    last = callback.history[-1]
    logs["peak_memory_gib"] = round(last.peak_bytes / BYTES_IN_GIB, 4)
    logs["samples_per_s"] = round(last.samples_per_s, 3)


def _record_calibration(callback: PeakMemoryCallback) -> bool:
    """A CUDA run with a plan: its largest step peak beside the plan's, one calibration record
    (``batchfit calibration``; CPU runs measure RSS, not comparable: nothing)."""
    plan = callback.plan
    if plan is None or not callback._cuda or not callback.history:
        return False
    from batchfit import calibration

    est = plan.estimate
    return calibration.append(
        calibration.Record(
            source="hf-callback",
            model=plan.model,
            setup=json.dumps(
                {
                    "setup": est.to_json()["setup"],
                    "micro": est.micro_batch_size,
                    "seq": est.seq_len,
                },
                sort_keys=True,
                default=str,
            ),
            device=plan.gpu,
            estimated_bytes=est.peak_bytes,
            measured_bytes=max(r.peak_bytes for r in callback.history),
        )
    )


class NoiseScaleCallback(TrainerCallback):
    """Log the gradient noise scale of a batchfit ``Accumulator`` that runs the optimizer step.

    For loops where an ``Accumulator(..., noise_scale=True)`` does the accumulation (a
    ``Trainer`` subclass, or any loop that fires these callbacks). After each optimizer step
    the accumulator's latest ``StepResult.noise_scale`` (B_simple, in ``num_items``: tokens or
    samples) is logged with ``logging`` and kept in ``history``; at each of the Trainer's
    logging steps it is added to the logged values (``logs``, which the callbacks after this
    one receive, and the Trainer's ``state.log_history``). Nothing is logged while the value
    is None (one micro-batch per step on one rank, or too few steps yet).

    Args:
        accumulator: The ``Accumulator`` whose steps are logged.

    Example:
        >>> callback = NoiseScaleCallback(acc)  # doctest: +SKIP
        >>> trainer = Trainer(model, args, callbacks=[callback])  # doctest: +SKIP
    """

    def __init__(self, accumulator: Accumulator) -> None:
        self.accumulator = accumulator
        self.history: list[tuple[int, float]] = []  # (global step, noise scale)

    def on_step_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        value = self.accumulator.noise_scale
        if value is None:
            return
        self.history.append((state.global_step, value))
        logger.info("step %d: gradient noise scale %.4g items", state.global_step, value)

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, float] | None = None,
        **kwargs: Any,
    ) -> None:
        value = self.accumulator.noise_scale
        if value is None or logs is None:
            return
        logs["noise_scale"] = value
        last = state.log_history[-1] if state.log_history else None
        if last is not None and last.get("step") == state.global_step:
            last["noise_scale"] = value
