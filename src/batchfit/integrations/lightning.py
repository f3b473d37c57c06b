"""Lightning: change the micro-batch at fit start without changing the global batch; log each
optimizer step's peak memory and samples/s, against a plan.

Lightning's automatic optimization scales each micro-batch's loss by
``1 / accumulate_grad_batches``: exact for per-sample mean losses over equal micro-batches
(what this callback keeps), not for token means over padded sequences. For those, use
``batchfit.train.Accumulator`` in a manual-optimization ``training_step``; ``NoiseScaleCallback``
then logs its gradient noise scale.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.tuner.batch_size_scaling import _reset_dataloaders
from lightning.pytorch.utilities.data import extract_batch_size
from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_setattr

from batchfit.export import export
from batchfit.integrations._stepwatch import StepMemory, StepWatch
from batchfit.plan import Plan
from batchfit.train import check_positive_int
from batchfit.train.accumulate import Accumulator
from batchfit.train.retry import micro_batch_at_most

__all__ = [
    "MicroBatchCallback",
    "NoiseScaleCallback",
    "PeakMemoryCallback",
    "StepMemory",
    "trainer_kwargs",
]

logger = logging.getLogger(__name__)

MicroBatchFinder = Callable[[pl.Trainer, pl.LightningModule], int]


class MicroBatchCallback(pl.Callback):
    """Set the micro-batch at fit start and ``accumulate_grad_batches`` to keep the global batch.

    The global batch is ``global_batch_size`` when given, else what the run was configured
    with: ``batch_size x accumulate_grad_batches x world size``. The micro-batch is
    ``micro_batch_size``, or what ``micro_batch_size(trainer, module)`` returns (a probe,
    called once the model is on its device), lowered to the nearest size that divides the
    per-device batch so accumulation stays a whole number (``batchfit.train.retry``, the rule
    ``MicroBatcher`` and ``DeepSpeedMicroBatcher`` shrink by after an OOM). The size is
    written where Lightning's own ``BatchSizeFinder`` writes it (``batch_arg_name`` on the
    module, its ``hparams`` or the datamodule) and the dataloaders are rebuilt.

    Args:
        micro_batch_size: A size, or a finder called at fit start.
        global_batch_size: Samples per optimizer step over all devices.
        batch_arg_name: The attribute the dataloaders read their batch size from.

    Example:
        >>> callback = MicroBatchCallback(4, global_batch_size=32)
        >>> trainer = pl.Trainer(callbacks=[callback])  # doctest: +SKIP
    """

    def __init__(
        self,
        micro_batch_size: int | MicroBatchFinder,
        *,
        global_batch_size: int | None = None,
        batch_arg_name: str = "batch_size",
    ) -> None:
        if isinstance(micro_batch_size, int):
            check_positive_int("micro_batch_size", micro_batch_size)
        if global_batch_size is not None:
            check_positive_int("global_batch_size", global_batch_size)
        self.micro_batch_size = micro_batch_size
        self.global_batch_size = global_batch_size
        self.batch_arg_name = batch_arg_name
        self.chosen: tuple[int, int] | None = None  # (micro-batch, accumulation) once set

    @classmethod
    def from_plan(cls, plan: Plan, *, batch_arg_name: str = "batch_size") -> MicroBatchCallback:
        """The plan's micro-batch and global batch."""
        return cls(
            plan.micro_batch_size,
            global_batch_size=plan.global_batch_size,
            batch_arg_name=batch_arg_name,
        )

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        world = trainer.world_size
        try:
            current = int(lightning_getattr(pl_module, self.batch_arg_name))  # type: ignore[arg-type]
        except AttributeError:
            raise ValueError(
                f"the module has no {self.batch_arg_name!r} attribute (nor its hparams or "
                "datamodule): give the dataloaders their batch size from one, or pass "
                "batch_arg_name"
            ) from None
        global_batch = self.global_batch_size or current * trainer.accumulate_grad_batches * world
        if global_batch % world:
            raise ValueError(
                f"global batch {global_batch} cannot be split evenly over {world} devices"
            )
        per_device = global_batch // world
        if isinstance(self.micro_batch_size, int):
            found = self.micro_batch_size
        else:
            found = self.micro_batch_size(trainer, pl_module)
            if isinstance(found, bool) or not isinstance(found, int) or found < 1:
                raise ValueError(f"the micro-batch finder returned {found!r}, not a size >= 1")
        micro = micro_batch_at_most(per_device, found)
        accum = per_device // micro
        if micro != found:
            logger.info(
                "micro-batch %d does not divide the %d samples per device; using %d",
                found,
                per_device,
                micro,
            )
        logger.info(
            "micro-batch %d x accumulation %d x %d devices = global batch %d (was %d x %d)",
            micro,
            accum,
            world,
            global_batch,
            current,
            trainer.accumulate_grad_batches,
        )
        lightning_setattr(pl_module, self.batch_arg_name, micro)
        trainer.accumulate_grad_batches = accum
        self.chosen = (micro, accum)
        _reload_dataloaders(trainer)


