"""``batchfit estimate MODEL -b N``: one training step's memory per GPU. This module parses and
checks the options; ``memory.estimate`` computes, ``render.estimate`` prints."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer

from batchfit import models
from batchfit._units import human_bytes
from batchfit.cli._workload import ImageSizeO, sample_size
from batchfit.cli.common import _cache_switch, _check_output, _emit_json, _warn
from batchfit.cli.options import (
    Engine,
    EngineO,
    GpuO,
    JsonO,
    LearnedTimeO,
    LengthsO,
    ModelArg,
    NoCacheO,
    PaddingO,
    SeqLenOpt,
    VerboseO,
    parse_engine,
    setup_options,
)
from batchfit.errors import UsageError
from batchfit.hardware import GpuSpec, get_gpu
from batchfit.memory.device.totals import fits_on_card
from batchfit.memory.estimate import estimate as run_estimate
from batchfit.memory.types import MemoryEstimate
from batchfit.models import ModelInfo
from batchfit.spec import TrainingSetup, check_choice
from batchfit.views import plots as _plots
from batchfit.workload import Workload

MicroBatchO = Annotated[
    int,
    typer.Option(
        "--micro-batch", "-b", help="Samples per GPU per forward/backward.", show_default=False
    ),
]
DeviceO = Annotated[
    str | None,
    typer.Option("--device", help="cpu|cuda (default cuda; --gpu implies cuda)."),
]
GradAccumO = Annotated[
    int,
    typer.Option(
        "--grad-accum", help="Accumulation steps: above 1, gradients live through forward."
    ),
]
ExplainO = Annotated[
    bool,
    typer.Option("--explain", help="Show the modules holding the most activation memory (trace)."),
]
TimelineO = Annotated[
    Path | None,
    typer.Option(
        "--timeline",
        help="PNG of memory over the traced step by category, the peak marked (a dry "
        "run of the whole model).",
    ),
]
SnapshotO = Annotated[
    Path | None,
    typer.Option(
        "--snapshot",
        help="The same allocation stream as a PyTorch memory snapshot (pickle): open it "
        "at pytorch.org/memory_viz or with python -m torch.cuda._memory_viz.",
    ),
]
CheckO = Annotated[
    bool,
    typer.Option(
        "--check",
        help="For scripts: exit 1 when the step does not fit --gpu (the same verdict as printed).",
    ),
]


@setup_options(parallel=True)
def estimate(
    model: ModelArg,
    micro_batch: MicroBatchO,
    setup: TrainingSetup,
    seq_len: SeqLenOpt = None,
    image_size: ImageSizeO = None,
    lengths: LengthsO = None,
    padding: PaddingO = None,
    device: DeviceO = None,
    gpu: GpuO = None,
    grad_accum: GradAccumO = 1,
    engine: EngineO = "trace",
    no_cache: NoCacheO = False,
    verbose: VerboseO = False,
    learned_time: LearnedTimeO = True,
    explain: ExplainO = False,
    timeline: TimelineO = None,
    snapshot: SnapshotO = None,
    check: CheckO = False,
    as_json: JsonO = False,
) -> None:
    """Estimate one training step's memory per GPU: weights, gradients, optimizer, activations."""
    # rich's tables load when a command prints, not for `batchfit --help`
    from batchfit.cli import render
    from batchfit.cli.render import estimate as show

    engine_name = _checked(device, gpu, engine, grad_accum, timeline, snapshot)
    if check and gpu is None:
        raise UsageError("--check asks whether the step fits a GPU: name one with --gpu")
    gpu_spec = get_gpu(gpu) if gpu else None
    info = models.resolve_model(model, setup.task)  # on its module: a test may stand in for it
    seq, lengths_seen = sample_size(
        info, seq_len=seq_len, image_size=image_size, lengths=lengths, padding=padding
    )
    with _cache_switch(no_cache, verbose, quiet=as_json):
        result = run_estimate(
            info,
            setup,
            workload=Workload(
                micro_batch,
                seq,
                "cpu" if device == "cpu" else "cuda",
                gpu_spec,
                grad_accum,
                lengths_seen,
            ),
            engine=engine_name,
        )
    if result.engine == "trace" and not result.is_image:  # the formulas model token models
        result = _compare_engines(result, info, setup, gpu_spec, grad_accum)
    if learned_time and gpu_spec is not None:
        result = _learned(result, info.name, gpu_spec.name, as_json)
    if timeline is not None or snapshot is not None:
        if result.engine != "trace":
            raise UsageError(
                "--timeline and --snapshot draw a dry run of the step, which this setup does "
                "not have (the analytic engine answered): drop them, or change the setup"
            )
        show.draw_timeline(result, info, gpu_spec, grad_accum, timeline, snapshot)
    if as_json:
        _emit_json(show.estimate_json(result, gpu_spec, lengths_seen))
    else:
        if lengths_seen is not None:
            render.note(lengths_seen.describe(micro_batch))
        show.estimate(result, info, gpu_spec, explain=explain)
    if (
        check
        and gpu_spec is not None
        and not fits_on_card(result.device_total_bytes, gpu_spec.memory_bytes)
    ):
        raise typer.Exit(1)


def _learned(result: MemoryEstimate, model: str, gpu: str, as_json: bool) -> MemoryEstimate:
    """``result`` with its step time scaled by the runs recorded on ``gpu``
    (``calibration.time_factor``), where it has a time and there are such runs; a calibration
    file set aside is one warning (in the JSON's ``warnings`` under ``--json``)."""
    from batchfit import calibration

    if result.speed_json()["step_seconds"] is None:
        return result
    heard: list[str] = []
    records = calibration.load(warn=heard.append if as_json else _warn)
    result = replace(result, warnings=(*heard, *result.warnings))
    learned = calibration.time_factor(records, gpu, model)
    if learned is None:
        return result
    return replace(result, extras={**result.extras, "time_factor": learned.to_json()})


def _checked(
    device: str | None,
    gpu: str | None,
    engine: str,
    grad_accum: int,
    timeline: Path | None,
    snapshot: Path | None,
) -> Engine:
    """The options checked against each other, before the model is read; the engine named."""
    if device is not None:
        check_choice("--device", device, ("cpu", "cuda"))
    if gpu is not None and device == "cpu":
        raise UsageError("--gpu and --device cpu contradict each other: drop one")
    engine_name = parse_engine(engine)
    if grad_accum < 1:
        raise UsageError(f"--grad-accum must be a positive integer, got {grad_accum}")
    for path, option in ((timeline, "--timeline"), (snapshot, "--snapshot")):
        if path is not None:
            _check_output(path, option)
    if timeline is not None:
        _plots.require("--timeline")
    return engine_name


def _compare_engines(
    traced: MemoryEstimate,
    info: ModelInfo,
    setup: TrainingSetup,
    gpu: GpuSpec | None,
    grad_accum: int,
) -> MemoryEstimate:
    """Say so when the formulas and the dry run disagree by more than 15%."""
    formulas = run_estimate(
        info,
        setup,
        micro_batch_size=traced.micro_batch_size,
        seq_len=traced.seq_len,
        device="cpu" if traced.device == "cpu" else "cuda",
        gpu=gpu,
        engine="analytic",
        grad_accum_steps=grad_accum,
    )
    gap = formulas.peak_bytes / traced.peak_bytes - 1
    if abs(gap) <= 0.15:
        return traced
    note = (
        f"the analytic engine differs from this trace by {gap:+.0%} "
        f"({human_bytes(formulas.peak_bytes)}): the trace runs the real code, trust it"
    )
    return replace(traced, warnings=(*traced.warnings, note))
