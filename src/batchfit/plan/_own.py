"""Your own ``nn.Module`` in the planner: its factory, its batches by size, its loss."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from batchfit._batchnorm import has_batchnorm
from batchfit.errors import UsageError
from batchfit.hardware import GpuSpec
from batchfit.memory.estimate import estimate
from batchfit.memory.types import MemoryEstimate
from batchfit.spec import TrainingSetup


@dataclass(frozen=True)
class OwnModel:
    """A model the planner knows only by running it: ``model_fn()`` builds it (on the meta
    device, as ``estimate`` does), ``batch_fn(n)`` returns the inputs of ``n`` samples and
    ``loss_fn(out, batch)`` the loss (default: ``out.loss`` or a scalar output)."""

    model_fn: Callable[[], Any]
    batch_fn: Callable[[int], Any]
    loss_fn: Callable[[Any, Any], Any] | None = None
    task: str = "custom"

    @property
    def name(self) -> str:
        return getattr(self.model_fn, "__name__", type(self.model_fn).__name__)

    def estimate(
        self, setup: TrainingSetup, gpu: GpuSpec, micro: int, accum: int
    ) -> MemoryEstimate:
        """The dry run of one step at ``micro`` samples (``accum`` micro-steps), on ``gpu``."""

        def batch() -> Any:  # estimate casts it for a pure 16-bit run
            return self.batch_fn(micro)

        try:
            return estimate(
                self.model_fn,
                setup,
                batch_fn=batch,
                loss_fn=self.loss_fn,
                device="cuda",
                gpu=gpu,
                grad_accum_steps=accum,
                engine="trace",
            )
        except ValueError as e:  # a setup the module trace cannot apply (LoRA, checkpointing)
            raise UsageError(str(e)) from e
        except RuntimeError as e:  # the module's own step failed under this setup
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UsageError(
                f"your module's step fails with precision {setup.precision}: {first}"
            ) from e

    def has_batchnorm(self) -> bool:
        import torch  # not at the top: a catalog plan starts without torch

        with torch.device("meta"):
            return has_batchnorm(self.model_fn())


def own_model(
    model_fn: Callable[[], Any],
    batch_fn: Callable[[int], Any] | None,
    loss_fn: Callable[[Any, Any], Any] | None,
) -> OwnModel:
    """Check the own-model arguments of ``make_plan`` and bundle them."""
    if not callable(model_fn) or batch_fn is None or not callable(batch_fn):
        raise UsageError(
            "make_plan(model_fn, gpu, setup, batch_fn=...): give a factory of your nn.Module "
            "and batch_fn(micro_batch_size) returning that many samples' inputs, or a model "
            "from resolve_model()"
        )
    try:
        inspect.signature(batch_fn).bind(1)
    except TypeError:
        raise UsageError(
            "batch_fn must take the number of samples: batch_fn(micro_batch_size) returns the "
            "inputs of that many samples"
        ) from None
    except ValueError:  # a builtin without a signature: let the call tell
        pass
    return OwnModel(model_fn, batch_fn, loss_fn)
