"""The plan as a value: what ``make_plan`` returns and ``plan --json`` prints."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from batchfit._display import html
from batchfit._units import gib
from batchfit.calibration import TimeFactor
from batchfit.lengths import LengthsSummary, sample_tokens
from batchfit.memory.types import MemoryEstimate
from batchfit.plan._estimate_args import estimate_args
from batchfit.plan._ladder import Combo
from batchfit.plan._lr_scaling import LrScaling, lr_json
from batchfit.plan._throughput import Correction
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
    # the time model at the largest micro-batch that divides the per-GPU batch (None: not
    # predicted: nothing fits, an image model, your own module)
    micro_batch_size: int = 0
    step_seconds: float | None = None
    tokens_per_s_per_gpu: float | None = None
    throughput_source: str | None = None  # --throughput-from: how the probe corrected it
    # True: the largest micro-batch fits by the trace (its figure is the trace's there) and
    # the size after it was not traced (``alternatives="lines"``): the largest may be larger
    from_lines: bool = False
    # True: not traced, the formulas put it over PRUNE_MARGIN past the card at micro-batch 1
    # (it cannot fit); its figure is theirs
    beyond_reach: bool = False

    @property
    def needs(self) -> list[str]:
        """The code its techniques need that the framework's config cannot switch on (such an
        option is never chosen; empty: the config switches every one on)."""
        return [t.needs for t in self.techniques if t.needs]

    def to_json(self) -> dict[str, Any]:
        return {
            "techniques": [t.name for t in self.techniques],
            "kinds": [t.kind for t in self.techniques],
            "needs": self.needs,
            "max_micro_batch": self.max_micro_batch,
            "device_total_bytes": self.device_total_bytes,
            "engine": self.engine,
            "from_lines": self.from_lines,
            "beyond_reach": self.beyond_reach,
            "comm_bytes_per_step": self.comm_bytes_per_step,
            "micro_batch_size": self.micro_batch_size,
            "step_seconds": self.step_seconds,
            "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "throughput_source": self.throughput_source,
        }


@dataclass(frozen=True)
class GpuCount:
    """One GPU count's plan, summarised for the table ``--num-gpus auto`` prints."""

    num_gpus: int
    fits: bool
    micro_batch_size: int
    grad_accum_steps: int
    techniques: tuple[str, ...]
    sharding: str
    step_seconds: float | None
    tokens_per_s_per_gpu: float | None
    train_seconds: float | None
    cost_usd: float | None
    efficiency: float | None = None  # per-GPU throughput over the best count's
    chosen: bool = False
    note: str = ""  # why a count has no plan (the global batch does not split over it)

    def to_json(self) -> dict[str, Any]:
        return {
            "num_gpus": self.num_gpus,
            "fits": self.fits,
            "micro_batch_size": self.micro_batch_size,
            "grad_accum_steps": self.grad_accum_steps,
            "techniques": list(self.techniques),
            "sharding": self.sharding,
            "step_seconds": self.step_seconds,
            "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "train_seconds": self.train_seconds,
            "cost_usd": self.cost_usd,
            "efficiency": self.efficiency,
            "chosen": self.chosen,
            "note": self.note,
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
    # how the LR followed the batch: the cap, Adam's betas and eps (None without --base-lr)
    lr_scaling: LrScaling | None = None
    # the training run's length (--train-tokens, or --epochs x --dataset-size) and price
    train_steps: int | None = None
    gpu_hour_price: float | None = None
    price_source: str | None = None  # "--gpu-hour-price", or the price table's entry
    # --throughput-from: the probe's correction of the step-time model (None: the model's)
    throughput: Correction | None = None
    # --num-gpus auto: every count tried (this plan's among them) and why this one
    gpu_counts: tuple[GpuCount, ...] = ()
    gpu_count_rule: str | None = None
    # --learned-time: the time model scaled by the runs recorded on this GPU
    learned_time: TimeFactor | None = None
    # --lengths: the dataset's lengths (tokens per step, the run's steps, what is timed)
    lengths: LengthsSummary | None = None

    def speed_json(self) -> dict[str, Any]:
        """The step's time (``step_seconds``, ``tokens_per_s_per_gpu``, ``mfu``, ...): the
        model's, corrected by the probe's measurements with ``--throughput-from``."""
        if self.throughput is not None:
            return self.throughput.speed_json(self.estimate, self.grad_accum_steps)
        return self.estimate.speed_json(self.grad_accum_steps)

    @property
    def per_gpu_batch(self) -> int:
        """The samples each GPU takes per optimizer step (micro-batch x accumulation)."""
        return self.global_batch_size // self.num_gpus

    @property
    def model_step_seconds(self) -> float | None:
        """The time model's step time, before ``--throughput-from`` or ``--learned-time``."""
        own: float | None = self.estimate.speed_json(self.grad_accum_steps)["model_step_seconds"]
        return own

    @property
    def step_seconds(self) -> float | None:
        step: float | None = self.speed_json()["step_seconds"]
        return step

    @property
    def train_seconds(self) -> float | None:
        """Predicted time of the whole run (``train_steps`` optimizer steps)."""
        step = self.step_seconds
        return None if step is None or self.train_steps is None else step * self.train_steps

    @property
    def cost_usd(self) -> float | None:
        """The run's price: GPU-hours times ``gpu_hour_price``."""
        run = self.train_seconds
        if run is None or self.gpu_hour_price is None:
            return None
        return run / 3600 * self.num_gpus * self.gpu_hour_price

    def candidates(self) -> list[dict[str, Any]]:
        """The plan, then the other alternatives that fit, fastest first, with the same keys.
        ``exact``: no technique changes what is learned (LoRA, 8-bit Adam, pure bf16 do);
        ``device_total_bytes`` is at ``max_micro_batch`` for an alternative (what it holds at
        its largest), at the plan's micro-batch for the plan."""
        rows = [
            {
                "techniques": [t.name for t in self.techniques],
                "exact": all(t.kind == "exact" for t in self.techniques),
                "needs": [],  # the plan chooses only what the framework's config switches on
                "micro_batch_size": self.micro_batch_size,
                "max_micro_batch": self.max_micro_batch,
                "grad_accum_steps": self.grad_accum_steps,
                "device_total_bytes": self.device_total_bytes,
                "chosen": True,
                "estimate_args": self.estimate_args(None),
                **self._timed(self.step_seconds, self.micro_batch_size),
                "throughput_source": self.throughput.source if self.throughput else None,
            }
        ]
        timed = [
            a
            for a in self.alternatives
            if a.max_micro_batch and a.micro_batch_size and a.techniques != self.techniques
        ]
        for a in sorted(timed, key=lambda a: (a.step_seconds is None, a.step_seconds or 0.0)):
            rows.append(
                {
                    "techniques": [t.name for t in a.techniques],
                    "exact": all(t.kind == "exact" for t in a.techniques),
                    "needs": a.needs,
                    "micro_batch_size": a.micro_batch_size,
                    "max_micro_batch": a.max_micro_batch,
                    "grad_accum_steps": self.per_gpu_batch // a.micro_batch_size,
                    "device_total_bytes": a.device_total_bytes,
                    "chosen": False,
                    "estimate_args": self.estimate_args(a),
                    **self._timed(a.step_seconds, a.micro_batch_size),
                    "throughput_source": a.throughput_source,
                }
            )
        return rows

    def estimate_args(self, alt: Alternative | None) -> list[str]:
        """``estimate``'s options that reproduce ``alt``'s figure at its largest micro-batch
        (the plan's at its micro-batch for None), with the accumulation the plan counted there
        (1 for the whole per-GPU batch, else from 2 up: memory is the same)."""
        if alt is None:
            setup, micro, accum = self.setup, self.micro_batch_size, self.grad_accum_steps
            engine = self.estimate.engine
        else:
            setup, micro, engine = alt.setup, max(alt.max_micro_batch, 1), alt.engine
            per_gpu = self.per_gpu_batch
            accum = 1 if micro >= per_gpu else max(2, per_gpu // micro)
        args = (self.model, self.gpu, self.seq_len, setup, micro, accum, engine)
        if self.lengths is None:
            return estimate_args(*args)
        # the same lengths, so that the step time is the plan's too
        given = [a for spec in self.lengths.specs for a in ("--lengths", spec)]
        return [*estimate_args(*args), *given, "--padding", self.lengths.padding]

    def _timed(self, step: float | None, micro: int) -> dict[str, float | None]:
        # the tokens the step computes (with dynamic padding, each micro-batch's longest)
        tokens = None
        if not self.is_image:
            tokens = self.global_batch_size * sample_tokens(self.lengths, self.seq_len, micro)
        train = None if step is None or self.train_steps is None else step * self.train_steps
        cost = None
        if train is not None and self.gpu_hour_price is not None:
            cost = train / 3600 * self.num_gpus * self.gpu_hour_price
        return {
            "step_seconds": step,
            "tokens_per_s_per_gpu": None
            if step is None or tokens is None
            else tokens / self.num_gpus / step,
            "train_seconds": train,
            "cost_usd": cost,
        }

    @property
    def is_image(self) -> bool:
        """An image model: ``seq_len`` holds the image side in pixels, not tokens."""
        return self.task == "image-classification"

    @property
    def tokens_per_step(self) -> int | None:
        """The dataset's tokens an optimizer step takes (None for an image model: it sees
        pixels); under dynamic padding the samples' mean length, padding not counted."""
        if self.is_image:
            return None
        if self.lengths is not None:
            return round(self.global_batch_size * self.lengths.tokens_per_sample)
        return self.global_batch_size * self.seq_len

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

    def __repr__(self) -> str:
        """One line: what to run and whether it fits (``str`` adds the alternatives)."""
        names = ", ".join(t.name for t in self.techniques) or "nothing extra"
        return (
            f"<Plan {self.model} on {self.num_gpus} x {self.gpu}: micro-batch "
            f"{self.micro_batch_size} x accumulation {self.grad_accum_steps} x "
            f"{self.num_gpus} GPU(s) = {self.global_batch_size}, {self.setup.precision}, "
            f"{names}; {gib(self.device_total_bytes)} of {gib(self.gpu_bytes)}"
            f"{'' if self.fits else ', does not fit'}>"
        )

    def __str__(self) -> str:
        """The plan in a few plain lines: the choice, its memory and time, the alternatives."""
        lines = [repr(self)[1:-1]]
        if self.learning_rate is not None:
            lines.append(f"learning rate {self.learning_rate:.3g} ({self.lr_rule})")
        if self.step_seconds is not None:
            lines.append(f"~{self.step_seconds:.3g} s per optimizer step")
        for a in self.alternatives:
            if a.techniques == self.techniques:
                continue
            named = ", ".join(t.name for t in a.techniques) or "nothing extra"
            largest = (
                f"largest micro-batch {a.max_micro_batch}" if a.max_micro_batch else "none fits"
            )
            lines.append(f"  alternative: {named}: {largest}")
        lines += [f"warning: {w}" for w in self.warnings]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        """Jupyter's view: the plan, its breakdown, the alternatives with their time."""
        return html("plan", self.to_json())

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
            "total_params": est.total_params,
            "trainable_params": est.trainable_params,
            "peak_bytes": self.peak_bytes,
            "reserved_bytes": est.reserved_bytes,
            "device_total_bytes": self.device_total_bytes,
            "host_bytes": est.host_bytes,
            "gpu_bytes": self.gpu_bytes,
            "headroom_bytes": self.headroom_bytes,
            "headroom_wanted_bytes": self.headroom_wanted_bytes,
            "max_micro_batch": self.max_micro_batch,
            "fits": self.fits,
            "learning_rate": self.learning_rate,
            "lr_rule": self.lr_rule,
            **lr_json(self.lr_scaling),
            "techniques": [{"name": t.name, "kind": t.kind, "why": t.why} for t in self.techniques],
            "alternatives": [
                {**a.to_json(), "estimate_args": self.estimate_args(a)} for a in self.alternatives
            ],
            "components": dict(est.components),
            "engine": est.engine,
            "setup": est.to_json()["setup"],
            "warnings": list(self.warnings),
            **self.speed_json(),
            "throughput_source": self.throughput.source if self.throughput else None,
            "learned_time": self.learned_time.to_json() if self.learned_time else None,
            # the time model's own step time, before any measured correction: what a run's
            # calibration record compares its steps with
            "model_step_seconds": self.model_step_seconds,
            "train_steps": self.train_steps,
            "train_seconds": self.train_seconds,
            "gpu_hour_price": self.gpu_hour_price,
            "price_source": self.price_source,
            "cost_usd": self.cost_usd,
            "candidates": self.candidates(),
            "gpu_counts": [c.to_json() for c in self.gpu_counts],
            "gpu_count_rule": self.gpu_count_rule,
        }
