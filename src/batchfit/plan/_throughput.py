"""``plan --throughput-from PROBE.json``: the probe's measured step time in place of the model's.

``batchfit probe ... --json`` times real steps at several micro-batch sizes on the real device
and records what it ran: the model, the setup, the sequence length and the GPU
(:func:`probe_identity`). A plan for the same model, setup, sequence length and GPU reads that
file (:func:`read_probe`, :func:`bind`) and corrects the step-time model (``batchfit.speed``)
by the ratio of measured to predicted compute at the nearest measured micro-batch:

    factor(n) = measured seconds of one step at n / the model's compute seconds at n

taken on the probe's own setup. At a measured size the plan's step is the measurement (its
accumulation split as the model splits micro-steps and the optimizer update); elsewhere, and
for the alternatives (other techniques, other sizes), the model's compute times the factor at
the nearest measured size. A probe's trials run no communication and no CPU offload (a rank
runs its collectives against a fake process group, ``search/_ranks.py``), so the GPU count,
sharding and offload may differ from the probe's: their time stays the model's.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from batchfit.errors import UsageError
from batchfit.hardware import GpuSpec, catalog_gpu
from batchfit.memory.formulas.analytic import resolve_setup
from batchfit.memory.types import MemoryEstimate
from batchfit.models import ModelInfo
from batchfit.spec import TrainingSetup
from batchfit.speed import StepTime, step_time

# Setup fields that change memory only, or whose time the probe does not run and the model
# supplies (communication, offload transfers): a probe and a plan may differ in them.
_NOT_COMPARED = frozenset(
    {"num_gpus", "sharding", "offload", "keep_loss", "keep_method", "expandable_segments", "loop"}
)


# How far measured/predicted may stray before the plan says so: a step 5x off the step-time
# model (or faster than the GPU's peak) is likelier an edited file or another workload than
# the model's own error. A judgement, not a fit.
_FACTOR_LIMIT = 5.0

# setup fields whose option is not the field's name with dashes
_FLAGS = {"loss_chunks": "--loss chunks", "loss_chunk_tokens": "--loss chunk tokens"}


def probe_identity(device: str, setup: TrainingSetup) -> dict[str, Any]:
    """What ``probe --json`` records beside its trials so that a plan can check it measured
    the same thing: the setup as asked, and on CUDA the device's name and catalog GPU."""
    gpu = gpu_name = None
    if device == "cuda":
        import torch  # not at the top: a plan starts without torch

        index = torch.cuda.current_device()
        gpu_name = torch.cuda.get_device_name(index)
        gpu = catalog_gpu(gpu_name, torch.cuda.get_device_properties(index).total_memory)
    asked = {f.name: getattr(setup, f.name) for f in fields(setup)}
    return {
        "gpu": gpu,
        "gpu_name": gpu_name,
        "setup": {k: list(v) if isinstance(v, tuple) else v for k, v in asked.items()},
    }


@dataclass(frozen=True)
class ProbeFile:
    """What a plan needs from ``probe --json``: what ran, and the seconds of one real step
    (forward, backward, optimizer) at each micro-batch that was timed."""

    path: str
    model: str
    device: str
    gpu: str | None
    gpu_name: str | None
    seq_len: int
    setup: TrainingSetup
    step_seconds: dict[int, float]
    samples_per_s: dict[int, float]


