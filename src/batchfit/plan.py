"""Plan: global batch -> micro-batch x accumulation x GPUs, exactly; the LR; what makes it fit."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from batchfit._units import BYTES_IN_GIB
from batchfit.errors import UsageError
from batchfit.hardware import GpuSpec
from batchfit.memory.estimate import estimate
from batchfit.memory.types import MemoryEstimate
from batchfit.models import ModelInfo
from batchfit.spec import ADAM_FAMILY, TrainingSetup

DEFAULT_HEADROOM_BYTES = BYTES_IN_GIB // 2
MAX_QUIET_ACCUM = 64


@dataclass(frozen=True)
class Technique:
    """A rung of the ladder: ``exact`` ones change nothing about what is learned."""

    name: str
    kind: str  # exact | changes-training
    why: str


@dataclass(frozen=True)
class Alternative:
    """One way to train this model on this GPU, for the table of alternatives."""

    techniques: tuple[Technique, ...]
    setup: TrainingSetup
    max_micro_batch: int  # 0 = nothing fits
    device_total_bytes: int  # at micro-batch max(1, max_micro_batch)


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
    techniques: tuple[Technique, ...]
    alternatives: tuple[Alternative, ...]
    warnings: tuple[str, ...]
    lora_targets: tuple[str, ...] = ()
    exports: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.seq_len

    def to_json(self) -> dict[str, Any]:
        est = self.estimate
        return {
            "model": self.model,
            "gpu": self.gpu,
            "seq_len": self.seq_len,
            "micro_batch_size": self.micro_batch_size,
            "grad_accum_steps": self.grad_accum_steps,
            "num_gpus": self.num_gpus,
            "global_batch_size": self.global_batch_size,
            "tokens_per_step": self.tokens_per_step,
            "peak_bytes": est.peak_bytes,
            "reserved_bytes": est.reserved_bytes,
            "device_total_bytes": est.device_total_bytes,
            "gpu_bytes": self.gpu_bytes,
            "headroom_bytes": self.headroom_bytes,
            "headroom_wanted_bytes": self.headroom_wanted_bytes,
            "max_micro_batch": self.max_micro_batch,
            "fits": self.headroom_bytes >= self.headroom_wanted_bytes,
            "learning_rate": self.learning_rate,
            "lr_rule": self.lr_rule,
            "techniques": [{"name": t.name, "kind": t.kind, "why": t.why} for t in self.techniques],
            "alternatives": [
                {
                    "techniques": [t.name for t in a.techniques],
                    "kinds": [t.kind for t in a.techniques],
                    "max_micro_batch": a.max_micro_batch,
                    "device_total_bytes": a.device_total_bytes,
                }
                for a in self.alternatives
            ],
            "components": dict(est.components),
            "engine": est.engine,
            "setup": est.to_json()["setup"],
            "warnings": list(self.warnings),
            "exports": dict(self.exports),
        }


def scale_learning_rate(
    base_lr: float, base_batch: int, global_batch: int, optimizer: str
) -> tuple[float, str]:
    """Scale a learning rate tuned at ``base_batch`` to ``global_batch``.

    Linear for SGD (Goyal et al. 2017), square root for Adam-family optimizers (Malladi et al.
    2022); both hold only below the critical batch size.

    Example:
        >>> scale_learning_rate(1e-4, 256, 1024, "adamw")[0]
        0.0002
        >>> scale_learning_rate(0.1, 256, 1024, "sgd")[0]
        0.4
    """
    if base_lr <= 0 or base_batch <= 0:
        raise UsageError("--base-lr and --base-batch must be positive")
    ratio = global_batch / base_batch
    if optimizer in ADAM_FAMILY:
        return base_lr * math.sqrt(ratio), (
            f"square-root scaling for {optimizer} (Malladi et al. 2022): "
            f"{base_lr:g} x sqrt({global_batch}/{base_batch})"
        )
    return base_lr * ratio, (
        f"linear scaling for {optimizer} (Goyal et al. 2017): "
        f"{base_lr:g} x {global_batch}/{base_batch}"
    )


def samples_from_target(
    global_batch: int | None, global_batch_tokens: int | None, seq_len: int, num_gpus: int
) -> int:
    """The global batch in samples; exact or a UsageError naming the nearest reachable ones."""
    if (global_batch is None) == (global_batch_tokens is None):
        raise UsageError("give exactly one of --global-batch (samples) or --global-batch-tokens")
    if global_batch is not None:
        if global_batch < 1:
            raise UsageError(f"--global-batch must be positive, got {global_batch}")
        if global_batch % num_gpus:
            raise UsageError(
                f"--global-batch {global_batch} cannot be split evenly over {num_gpus} GPUs; "
                f"nearest reachable: {_nearest(global_batch, num_gpus)}"
            )
        return global_batch
    assert global_batch_tokens is not None  # exactly one was given (checked above)
    if global_batch_tokens < 1:
        raise UsageError(f"--global-batch-tokens must be positive, got {global_batch_tokens}")
    unit = seq_len * num_gpus
    if global_batch_tokens % unit:
        raise UsageError(
            f"--global-batch-tokens {global_batch_tokens} is not a multiple of seq-len x GPUs "
            f"= {unit}; nearest reachable: {_nearest(global_batch_tokens, unit)} tokens"
        )
    return global_batch_tokens // seq_len


def _nearest(value: int, unit: int) -> str:
    lo = value // unit * unit
    options = [v for v in (lo, lo + unit) if v > 0]
    return " or ".join(f"{v:,}" for v in options)


def _fits(
    model: ModelInfo,
    setup: TrainingSetup,
    gpu: GpuSpec,
    micro: int,
    seq_len: int,
    accum: int,
    headroom: int,
    engine: str = "analytic",
) -> tuple[bool, MemoryEstimate]:
    est = estimate(
        model,
        setup,
        micro_batch_size=micro,
        seq_len=seq_len,
        device="cuda",
        gpu=gpu,
        grad_accum_steps=accum,
        engine=engine,  # type: ignore[arg-type]
    )
    return gpu.memory_bytes - est.device_total_bytes >= headroom, est


def max_micro_batch(
    model: ModelInfo,
    setup: TrainingSetup,
    gpu: GpuSpec,
    seq_len: int,
    per_gpu_batch: int | None,
    headroom: int,
) -> int:
    """Largest micro-batch that fits (0 if even 1 does not), searching up to ``per_gpu_batch``.

    Memory grows with the micro-batch, so doubling then bisecting finds the boundary.
    """
    cap = per_gpu_batch or 1 << 16

    def ok(m: int) -> bool:
        accum = (per_gpu_batch // m) if per_gpu_batch else 1
        return _fits(model, setup, gpu, m, seq_len, max(accum, 1), headroom)[0]

    if not ok(1):
        return 0
    lo, hi = 1, 2
    while hi <= cap and ok(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, cap + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def max_micro_batch_traced(
    model: ModelInfo,
    setup: TrainingSetup,
    gpu: GpuSpec,
    seq_len: int,
    per_gpu_batch: int,
    headroom: int,
) -> int:
    """Largest micro-batch by the trace engine: an affine fit over traced sizes, confirmed."""
    from batchfit.memory.fit import fit_micro_batch

    def at(m: int) -> MemoryEstimate:
        accum = max(per_gpu_batch // m, 1)
        return _fits(model, setup, gpu, m, seq_len, min(accum, 2), headroom, "trace")[1]

    return fit_micro_batch(at, gpu.memory_bytes - headroom, limit=per_gpu_batch).micro_batch_size


def ladder(setup: TrainingSetup, gpu: GpuSpec) -> list[tuple[Technique, ...]]:
    """Technique combinations, exact ones first, cheapest in time first (DESIGN.md)."""
    ckpt = Technique("gradient-checkpointing", "exact", "recompute each layer in backward")
    rungs: list[tuple[Technique, ...]] = []
    if not setup.grad_ckpt:
        rungs.append((ckpt,))
    base = () if setup.grad_ckpt else (ckpt,)
    if setup.num_gpus > 1 and setup.sharding in ("none", "ddp"):
        for stage in ("zero1", "zero2", "zero3"):
            rungs.append((*base, Technique(stage, "exact", f"shard across {setup.num_gpus} GPUs")))
    if setup.offload == "none" and setup.method != "qlora":
        rungs.append(
            (
                *base,
                Technique("zero2", "exact", "ZeRO-Offload needs ZeRO"),
                Technique("offload-optimizer", "exact", "optimizer state in CPU RAM"),
            )
        )
        rungs.append(
            (
                *base,
                Technique("zero3", "exact", "parameter offload needs ZeRO-3"),
                Technique(
                    "offload-optimizer+params", "exact", "optimizer state and weights in CPU RAM"
                ),
            )
        )
    changing = []
    if setup.optimizer in ("adam", "adamw"):
        changing.append(Technique("adamw-8bit", "changes-training", "8-bit optimizer states"))
    if setup.precision not in ("bf16",) and gpu.bf16 and setup.method == "full":
        changing.append(
            Technique("pure-bf16", "changes-training", "bf16 weights and states, no fp32 master")
        )
    for tech in changing:
        rungs.append((*base, tech))
    if len(changing) == 2:
        rungs.append((*base, *changing))
    if setup.method == "full":
        rungs.append((*base, Technique("lora", "changes-training", "train low-rank adapters")))
    if setup.method != "qlora" and setup.precision != "fp32":
        rungs.append(
            (*base, Technique("qlora", "changes-training", "4-bit frozen base + adapters"))
        )
    return rungs


def apply(setup: TrainingSetup, techniques: tuple[Technique, ...], gpu: GpuSpec) -> TrainingSetup:
    """The setup with the techniques switched on."""
    out = setup
    for tech in techniques:
        name = tech.name
        if name == "gradient-checkpointing":
            out = replace(out, grad_ckpt=True)
        elif name in ("zero1", "zero2", "zero3"):
            out = replace(out, sharding=name)  # type: ignore[arg-type]
        elif name == "offload-optimizer":
            out = replace(out, offload="optimizer")
        elif name == "offload-optimizer+params":
            out = replace(out, offload="optimizer+params")
        elif name == "adamw-8bit":
            out = replace(out, optimizer="adamw-8bit")
        elif name == "pure-bf16":
            out = replace(out, precision="bf16")
        elif name == "lora":
            out = replace(out, method="lora")
        elif name == "qlora":
            # QLoRA computes in 16-bit: bf16 where the GPU has it, fp16 otherwise.
            precision = out.precision
            if precision in ("auto", "fp32"):
                precision = "amp-bf16" if gpu.bf16 else "amp-fp16"
            out = replace(
                out,
                method="qlora",
                precision=precision,
                sharding="none" if out.sharding in ("zero3", "fsdp") else out.sharding,
                offload="none",
            )
    return out


def make_plan(
    model: ModelInfo,
    gpu: GpuSpec,
    setup: TrainingSetup,
    *,
    seq_len: int,
    global_batch: int | None = None,
    global_batch_tokens: int | None = None,
    micro_batch_size: int | None = None,
    base_lr: float | None = None,
    base_batch: int | None = None,
    headroom_bytes: int = DEFAULT_HEADROOM_BYTES,
    engine: str = "analytic",
) -> Plan:
    """Plan micro-batch, accumulation and techniques that hit the global batch exactly.

    Example:
        >>> from batchfit.models import resolve_model
        >>> from batchfit.hardware import get_gpu
        >>> p = make_plan(resolve_model("gpt2"), get_gpu("rtx-3060"), TrainingSetup(),
        ...               seq_len=256, global_batch_tokens=32768, micro_batch_size=16)
        >>> p.micro_batch_size, p.grad_accum_steps, p.tokens_per_step
        (16, 8, 32768)
    """
    n_gpus = setup.num_gpus
    global_samples = samples_from_target(global_batch, global_batch_tokens, seq_len, n_gpus)
    if base_batch is not None and global_batch_tokens is not None:
        target = global_batch_tokens  # --base-batch is in the unit of the target
    else:
        target = global_samples
    per_gpu = global_samples // n_gpus
    warnings: list[str] = []
    if micro_batch_size is not None:
        if micro_batch_size < 1:
            raise UsageError(f"--micro-batch must be positive, got {micro_batch_size}")
        if per_gpu % micro_batch_size:
            raise UsageError(
                f"--micro-batch {micro_batch_size} does not divide the {per_gpu} samples each "
                f"GPU takes per step; try {_divisors_near(per_gpu, micro_batch_size)}"
            )

    if engine == "trace":
        base_max = max_micro_batch_traced(model, setup, gpu, seq_len, per_gpu, headroom_bytes)
    else:
        base_max = max_micro_batch(model, setup, gpu, seq_len, per_gpu, headroom_bytes)
    chosen_setup, best = setup, base_max
    techniques: tuple[Technique, ...] = ()
    alternatives: list[Alternative] = []
    needs_ladder = base_max == 0 or (micro_batch_size is not None and micro_batch_size > base_max)
    for combo in ladder(setup, gpu):
        alt_setup = apply(setup, combo, gpu)
        alt_max = max_micro_batch(model, alt_setup, gpu, seq_len, per_gpu, headroom_bytes)
        _, alt_est = _fits(
            model,
            alt_setup,
            gpu,
            max(alt_max, 1),
            seq_len,
            max(per_gpu // max(alt_max, 1), 1),
            headroom_bytes,
        )
        alternatives.append(Alternative(combo, alt_setup, alt_max, alt_est.device_total_bytes))
        wanted = micro_batch_size or 1
        if needs_ladder and not techniques and alt_max >= wanted:
            chosen_setup, techniques, best = alt_setup, combo, alt_max
    if best == 0:
        warnings.append(
            f"nothing fits on {gpu.name}, with or without the techniques on the ladder: "
            "more GPUs (--num-gpus with --sharding zero3), a shorter --seq-len or a smaller "
            "model are needed; the figures below show by how much it misses"
        )
    elif micro_batch_size is not None and micro_batch_size > best:
        warnings.append(
            f"--micro-batch {micro_batch_size} does not fit even with the ladder's techniques; "
            f"{best} is the largest that fits"
            + (f" (with {', '.join(t.name for t in techniques)})" if techniques else "")
        )
    micro = micro_batch_size or _largest_divisor_at_most(per_gpu, max(best, 1))
    accum = per_gpu // micro
    if engine == "trace" and techniques:
        best = max_micro_batch_traced(model, chosen_setup, gpu, seq_len, per_gpu, headroom_bytes)
        micro = micro_batch_size or _largest_divisor_at_most(per_gpu, max(best, 1))
        accum = per_gpu // micro
    _, est = _fits(model, chosen_setup, gpu, micro, seq_len, accum, headroom_bytes, engine)

    lr, rule = None, None
    if (base_lr is None) != (base_batch is None):
        raise UsageError(
            "give --base-lr and --base-batch together (the LR was tuned at that batch)"
        )
    if base_lr is not None and base_batch is not None:
        lr, rule = scale_learning_rate(base_lr, base_batch, target, chosen_setup.optimizer)
    if accum > MAX_QUIET_ACCUM:
        warnings.append(
            f"{accum} accumulation steps: each optimizer step runs {accum} "
            "forward/backward passes; more GPUs would shorten it"
        )
    if chosen_setup.resolved(device="cuda", bf16_supported=gpu.bf16).precision in (
        "fp16",
        "amp-fp16",
    ):
        warnings.append(
            "fp16 needs a GradScaler (loss scaling); bf16 does not"
            + ("" if gpu.bf16 else f" but {gpu.name} has no bf16")
        )
    if any("batchnorm" in g.module.lower() for g in model.params) and micro < 16:
        warnings.append(
            f"BatchNorm statistics come from each micro-batch of {micro}, not the "
            "global batch: accumulation does not make them exact"
        )
    return Plan(
        model=model.name,
        task=model.task,
        gpu=gpu.name,
        seq_len=seq_len,
        micro_batch_size=micro,
        grad_accum_steps=accum,
        num_gpus=n_gpus,
        global_batch_size=global_samples,
        setup=est.setup,
        estimate=est,
        gpu_bytes=gpu.memory_bytes,
        headroom_bytes=gpu.memory_bytes - est.device_total_bytes,
        headroom_wanted_bytes=headroom_bytes,
        max_micro_batch=best,
        learning_rate=lr,
        lr_rule=rule,
        techniques=techniques,
        alternatives=tuple(alternatives),
        warnings=tuple(dict.fromkeys((*est.warnings, *warnings))),
        lora_targets=(chosen_setup.lora_targets or model.default_lora_targets())
        if chosen_setup.is_lora
        else (),
    )


def _largest_divisor_at_most(n: int, limit: int) -> int:
    """Largest divisor of ``n`` not above ``limit``, so accumulation stays an integer."""
    for d in range(min(n, limit), 0, -1):
        if n % d == 0:
            return d
    return 1


def _divisors_near(n: int, around: int) -> str:
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    divisors.sort(key=lambda d: abs(d - around))
    return ", ".join(str(d) for d in sorted(divisors[:3]))


@dataclass(frozen=True)
class FitRow:
    """One GPU of ``batchfit gpus MODEL``: the largest micro-batch, or what it takes to fit."""

    gpu: GpuSpec
    precision: str
    max_micro_batch: int
    device_total_bytes: int  # at micro-batch max(1, max_micro_batch)
    techniques: tuple[Technique, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "gpu": self.gpu.name,
            "gpu_bytes": self.gpu.memory_bytes,
            "precision": self.precision,
            "max_micro_batch": self.max_micro_batch,
            "device_total_bytes": self.device_total_bytes,
            "techniques": [{"name": t.name, "kind": t.kind} for t in self.techniques],
        }


def fit_table(
    model: ModelInfo,
    setup: TrainingSetup,
    gpus: list[GpuSpec],
    *,
    seq_len: int,
    headroom_bytes: int = DEFAULT_HEADROOM_BYTES,
) -> list[FitRow]:
    """For every GPU: the largest micro-batch that fits, else the first ladder rung that does.

    The seed guides' "batch size by model & GPU" tables, computed.
    """
    rows = []
    for gpu in gpus:
        chosen = setup
        techniques: tuple[Technique, ...] = ()
        best = max_micro_batch(model, setup, gpu, seq_len, None, headroom_bytes)
        if best == 0:
            for combo in ladder(setup, gpu):
                alt = apply(setup, combo, gpu)
                best = max_micro_batch(model, alt, gpu, seq_len, None, headroom_bytes)
                if best:
                    chosen, techniques = alt, combo
                    break
        _, est = _fits(model, chosen, gpu, max(best, 1), seq_len, 1, headroom_bytes)
        rows.append(FitRow(gpu, est.setup.precision, best, est.device_total_bytes, techniques))
    return rows
