"""The plan as a value: what ``make_plan`` returns and ``plan --json`` prints."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from batchfit.memory.types import MemoryEstimate
from batchfit.plan._ladder import Combo
from batchfit.spec import TrainingSetup


@dataclass(frozen=True)
class Alternative:
    """One way to train this model on this GPU, for the table of alternatives."""

    techniques: Combo
    setup: TrainingSetup
    max_micro_batch: int  # 0 = nothing fits
    device_total_bytes: int  # at micro-batch max(1, max_micro_batch)
    engine: str = "trace"  # the one that answered: "analytic" where the trace cannot run it
    comm_bytes_per_step: int = 0  # what one GPU sends per optimizer step (speed/_comm.py)

    def to_json(self) -> dict[str, Any]:
        return {
            "techniques": [t.name for t in self.techniques],
            "kinds": [t.kind for t in self.techniques],
            "max_micro_batch": self.max_micro_batch,
            "device_total_bytes": self.device_total_bytes,
            "engine": self.engine,
            "comm_bytes_per_step": self.comm_bytes_per_step,
        }


@dataclass(frozen=True)
class Plan:
    """A complete, exact plan. ``micro x accum x GPUs == global batch`` always holds."""

    model: str
    task: str
    gpu: str
    seq_len: int
    micro_batch_size: int
    grad_accum_steps: int
    num_gpus: int
    global_batch_size: int
    setup: TrainingSetup
    estimate: MemoryEstimate
    gpu_bytes: int
    headroom_bytes: int
    headroom_wanted_bytes: int
    max_micro_batch: int
    learning_rate: float | None
    lr_rule: str | None
    techniques: Combo
    alternatives: tuple[Alternative, ...]
    warnings: tuple[str, ...]
    lora_targets: tuple[str, ...] = ()

    @property
    def is_image(self) -> bool:
        """An image model: ``seq_len`` holds the image side in pixels, not tokens."""
        return self.task == "image-classification"

    @property
    def tokens_per_step(self) -> int | None:
        """Tokens per optimizer step (None for an image model: it sees pixels)."""
        return None if self.is_image else self.global_batch_size * self.seq_len

    @property
    def peak_bytes(self) -> int:
        """Bytes held by tensors at the step's peak (``estimate.peak_bytes``)."""
        return self.estimate.peak_bytes

    @property
    def device_total_bytes(self) -> int:
        """What nvidia-smi would show for the plan's step (``estimate.device_total_bytes``)."""
        return self.estimate.device_total_bytes

    @property
    def fits(self) -> bool:
        """Whether the step leaves the headroom asked for, and at least a byte, free."""
        return self.headroom_bytes > 0 and self.headroom_bytes >= self.headroom_wanted_bytes

    def _repr_html_(self) -> str:
        """Jupyter's view: the plan, its breakdown, the alternatives with their time."""
        from batchfit._html import plan_html

        return plan_html(self.to_json())

    def to_json(self) -> dict[str, Any]:
        est = self.estimate
        return {
            "model": self.model,
            "gpu": self.gpu,
            "seq_len": None if self.is_image else self.seq_len,
            **({"image_size": self.seq_len} if self.is_image else {}),
            "micro_batch_size": self.micro_batch_size,
            "grad_accum_steps": self.grad_accum_steps,
            "num_gpus": self.num_gpus,
            "global_batch_size": self.global_batch_size,
            "tokens_per_step": self.tokens_per_step,
            "peak_bytes": self.peak_bytes,
            "reserved_bytes": est.reserved_bytes,
            "device_total_bytes": self.device_total_bytes,
            "gpu_bytes": self.gpu_bytes,
            "headroom_bytes": self.headroom_bytes,
            "headroom_wanted_bytes": self.headroom_wanted_bytes,
            "max_micro_batch": self.max_micro_batch,
            "fits": self.fits,
            "learning_rate": self.learning_rate,
            "lr_rule": self.lr_rule,
            "techniques": [{"name": t.name, "kind": t.kind, "why": t.why} for t in self.techniques],
            "alternatives": [a.to_json() for a in self.alternatives],
            "components": dict(est.components),
            "engine": est.engine,
            "setup": est.to_json()["setup"],
            "warnings": list(self.warnings),
            **est.speed_json(self.grad_accum_steps),
        }