def read_probe(path: str | os.PathLike[str]) -> ProbeFile:
    """Read ``probe --json``'s output; one-line UsageError when it is not one.

    Raises:
        UsageError: unreadable, not JSON, not a probe's output, or no size was timed.
    """
    name = f"--throughput-from {path}"
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise UsageError(f"cannot read {name}: {e.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UsageError(
            f"{name} is not JSON: give the output of `batchfit probe ... --json`"
        ) from None
    if not isinstance(data, dict) or not isinstance(data.get("trials"), list):
        raise UsageError(
            f"{name} is not a probe's output (no trials): give `batchfit probe ... --json`"
        )
    if not isinstance(data.get("setup"), dict) or "gpu" not in data:
        raise UsageError(
            f"{name} does not say which setup and GPU it measured (an older batchfit probe): "
            "run `batchfit probe ... --json` again"
        )
    try:
        asked: dict[str, Any] = {
            k: tuple(v) if isinstance(v, list) else v for k, v in data["setup"].items()
        }
        setup = TrainingSetup(**asked)
        size: Any = data.get("seq_len") or data.get("image_size")
        best: dict[int, float] = {}
        for t in data["trials"]:
            speed = t.get("samples_per_s")
            if t.get("ok") and speed:
                n = int(t["micro_batch_size"])
                best[n] = max(best.get(n, 0.0), float(speed))
        probe = ProbeFile(
            path=str(path),
            model=str(data["model"]),
            device=str(data["device"]),
            gpu=data["gpu"],
            gpu_name=data.get("gpu_name"),
            seq_len=int(size),
            setup=setup,
            step_seconds={n: n / s for n, s in best.items() if s > 0},
            samples_per_s=best,
        )
    except (KeyError, TypeError, ValueError, UsageError) as e:
        raise UsageError(
            f"{name} is not a probe's output ({e}): give `batchfit probe ... --json`"
        ) from None
    if not probe.step_seconds:
        raise UsageError(
            f"{name} timed no micro-batch (every trial failed or was only measured): run the "
            "probe again with --steps-per-trial 2 or more"
        )
    return probe


@dataclass(frozen=True)
class Correction:
    """The factor on the model's compute for one option, and how it was derived."""

    factor: float
    source: str

    def step_time(self, t: StepTime) -> StepTime:
        """``t`` with its compute (not its communication or offload) times ``factor``."""
        compute_micro = t.micro_seconds - t.comm_micro_seconds - t.offload_micro_seconds
        compute_step = t.optimizer_seconds - t.comm_step_seconds - t.offload_seconds
        return replace(
            t,
            micro_seconds=self.factor * compute_micro
            + t.comm_micro_seconds
            + t.offload_micro_seconds,
            optimizer_seconds=self.factor * compute_step + t.comm_step_seconds + t.offload_seconds,
        )

    def speed_json(self, estimate: MemoryEstimate, grad_accum_steps: int) -> dict[str, Any]:
        """``estimate.speed_json`` with the correction applied."""
        speed = estimate.extras.get("speed")
        if not speed:
            return estimate.speed_json(grad_accum_steps)
        return dict(self.step_time(StepTime(**speed)).to_json(grad_accum_steps))


def _compute_seconds(t: StepTime) -> float:
    """One step at accumulation 1, less what a probe's trial does not run."""
    return (
        t.step_seconds(1)
        - t.comm_micro_seconds
        - t.comm_step_seconds
        - t.offload_seconds
        - t.offload_micro_seconds
    )


@dataclass(frozen=True)
class Measured:
    """A probe file bound to a plan's model, GPU and sequence length, its match checked."""

    probe: ProbeFile
    model: ModelInfo
    gpu: GpuSpec
    seq_len: int
    setup: TrainingSetup  # the probe's, resolved on the plan's GPU
    factors: dict[int, float]  # measured over predicted compute, at each timed size

    def nearest(self, micro: int) -> int:
        """The measured size nearest ``micro`` (on a log scale; the larger on a tie)."""
        return min(self.factors, key=lambda n: (abs(_log_ratio(n, micro)), -n))

    def correction(self, setup: TrainingSetup, micro: int) -> Correction:
        """How ``setup`` at ``micro`` is timed: the measurement, or the model times the factor
        at the nearest measured size."""
        n = self.nearest(micro)
        f = self.factors[n]
        file = os.path.basename(self.probe.path)
        resolved = resolve_setup(self.model, setup, "cuda", self.gpu)
        same = _compared(resolved) == _compared(self.setup)
        if same and n == micro:
            return Correction(
                f,
                f"measured: micro-batch {n} ran at {self.probe.samples_per_s[n]:.4g} samples/s "
                f"on {self.gpu.name} ({file}); accumulation, communication and offload as "
                "the model splits them",
            )
        other = "" if same else "; this option's techniques from the model"
        return Correction(
            f,
            f"the model x {f:.3g} (measured/predicted at micro-batch {n}, the nearest the "
            f"probe timed, {file}{other})",
        )

    def corrected(self, t: StepTime, setup: TrainingSetup, micro: int) -> StepTime:
        """``t`` (``setup`` at ``micro``) with the probe's correction."""
        return self.correction(setup, micro).step_time(t)


def _log_ratio(a: int, b: int) -> float:
    return math.log(a / b)


def _compared(setup: TrainingSetup) -> dict[str, Any]:
    return {f.name: getattr(setup, f.name) for f in fields(setup) if f.name not in _NOT_COMPARED}


