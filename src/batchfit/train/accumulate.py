"""``Accumulator``: gradient accumulation that gives exactly the full-batch step.

Each micro-step back-propagates a loss *sum* and says how many items (tokens, samples, or a
weight sum) it covered. Gradients accumulate as raw sums; before the optimizer step they are
rescaled once by 1 / (items in the whole global batch, across micro-steps and ranks). That is
the gradient of the global batch's mean loss, whatever the split: dividing each micro-batch's
loss by its own item count instead is the 2024 Transformers accumulation bug
(``num_items_in_batch``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from batchfit.train import _dist, _fsdp
from batchfit.train._checks import check_positive_int
from batchfit.train._results import MicroStep, NumItems, StepResult
from batchfit.train._stepmath import (
    CLIP_EPS,
    StepPeak,
    check_items,
    global_sums,
    scale_,
    total_norm,
)
from batchfit.train.noise import DEFAULT_EMA, NoiseScaleMeter

__all__ = ["Accumulator", "MicroStep", "NumItems", "StepResult"]

logger = logging.getLogger(__name__)


class Accumulator:
    """Exact gradient accumulation: ``grad_accum_steps`` micro-steps, then one optimizer step.

    The optimizer step runs as the last micro-step's ``with`` block closes: rescale the summed
    gradients by 1 / global item count, unscale (GradScaler) once, clip, step, advance the
    scheduler unless the scaler skipped the step, zero the gradients (``set_to_none``).

    Under ``DistributedDataParallel`` the first ``grad_accum_steps - 1`` micro-steps run in
    ``model.no_sync()``; the last one's backward all-reduces the summed gradients (DDP averages
    them over ranks, which the rescale undoes), and the item counts and loss sums are summed
    over the ranks, so the step equals one step on the whole global batch of all ranks.

    Under FSDP2 (a model ``fully_shard`` was applied to) the first ``grad_accum_steps - 1``
    micro-steps run with ``set_requires_gradient_sync(False)`` and
    ``set_reshard_after_backward(False)`` (FSDP2's recipe: gradients accumulate unsharded and
    the next forward needs no all-gather); the last one reduce-scatters and reshards. The
    module's own flags are put back after every micro-step. Gradients and the clipping norm
    are DTensors: the norm is the global one, over every rank's shard. Item counts and loss
    sums are summed over the group the parameters are sharded over. A ``GradScaler`` is not
    supported under FSDP2 (its inf check would see one shard per rank): use bf16.

    An exception inside a micro-step drops the partial global step (gradients and counts), so
    nothing of it leaks into the next one. For the same reason construction clears the
    model's gradients.

    Args:
        model: The model, or its DDP wrapper (pass the wrapper: it is what ``no_sync`` needs),
            or the root module of an FSDP2 model (the one ``fully_shard`` was applied to last).
        optimizer: Steps once per global batch.
        grad_accum_steps: Micro-steps per optimizer step on each rank.
        scaler: A ``torch.amp.GradScaler`` for fp16: its scale stays fixed within a global
            step and ``unscale_`` runs once, before clipping.
        scheduler: Stepped after every optimizer step the scaler did not skip.
        max_grad_norm: Clip the global gradient to this L2 norm.
        noise_scale: Measure the gradient noise scale B_simple (``StepResult.noise_scale``,
            :mod:`batchfit.train.noise`): a hook per parameter takes the squared norm of each
            micro-batch's gradient before it is accumulated, the step adds the global
            gradient norm, and the sums ride on the step's existing all-reduce. Needs at
            least two micro-batches per global step over all ranks.
        noise_scale_ema: Weight of the past in the running averages of tr(Σ) and |G|²
            (0.95: about the last 20 steps).

    Example:
        >>> import torch
        >>> import torch.nn.functional as F
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <torch._C.Generator object at ...>
        >>> model = torch.nn.Linear(4, 3)
        >>> acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1),
        ...                   grad_accum_steps=2)
        >>> x, y = torch.randn(6, 4), torch.tensor([0, 1, 2, 0, 1, 2])
        >>> for xs, ys in ((x[:4], y[:4]), (x[4:], y[4:])):  # 4 + 2 samples, one step
        ...     with acc.micro_step() as micro:
        ...         loss_sum = F.cross_entropy(model(xs), ys, reduction="sum")
        ...         acc.backward(loss_sum, num_items=len(ys))
        >>> micro.result.num_items, micro.result.micro_steps
        (6.0, 2)
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        grad_accum_steps: int = 1,
        *,
        scaler: torch.amp.GradScaler | None = None,
        scheduler: Any | None = None,
        max_grad_norm: float | None = None,
        noise_scale: bool = False,
        noise_scale_ema: float = DEFAULT_EMA,
    ) -> None:
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(
                f"max_grad_norm must be positive, got {max_grad_norm!r}; pass None not to clip"
            )
        self.model = model
        self.optimizer = optimizer
        self.scaler = scaler
        self.scheduler = scheduler
        self.max_grad_norm = max_grad_norm
        self.steps = 0  # optimizer steps taken, skipped ones included
        self._ddp = _dist.ddp_of(model)
        self._fsdp = _fsdp.root_of(model)
        if self._fsdp is not None and scaler is not None:
            raise ValueError(
                "a GradScaler under FSDP2 is not supported: its inf/nan check would see one "
                "gradient shard per rank and the ranks could disagree on skipping; train in "
                "bf16 (MixedPrecisionPolicy(param_dtype=torch.bfloat16)) without a scaler"
            )
        self._group: dist.ProcessGroup | None = None
        if self._ddp is not None:
            self._group = self._ddp.process_group
        elif self._fsdp is not None:
            self._group = _fsdp.group_of(self._fsdp)
        self._averaged_over = 1  # ranks the deferred gradient sync averaged over
        self._held = False  # deferred() holds FSDP2's parameters unsharded
        self._batchnorm = any(
            isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules()
        )
        self._warned_batchnorm = False
        self._defer = False  # deferred(): the caller syncs and steps
        self._open = False
        self._backward_called = False
        self._done = 0
        self._losses: list[torch.Tensor] = []
        self._items_float = 0.0
        self._items_tensors: list[torch.Tensor] = []
        self._k = 1
        self.grad_accum_steps = grad_accum_steps
        self.last_result: StepResult | None = None  # the latest optimizer step's
        self._step_began = time.perf_counter()
        self._peak: StepPeak | None = None
        params = [p for group in optimizer.param_groups for p in group["params"]]
        self._noise = NoiseScaleMeter(model, params, noise_scale_ema) if noise_scale else None
        # Gradients left from before would be summed into the first step.
        self.model.zero_grad(set_to_none=True)

    @property
    def grad_accum_steps(self) -> int:
        """Micro-steps per optimizer step; may change between global steps (epoch tails)."""
        return self._k

    @grad_accum_steps.setter
    def grad_accum_steps(self, value: int) -> None:
        check_positive_int(
            "grad_accum_steps",
            value,
            meaning="micro-batches per optimizer step",
            fix="use 1 for no accumulation",
        )
        if self._done or self._open:
            raise RuntimeError(
                f"grad_accum_steps changed in the middle of a global step ({self._done} of "
                f"{self._k} micro-steps done): change it between optimizer steps"
            )
        self._k = value
        if value > 1 and self._batchnorm and not self._warned_batchnorm:
            self._warned_batchnorm = True
            logger.warning(
                "the model has BatchNorm: its statistics come from each micro-batch, not the "
                "global batch, so accumulation does not make them exact"
            )

    @property
    def noise_scale(self) -> float | None:
        """The smoothed gradient noise scale so far (``StepResult.noise_scale``); None when
        not measured or not yet defined."""
        return None if self._noise is None else self._noise.value

    @property
    def micro_steps_done(self) -> int:
        """Micro-steps finished in the current global step."""
        return self._done

    @property
    def ddp(self) -> DistributedDataParallel | None:
        """The model's ``DistributedDataParallel`` wrapper; None when the model is not one."""
        return self._ddp

    @property
    def fsdp(self) -> torch.nn.Module | None:
        """The model when it is an FSDP2 module (``fully_shard`` applied); else None."""
        fsdp: torch.nn.Module | None = self._fsdp
        return fsdp

    @property
    def is_distributed(self) -> bool:
        """True under DDP or FSDP2: counts, losses and OOM flags are combined over ranks."""
        return self._ddp is not None or self._fsdp is not None

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The ranks the global batch spans (None: the default group, or not distributed)."""
        return self._group

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """Hold back the gradient sync and the optimizer step, for a caller that ends the step.

        Inside the block no micro-step runs a collective, so a rank can still abandon the
        step, and the last one does not step. Under DDP every micro-step runs in
        ``no_sync()``. Under FSDP2 the block all-gathers every module's parameters as it
        opens and keeps them unsharded, with gradients accumulating unsynced, until
        :meth:`reduce_gradients` (memory: unsharded parameters and gradients, as under DDP);
        the module's flags are put back as it closes, and a step left unfinished is dropped
        and resharded. The caller calls :meth:`reduce_gradients` on every rank (or, under
        DDP, sums the gradients itself or leaves them per rank), then :meth:`finish`, before
        the block ends. ``MicroBatcher`` runs each attempt at a global batch this way, so
        that all ranks agree on an OOM first.

        Example:
            >>> model = torch.nn.Linear(2, 1)
            >>> acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
            >>> with acc.deferred():
            ...     with acc.micro_step() as micro:
            ...         acc.backward(model(torch.ones(3, 2)).sum(), num_items=3)
            ...     print(micro.result)  # the last micro-step did not step
            ...     result = acc.finish()
            None
            >>> result.micro_steps, result.num_items
            (1, 3.0)
        """
        if self._defer or self._open:
            raise RuntimeError(
                "deferred() inside deferred() or inside a micro_step() block: enter it once, "
                "before the global step's first micro-step"
            )
        self._defer = True
        self._averaged_over = 1
        try:
            if self._fsdp is None:
                yield
            else:
                with _fsdp.restoring_flags(self._fsdp):
                    self._held = True
                    try:
                        _fsdp.hold_unsharded(self._fsdp)
                        yield
                    finally:
                        if self._held:
                            # Left before reduce_gradients(): drop the partial step and
                            # reshard, with no collective (the OOM path).
                            self._held = False
                            _fsdp.abandon(self._fsdp)
        finally:
            self._defer = False

    def reduce_gradients(self) -> None:
        """Inside :meth:`deferred`, after the last micro-step: combine the gradients over
        the ranks (DDP: summed in buckets; FSDP2: reduce-scattered and resharded). Every rank
        calls it; :meth:`finish` then steps on the global batch's gradient.
        """
        if not self._defer or self._open:
            raise RuntimeError(
                "reduce_gradients() belongs inside deferred(), between micro-steps: "
                "outside it the last micro-step's backward syncs by itself"
            )
        if self._fsdp is not None:
            _fsdp.reduce_gradients(self._fsdp)
            self._held = False
            self._averaged_over = _dist.world_size(self._group)
        elif self._ddp is not None:
            _dist.sum_grads(self._ddp.parameters(), self._group)
            self._averaged_over = 1

    @contextlib.contextmanager
    def micro_step(self) -> Iterator[MicroStep]:
        """One micro-batch: run the forward pass and ``backward`` inside the block.

        Under DDP the forward pass must run inside the block too: DDP decides at forward time
        whether the backward will sync.

        Yields:
            The micro-step's place in the global step; its ``result`` is set when it was the
            last one and the optimizer stepped.
        """
        if self._open:
            raise RuntimeError(
                "micro_step() is already open: micro-steps do not nest; close the first "
                "`with acc.micro_step():` block before starting the next"
            )
        handle = MicroStep(index=self._done, is_last=self._done + 1 == self._k)
        if self._done == 0:
            self._step_began = time.perf_counter()
            self._peak = StepPeak.begin(self._device())
        self._open, self._backward_called = True, False
        finished = False
        try:
            with self._sync_context(handle.is_last and not self._defer):
                yield handle
            finished = True
        finally:
            self._open = False
            if not finished:
                # Under deferred() the caller (MicroBatcher) logs the failure and the redo.
                logger.log(
                    logging.DEBUG if self._defer else logging.INFO,
                    "dropping the partial global step (%d of %d micro-steps done): a "
                    "micro-step raised",
                    self._done,
                    self._k,
                )
                self.discard()
        if not self._backward_called:
            self.discard()
            raise RuntimeError(
                "a micro_step() block ended without acc.backward(loss_sum, num_items): call it "
                "once per block (a micro-batch without items passes num_items=0)"
            )
        self._done += 1
        if handle.is_last and not self._defer:
            handle.result = self.finish()

    @contextlib.contextmanager
    def _sync_context(self, sync: bool) -> Iterator[None]:
        """No gradient sync in this micro-step's backward unless ``sync``."""
        if self._ddp is not None and not sync:
            with self._ddp.no_sync():
                yield
        elif self._fsdp is not None and not self._defer:
            with _fsdp.restoring_flags(self._fsdp):
                _fsdp.set_sync(self._fsdp, sync)
                yield
        else:  # deferred FSDP2 holds its flags for the whole block
            yield

    def backward(self, loss_sum: torch.Tensor, num_items: NumItems) -> None:
        """Back-propagate a micro-batch's loss sum, counting the items it covers.

        Args:
            loss_sum: The micro-batch's loss summed over its items (``reduction="sum"``),
                not averaged.
            num_items: Items behind ``loss_sum``: tokens, samples, or the sum of the weights
                of a weighted loss. An int, a float or a one-element tensor (a tensor is
                checked at the step, without a device sync now). 0 is allowed: a micro-batch
                of padding must still run so DDP ranks stay in step.
        """
        if not self._open:
            raise RuntimeError(
                "acc.backward() was called outside `with acc.micro_step():`; open a micro-step "
                "first, so the accumulator knows when the global step ends"
            )
        if self._backward_called:
            raise RuntimeError(
                "more backward calls than micro-steps: acc.backward() runs once per "
                f"micro_step() (grad_accum_steps={self._k}); add the losses into one sum first"
            )
        if not isinstance(loss_sum, torch.Tensor) or loss_sum.numel() != 1:
            raise ValueError(
                "loss_sum must be a one-element tensor: reduce the per-item losses with "
                "reduction='sum'"
            )
        count = check_items(num_items)
        scaled = loss_sum if self.scaler is None else self.scaler.scale(loss_sum)
        if self._noise is None:
            scaled.backward()  # type: ignore[no-untyped-call, unused-ignore]
        else:
            with self._noise.counting():
                scaled.backward()  # type: ignore[no-untyped-call, unused-ignore]
            self._noise.end_micro_step(count)
        self._backward_called = True
        self._losses.append(loss_sum.detach())
        if isinstance(count, torch.Tensor):
            self._items_tensors.append(count)
        else:
            self._items_float += count

    def discard(self) -> None:
        """Drop the partial global step: gradients (set to None), loss and item sums.

        Optimizer, scheduler and scaler are untouched: they only move at a completed step.
        Under FSDP2 the unsharded gradients go too, and FSDP2's per-iteration state is reset
        (``reset_iter_state``), with no collective.
        """
        if self._fsdp is not None:
            _fsdp.abandon(self._fsdp)
        self.model.zero_grad(set_to_none=True)
        self.optimizer.zero_grad(set_to_none=True)
        self._reset()

    def finish(self) -> StepResult:
        """Step the optimizer on what the micro-steps so far accumulated.

        ``micro_step()`` calls this as the last micro-step closes; call it yourself only to
        end a global step early (the item counts keep it exact; under DDP every rank must
        call it, and the gradients were not synced unless the last micro-step was).
        """
        if self._open:
            raise RuntimeError("finish() inside a micro_step() block: close the block first")
        if not self._done:
            raise RuntimeError("finish() before any micro-step: nothing to step on")
        try:
            return self._step()
        finally:
            self.optimizer.zero_grad(set_to_none=True)
            self._reset()

    def _reset(self) -> None:
        self._done = 0
        self._backward_called = False
        self._losses = []
        self._items_float = 0.0
        self._items_tensors = []
        if self._noise is not None:
            self._noise.reset_step()

    def _step(self) -> StepResult:
        loss, items, noise_sums = global_sums(
            self._losses,
            self._items_tensors,
            self._items_float,
            self._noise,
            self._group,
            self.is_distributed,
        )
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        # The hooks saw scaled gradients; the scale is fixed within the step.
        loss_scale = 1.0 if self.scaler is None else float(self.scaler.get_scale())
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        grads = [p.grad for p in params if p.grad is not None]
        # Native DDP / FSDP2 sync averaged the summed gradients over the ranks; undo that too.
        if self._defer:
            ranks = self._averaged_over
        else:
            ranks = _dist.world_size(self._group) if self.is_distributed else 1
        factor = ranks / items
        grad_norm = total_norm(grads) * factor
        scale = factor
        if self.max_grad_norm is not None and grad_norm > self.max_grad_norm:
            # torch.nn.utils.clip_grad_norm_'s coefficient, folded into the one rescale.
            scale *= self.max_grad_norm / (grad_norm + CLIP_EPS)
        scale_(grads, scale)
        noise_scale = None
        if self._noise is not None and noise_sums is not None:
            small_sq_sum, items_sq_sum = noise_sums
            noise_scale = self._noise.update(
                small_sq_sum / loss_scale**2, items_sq_sum, items, grad_norm
            )
        learning_rate = float(self.optimizer.param_groups[0]["lr"])
        skipped = False
        if self.scaler is None:
            self.optimizer.step()
        else:
            # A skipped step lowers the scale (accelerate's optimizer.py does the same test).
            scale_before = self.scaler.get_scale()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            skipped = self.scaler.get_scale() < scale_before
        if skipped:
            logger.warning(
                "inf/nan gradients: the GradScaler skipped optimizer step %d", self.steps
            )
        elif self.scheduler is not None:
            self.scheduler.step()
        seconds = time.perf_counter() - self._step_began
        peak, reserved = self._peak.read() if self._peak is not None else (None, None)
        result = StepResult(
            loss=loss / items,
            grad_norm=grad_norm,
            num_items=items,
            skipped=skipped,
            micro_steps=self._done,
            learning_rate=learning_rate,
            noise_scale=noise_scale,
            seconds=seconds,
            peak_bytes=peak,
            reserved_bytes=reserved,
            items_per_s=items / seconds if seconds > 0 else None,
        )
        self.steps += 1
        self.last_result = result
        return result

    def _device(self) -> torch.device:
        first = next(self.model.parameters(), None)
        return first.device if first is not None else torch.device("cpu")
