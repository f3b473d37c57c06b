"""``MemoryEstimate``: the value every engine returns; printing is the CLI's job."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from batchfit._display import html
from batchfit.spec import TrainingSetup
from batchfit.speed import StepTime

COMPONENTS = ("weights", "gradients", "optimizer_state", "activations", "other")


@dataclass(frozen=True)
class Line:
    """One row of the accounting: a component's part, its bytes, and the formula with numbers."""

    component: str
    label: str
    num_bytes: int
    formula: str


@dataclass(frozen=True)
class MemoryEstimate:
    """What one training step needs on one GPU (or the CPU), in bytes.

    ``components`` are taken at the moment of the peak, so they add up to ``peak_bytes``.
    ``reserved_bytes`` adds what the caching allocator keeps; ``device_total_bytes`` adds the
    CUDA context and communication buffers (what nvidia-smi shows). ``host_bytes`` is CPU RAM
    that offload needs, per GPU process.
    """

    model: str
    engine: str
    device: str
    micro_batch_size: int
    seq_len: int
    setup: TrainingSetup
    components: dict[str, int]
    peak_bytes: int
    reserved_bytes: int
    device_total_bytes: int
    total_params: int
    trainable_params: int
    peak_phase: str
    host_bytes: int = 0
    activation_peak_bytes: int = 0  # activations at their own peak (start of backward)
    lines: tuple[Line, ...] = ()
    warnings: tuple[str, ...] = ()
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def counted(self) -> tuple[float, ...] | None:
        """What its dry run counted for each sample in a micro-step (FLOPs forward and
        backward, then the other operators' bytes forward and backward): the step time's
        inputs for an image model or your own module; None where no dry run counted."""
        figures = self.extras.get("flops_per_sample")
        return tuple(float(f) for f in figures) if figures else None

    @property
    def is_image(self) -> bool:
        """An image model's step: ``seq_len`` holds the image side in pixels."""
        return self.setup.task == "image-classification"

    def to_json(self) -> dict[str, Any]:
        """The JSON contract of docs/design.md (keys may be added, never renamed)."""
        return {
            "model": self.model,
            "engine": self.engine,
            "device": self.device,
            "micro_batch_size": self.micro_batch_size,
            "seq_len": None if self.is_image else self.seq_len,
            **({"image_size": self.seq_len} if self.is_image else {}),
            "peak_bytes": self.peak_bytes,
            "reserved_bytes": self.reserved_bytes,
            "device_total_bytes": self.device_total_bytes,
            "components": dict(self.components),
            "total_params": self.total_params,
            "trainable_params": self.trainable_params,
            "peak_phase": self.peak_phase,
            "host_bytes": self.host_bytes,
            "activation_peak_bytes": self.activation_peak_bytes,
            "setup": {
                k: (list(v) if isinstance(v, tuple) else v) for k, v in self.setup.__dict__.items()
            },
            "breakdown": [
                {
                    "component": ln.component,
                    "label": ln.label,
                    "bytes": ln.num_bytes,
                    "formula": ln.formula,
                }
                for ln in self.lines
            ],
            "warnings": list(self.warnings),
            "top_modules": [
                {"module": name, "activation_bytes": num_bytes}
                for name, num_bytes in self.extras.get("top_modules", [])
            ],
            "notes": list(self.extras.get("notes", [])),
            **self.speed_json(),
            # --learned-time: what the runs on this GPU measured against the time model
            "learned_time": self.extras.get("time_factor"),
        }

    def _repr_html_(self) -> str:
        """Jupyter's view: the breakdown, a bar of the components, the predicted time."""
        return html("estimate", self.to_json())

    def speed_json(self, grad_accum_steps: int | None = None) -> dict[str, float | None]:
        """``step_seconds`` (one optimizer step: ``grad_accum_steps`` micro-steps, by default
        the accumulation the estimate was made for), ``tokens_per_s_per_gpu``, ``mfu`` (None
        where not predicted)."""
        speed = self.extras.get("speed")
        if not speed:
            return dict.fromkeys(
                (
                    "step_seconds",
                    "tokens_per_s_per_gpu",
                    "mfu",
                    "comm_seconds",
                    "offload_seconds",
                    "model_step_seconds",
                )
            )

        if grad_accum_steps is None:
            grad_accum_steps = int(self.extras.get("grad_accum_steps", 1))
        out: dict[str, float | None] = dict(StepTime(**speed).to_json(grad_accum_steps))
        out["model_step_seconds"] = out["step_seconds"]  # the time model's own figure
        learned = self.extras.get("time_factor")
        if learned:  # scaled by what runs measured on this GPU (``calibration.time_factor``)
            factor = float(learned["factor"])
            out["step_seconds"] = (out["step_seconds"] or 0) * factor
            out["tokens_per_s_per_gpu"] = (out["tokens_per_s_per_gpu"] or 0) / factor
            out["mfu"] = (out["mfu"] or 0) / factor
        return out