def _same_model(probe: ProbeFile, model: ModelInfo) -> bool:
    if probe.model == model.name:
        return True
    a, b = Path(probe.model), Path(model.name)  # a config.json (or its folder) named two ways
    return a.exists() and b.exists() and a.resolve() == b.resolve()


def bind(
    probe: ProbeFile | str | os.PathLike[str] | None,
    model: object,
    gpu: GpuSpec,
    setup: TrainingSetup,
    seq_len: int,
) -> tuple[Measured | None, str | None]:
    """``probe`` checked against the plan (model, setup, sequence length, GPU) and its factors
    computed, with a one-line warning where its steps are implausible (faster than the GPU's
    peak, or over 5x off the model) or None; (None, why) where the model has no prediction to
    correct; (None, None) without a probe.

    Raises:
        UsageError: the probe measured something else (the message names what differs), or
            the plan is for your own module (the step-time model covers catalog models).
    """
    if probe is None:
        return None, None
    if not isinstance(model, ModelInfo):
        raise UsageError(
            "throughput_from needs a catalog or config model: the step-time model it corrects "
            "does not time your own nn.Module"
        )
    if not isinstance(probe, ProbeFile):
        probe = read_probe(probe)
    name = f"--throughput-from {probe.path}"
    if not _same_model(probe, model):
        raise UsageError(f"{name} measured {probe.model}, not {model.name}: probe this model")
    if probe.seq_len != seq_len:
        raise UsageError(
            f"{name} measured sequence length {probe.seq_len}, this plan {seq_len}: probe "
            f"with --seq-len {seq_len}"
        )
    if probe.device != "cuda":
        raise UsageError(
            f"{name} was measured on the {probe.device.upper()}, this plan is for {gpu.name}: "
            "probe on that GPU (--device cuda)"
        )
    if probe.gpu != gpu.name:
        seen = f"{probe.gpu} ({probe.gpu_name})" if probe.gpu else f"{probe.gpu_name!r}"
        raise UsageError(
            f"{name} was measured on {seen}, this plan is for {gpu.name}: probe on that GPU"
            + (f" or plan with --gpu {probe.gpu}" if probe.gpu else "")
        )
    theirs = resolve_setup(model, probe.setup, "cuda", gpu)
    ours = resolve_setup(model, setup, "cuda", gpu)
    a, b = _compared(theirs), _compared(ours)
    differ = [k for k in a if a[k] != b[k]]
    if differ:
        said = ", ".join(
            f"{_FLAGS.get(k, '--' + k.replace('_', '-'))} {_shown(a[k])} (probe) vs "
            f"{_shown(b[k])} (plan)"
            for k in differ
        )
        raise UsageError(f"{name} measured another setup: {said}; probe the plan's setup")
    factors, mfus = {}, {}
    for n, seconds in sorted(probe.step_seconds.items()):
        t = step_time(model, theirs, gpu, micro_batch_size=n, seq_len=seq_len)
        if t is None or _compute_seconds(t) <= 0:
            return None, (
                f"{name} not used: the step-time model has no figure for {model.name} on "
                f"{gpu.name} to correct (image models, GPUs without peak figures)"
            )
        factors[n] = seconds / _compute_seconds(t)
        mfus[n] = t.model_flops_per_token * t.tokens_per_micro_step / (seconds * t.peak_flops)
    return Measured(probe, model, gpu, seq_len, theirs, factors), _implausible(name, factors, mfus)


def _implausible(name: str, factors: dict[int, float], mfus: dict[int, float]) -> str | None:
    """One line when a probe's steps cannot be this model's on this GPU: faster than the GPU's
    peak (MFU over 100%), or more than ``_FACTOR_LIMIT`` times off the step-time model."""
    n = max(factors, key=lambda k: (mfus[k] > 1, abs(math.log(factors[k]))))
    f, mfu = factors[n], mfus[n]
    if mfu <= 1 and 1 / _FACTOR_LIMIT <= f <= _FACTOR_LIMIT:
        return None
    return (
        f"{name}: micro-batch {n} measured {f:.3g} x the model's predicted time (implied MFU "
        f"{mfu:.0%}); a real step is rarely that far off: was the probe file edited, or did it "
        "measure something else (another model, GPU or setup)?"
    )


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return str(value)
