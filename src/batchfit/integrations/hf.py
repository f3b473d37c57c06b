"""Hugging Face Transformers: a plan as ``TrainingArguments``; peak memory and throughput per
step, with a warning when the run needs more memory than its plan said; the gradient noise
scale of a batchfit ``Accumulator``."""

from __future__ import annotations

import logging
import os
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from batchfit.export import export
from batchfit.integrations._stepwatch import StepMemory, StepWatch
from batchfit.plan import Plan
from batchfit.train.accumulate import Accumulator

__all__ = ["NoiseScaleCallback", "PeakMemoryCallback", "StepMemory", "training_arguments"]

logger = logging.getLogger(__name__)


def training_arguments(plan: Plan, **overrides: Any) -> TrainingArguments:
    """``TrainingArguments`` for ``plan`` (``export(plan, "hf")``), with ``overrides`` on top.

    Example:
        >>> from batchfit.hardware import get_gpu
        >>> from batchfit.models import resolve_model
        >>> from batchfit.plan import make_plan
        >>> from batchfit.spec import TrainingSetup
        >>> plan = make_plan(resolve_model("gpt2"), get_gpu("rtx-3060"), TrainingSetup(),
        ...                  seq_len=256, global_batch=32, micro_batch_size=8, engine="analytic")
        >>> args = training_arguments(plan, output_dir="out", use_cpu=True, bf16=False)
        >>> args.per_device_train_batch_size, args.gradient_accumulation_steps
        (8, 4)
    """
    return TrainingArguments(**{**export(plan, "hf")["training_arguments"], **overrides})


class PeakMemoryCallback(TrainerCallback, StepWatch):
    """Log each optimizer step's peak memory and samples/s; warn when the peak drifts.

    On CUDA the peak is ``torch.cuda.max_memory_allocated`` over the step, what a plan's
    ``peak_bytes`` predicts (docs/design.md), beside ``max_memory_reserved``. On a Linux CPU it is
    the step's peak resident set (``VmHWM``, reset each step) above what the process held at
    train start besides the model: an approximation, for runs without a GPU. At each of the
    Trainer's logging steps the latest step's ``peak_memory_gib``, ``reserved_memory_gib``
    (CUDA) and ``samples_per_s`` join the logged values (TensorBoard, W&B, CSV,
    ``state.log_history``). A step whose peak exceeds the expected peak by more than
    ``tolerance`` is logged as a warning (once, then again only at a new high). With a plan,
    the model is checked against the plan's when the Trainer is built (or, for a callback
    added later, when training begins), and a CUDA run appends its largest step peak beside
    the plan's to the calibration file (``batchfit calibration``) when training ends. A run
    on another GPU than the plan's leaves no record (one log line says why).

    Args:
        plan: A ``Plan``, or the path (``str`` or ``os.PathLike``) of the file ``batchfit
            plan ... --json`` wrote; its ``peak_bytes`` is the expected peak.
        expected_peak_bytes: The expected peak, when there is no plan.
        tolerance: Allowed excess over the expected peak, as a fraction.
        check_model: Refuse a plan whose model has another parameter count than the
            trained one (more than 5% apart).

    Raises:
        ValueError: the plan was made for another model (one line naming both), or ``plan``
            is a path that is not a plan's JSON (one line naming it).

    Example:
        >>> callback = PeakMemoryCallback(expected_peak_bytes=8 * 2**30)
        >>> trainer = Trainer(model, args, callbacks=[callback])  # doctest: +SKIP
    """

    calibration_source = "hf-callback"

    def __init__(
        self,
        plan: Plan | str | os.PathLike[str] | None = None,
        *,
        expected_peak_bytes: int | None = None,
        tolerance: float = 0.10,
        check_model: bool = True,
    ) -> None:
        StepWatch.__init__(
            self,
            plan,
            expected_peak_bytes=expected_peak_bytes,
            tolerance=tolerance,
            check_model=check_model,
        )
        self._model_checked = False

    def on_init_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        # Checked here, before accelerate wraps and shards the model (an FSDP shard would
        # count as a smaller model).
        self.check_model_against_plan(kwargs.get("model"))
        self._model_checked = True

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        model = kwargs.get("model")
        if not self._model_checked:
            self.check_model_against_plan(model)
            self._model_checked = True
        self.start_run(args.device, model)

    def on_step_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        self.begin_step()

    def on_step_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        samples = (
            args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size
        )
        self.end_step(state.global_step, samples)

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, float] | None = None,
        **kwargs: Any,
    ) -> None:
        # the reporters after this callback (TensorBoard, W&B, CSV) get ``logs``; the Trainer
        # appended a copy of it to log_history before calling back
        values = self.metrics()
        if logs is None or not values:
            return
        logs.update(values)
        last = state.log_history[-1] if state.log_history else None
        if last is not None and last.get("step") == state.global_step:
            last.update(values)

    def on_train_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        if state.is_world_process_zero:  # one record per run, not one per rank
            self.record_calibration()


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