class NoiseScaleCallback(pl.Callback):
    """Log the gradient noise scale of the ``Accumulator`` a manual-optimization module uses.

    After every training batch that ended an optimizer step, the accumulator's latest
    ``StepResult.noise_scale`` (B_simple, in ``num_items``: tokens or samples) goes to each of
    the trainer's loggers as ``noise_scale`` at the trainer's ``global_step`` (the steps the
    accumulator's optimizer took, when it is the ``LightningOptimizer`` from
    ``self.optimizers()``), to ``logging``, and into ``history``. Nothing is logged while
    the value is None (one micro-batch per step on one rank, or too few steps yet).

    Args:
        accumulator: The ``Accumulator(..., noise_scale=True)`` the module steps with, or
            the name of the module attribute that holds it (for one built at fit start,
            once ``self.optimizers()`` exists).

    Example:
        >>> callback = NoiseScaleCallback("accumulator")  # module.accumulator  # doctest: +SKIP
        >>> trainer = pl.Trainer(callbacks=[callback])  # doctest: +SKIP
    """

    def __init__(self, accumulator: Accumulator | str = "accumulator") -> None:
        self.accumulator = accumulator
        self.history: list[tuple[int, float]] = []  # (global step, noise scale)
        self._logged_step = 0

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        source = self.accumulator
        acc = getattr(pl_module, source, None) if isinstance(source, str) else source
        if not isinstance(acc, Accumulator):
            raise ValueError(
                f"the module has no Accumulator in its {source!r} attribute: set it before "
                "the first training batch, or pass the Accumulator"
            )
        if acc.steps == self._logged_step:
            return  # this batch was not the last micro-batch of an optimizer step
        self._logged_step = acc.steps
        value = acc.noise_scale
        if value is None:
            return
        self.history.append((trainer.global_step, value))
        logger.info("step %d: gradient noise scale %.4g items", trainer.global_step, value)
        # One row per optimizer step, at its global step (LightningModule.log would key it by
        # batches and repeat it on the batches that do not step).
        for run_logger in trainer.loggers:
            run_logger.log_metrics({"noise_scale": value}, step=trainer.global_step)


