"""``batchfit gpus MODEL``: for every GPU, the largest micro-batch or what it takes to fit."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from batchfit.errors import UsageError
from batchfit.hardware import GpuSpec
from batchfit.memory.estimate import usable_engine
from batchfit.models import ModelInfo
from batchfit.plan._ladder import Combo, apply, ladder
from batchfit.plan._max_micro_batch import (
    DEFAULT_HEADROOM_BYTES,
    fits,
    max_micro_batch,
    max_micro_batch_traced,
)
from batchfit.spec import TrainingSetup


@dataclass(frozen=True)
class FitRow:
    """One GPU of ``batchfit gpus MODEL``: the largest micro-batch, or what it takes to fit."""

    gpu: GpuSpec
    precision: str
    max_micro_batch: int
    device_total_bytes: int  # at micro-batch max(1, max_micro_batch)
    techniques: Combo
    engine: str = "trace"  # the one that answered: "analytic" where the trace cannot run it
    note: str = ""  # why this GPU cannot run the setup at all (then nothing else is set)
    # the time model at the largest micro-batch, one GPU, the optimizer step spread over a
    # batch of REFERENCE_BATCH_TOKENS (None: not predicted)
    seconds_per_billion_tokens: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "gpu": self.gpu.name,
            "gpu_bytes": self.gpu.memory_bytes,
            "precision": self.precision,
            "max_micro_batch": self.max_micro_batch,
            "device_total_bytes": self.device_total_bytes,
            "techniques": [{"name": t.name, "kind": t.kind} for t in self.techniques],
            "engine": self.engine,
            "note": self.note or None,
            "seconds_per_billion_tokens": self.seconds_per_billion_tokens,
        }


def fit_table(
    model: ModelInfo,
    setup: TrainingSetup,
    gpus: list[GpuSpec],
    *,
    seq_len: int,
    headroom_bytes: int = DEFAULT_HEADROOM_BYTES,
    engine: str = "trace",
) -> list[FitRow]:
    """For every GPU: the largest micro-batch that fits, else the first ladder rung that does.

    The seed guides' "batch size by model & GPU" tables, computed by ``engine`` (the trace
    engine's figures are those ``estimate`` and ``plan`` give for the same setup).
    """
    engine = usable_engine(engine)[0]
    rows: list[FitRow] = []
    errors: list[UsageError] = []
    for gpu in gpus:
        try:
            rows.append(_row(model, setup, gpu, seq_len, headroom_bytes, engine))
        except UsageError as exc:  # this GPU cannot run the setup (torchtune QLoRA without bf16)
            errors.append(exc)
            rows.append(FitRow(gpu, "-", 0, 0, (), engine, str(exc).split(":")[0]))
    if errors and len(errors) == len(rows):
        raise errors[0]  # the setup itself is wrong, not one GPU
    return rows


def _row(
    model: ModelInfo,
    setup: TrainingSetup,
    gpu: GpuSpec,
    seq_len: int,
    headroom_bytes: int,
    engine: str,
) -> FitRow:
    """One GPU's largest micro-batch, else the first ladder rung that fits."""
    largest = max_micro_batch_traced if engine == "trace" else max_micro_batch
    chosen = setup
    techniques: Combo = ()
    best = largest(model, setup, gpu, seq_len, None, headroom_bytes)
    if best == 0:
        for combo in ladder(setup, gpu, model):
            alt = apply(setup, combo)
            best = largest(model, alt, gpu, seq_len, None, headroom_bytes)
            if best:
                chosen, techniques = alt, combo
                break
    _, est = fits(model, chosen, gpu, max(best, 1), seq_len, 1, headroom_bytes, engine)
    return FitRow(
        gpu,
        est.setup.precision,
        best,
        est.device_total_bytes,
        techniques,
        est.engine,
        seconds_per_billion_tokens=_per_billion(model, est.setup, gpu, best, seq_len),
    )


# One consistent setup per row: the optimizer step spread over a 1M-token global batch
REFERENCE_BATCH_TOKENS = 1 << 20


def _per_billion(
    model: ModelInfo, setup: TrainingSetup, gpu: GpuSpec, micro: int, seq_len: int
) -> float | None:
    """Seconds one GPU takes for a billion tokens at ``micro`` (``batchfit.speed``)."""
    if not micro or model.task == "image-classification":
        return None
    from batchfit.speed import step_time

    t = step_time(model, setup, gpu, micro_batch_size=micro, seq_len=seq_len)
    if t is None:
        return None
    per_token = t.micro_seconds / t.tokens_per_micro_step
    return 1e9 * (per_token + t.optimizer_seconds / REFERENCE_BATCH_TOKENS)