class PeakMemoryCallback(pl.Callback, StepWatch):
    """Log each optimizer step's peak memory and samples/s; warn when the peak drifts.

    A step runs from the first micro-batch of an optimizer step to the batch after which
    ``trainer.global_step`` moved. On CUDA its peak is ``torch.cuda.max_memory_allocated``
    since the step began, what a plan's ``peak_bytes`` predicts (docs/design.md), beside
    ``max_memory_reserved``; on a Linux CPU the step's peak resident set (``VmHWM``, reset each
    step) above what the process held at train start besides the model: an approximation, for
    runs without a GPU. ``peak_memory_gib``, ``reserved_memory_gib`` (CUDA) and
    ``samples_per_s`` (the samples of the step's micro-batches on all devices, per second) go
    through ``LightningModule.log`` to whatever loggers the trainer has (CSV, TensorBoard, W&B),
    at its ``log_every_n_steps``. A step whose peak exceeds the expected peak by more than
    ``tolerance`` is logged as a warning (once, then again only at a new high). With a plan,
    the module is checked against the plan's model at ``setup`` (before a strategy shards it),
    and a CUDA run appends its largest step peak beside the plan's to the calibration file
    (``batchfit calibration``) when training ends, from global rank 0. A run on another GPU
    than the plan's leaves no record (one log line says why).

    Args:
        plan: A ``Plan``, or the path (``str`` or ``os.PathLike``) of the file ``batchfit
            plan ... --json`` wrote; its ``peak_bytes`` is the expected peak.
        expected_peak_bytes: The expected peak, when there is no plan.
        tolerance: Allowed excess over the expected peak, as a fraction.
        check_model: Refuse a plan whose model has another parameter count than the
            module's (more than 5% apart).

    Raises:
        ValueError: the plan was made for another model (one line naming both), or ``plan``
            is a path that is not a plan's JSON (one line naming it).

    Example:
        >>> callback = PeakMemoryCallback(expected_peak_bytes=8 * 2**30)
        >>> trainer = pl.Trainer(callbacks=[callback], logger=CSVLogger("logs"))  # doctest: +SKIP
    """

    calibration_source = "lightning-callback"

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
        self._step_at_start: int | None = None  # global_step when the open step began
        self._samples: int | None = 0  # of the open step's micro-batches on this device

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self.check_model_against_plan(pl_module)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.start_run(pl_module.device, pl_module)
        self._step_at_start = None

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._step_at_start is None:  # the first micro-batch of an optimizer step
            self._step_at_start = trainer.global_step
            self._samples = 0
            self.begin_step()
        if self._samples is not None:
            self._samples = _add_batch_size(self._samples, batch)

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if self._step_at_start is None or trainer.global_step == self._step_at_start:
            return  # a micro-batch that did not end an optimizer step
        samples = None if self._samples is None else self._samples * trainer.world_size
        self.end_step(trainer.global_step, samples)
        self._step_at_start = None
        for name, value in self.metrics().items():
            pl_module.log(name, value, on_step=True, on_epoch=False, batch_size=1)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:  # one record per run, not one per rank
            self.record_calibration()


def _add_batch_size(samples: int, batch: Any) -> int | None:
    """``samples`` plus the batch's size as Lightning infers it; None where it cannot."""
    try:
        return samples + extract_batch_size(batch)
    except (MisconfigurationException, RecursionError, TypeError):
        return None


def trainer_kwargs(plan: Plan, **overrides: Any) -> dict[str, Any]:
    """``lightning.pytorch.Trainer`` keyword arguments for ``plan`` (``export(plan, "lightning")``).

    The micro-batch is the DataLoader's ``batch_size``: ``plan.micro_batch_size``.

    Example:
        >>> from batchfit.hardware import get_gpu
        >>> from batchfit.models import resolve_model
        >>> from batchfit.plan import make_plan
        >>> from batchfit.spec import TrainingSetup
        >>> plan = make_plan(resolve_model("gpt2"), get_gpu("rtx-3060"), TrainingSetup(),
        ...                  seq_len=256, global_batch=32, micro_batch_size=8, engine="analytic")
        >>> trainer_kwargs(plan, accelerator="cpu")["accumulate_grad_batches"]
        4
    """
    return {**export(plan, "lightning")["trainer"], **overrides}


def _reload_dataloaders(trainer: pl.Trainer) -> None:
    # Lightning's BatchSizeFinder rebuilds the loaders with this (tuner/batch_size_scaling.py).
    if trainer.fit_loop._combined_loader is None:
        return  # not built yet: the fit loop builds them with the new size
    _reset_dataloaders(trainer)
