"""``batchfit plan MODEL --gpu G``: micro-batch x accumulation x GPUs for a global batch. This
module parses the options into a ``PlanRequest``, whose checks are the plan's rules
(``plan/request.py``); ``plan/`` computes, ``render.plan`` prints."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, Any, Literal, cast

import typer

from batchfit import models
from batchfit.cli._workload import ImageSizeO, sample_size
from batchfit.cli.batch_size import parse_tokens
from batchfit.cli.common import _cache_switch, _check_output, _emit_json, _warn
from batchfit.cli.options import (
    Engine,
    EngineO,
    Headroom,
    JsonO,
    LearnedTimeO,
    LengthsO,
    ModelArg,
    NoCacheO,
    PaddingO,
    SeqLenOpt,
    VerboseO,
    finite_float,
    parse_engine,
    setup_options,
)
from batchfit.errors import UsageError
from batchfit.hardware import GpuSpec, get_gpu
from batchfit.lengths import LengthsSummary
from batchfit.models import ModelInfo
from batchfit.plan import (
    DEFAULT_MAX_GPUS,
    Plan,
    PlanRequest,
    make_plan,
    parse_betas,
    read_probe,
)
from batchfit.plan.request import ALTERNATIVES
from batchfit.spec import TrainingSetup, check_choice

GpuArg = Annotated[
    str, typer.Option("--gpu", help="Catalog GPU (`batchfit gpus`).", show_default=False)
]
GlobalBatchO = Annotated[
    int | None, typer.Option("--global-batch", help="Target global batch in samples.")
]
GlobalBatchTokensO = Annotated[
    int | None, typer.Option("--global-batch-tokens", help="Target global batch in tokens.")
]
MicroBatchO = Annotated[
    int | None,
    typer.Option(
        "--micro-batch", "-b", help="Fix the micro-batch instead of the largest that fits."
    ),
]
BaseLrO = Annotated[
    float | None,
    typer.Option("--base-lr", help="Learning rate tuned at --base-batch.", parser=finite_float),
]
BaseBatchO = Annotated[
    int | None, typer.Option("--base-batch", help="Batch --base-lr was tuned at, in samples.")
]
BaseBatchTokensO = Annotated[
    int | None,
    typer.Option("--base-batch-tokens", help="Batch --base-lr was tuned at, in tokens."),
]
BaseBetasO = Annotated[
    str,
    typer.Option(
        "--base-betas",
        help="Adam's betas at the base batch: the plan offers the rescaled ones.",
    ),
]
BaseEpsO = Annotated[
    float, typer.Option("--base-eps", help="Adam's eps at the base batch.", parser=finite_float)
]
CriticalBatchO = Annotated[
    int | None,
    typer.Option(
        "--critical-batch",
        help="Critical batch in samples (e.g. StepResult.noise_scale measured by "
        "Accumulator(noise_scale=True)): the LR stops growing there.",
    ),
]
CriticalBatchTokensO = Annotated[
    int | None, typer.Option("--critical-batch-tokens", help="Critical batch in tokens.")
]
ExportO = Annotated[str | None, typer.Option("--export", help="hf|deepspeed|accelerate|lightning")]
OutO = Annotated[
    Path | None, typer.Option("--out", help="The one file --export writes (default: print it).")
]
TrainTokensO = Annotated[
    str | None,
    typer.Option(
        "--train-tokens",
        help="Tokens of the whole run (20B, 2e10 or 20000000000): adds its time (and cost).",
    ),
]
EpochsO = Annotated[
    float | None,
    typer.Option("--epochs", help="Passes over --dataset-size samples: the run's length."),
]
DatasetSizeO = Annotated[
    int | None, typer.Option("--dataset-size", help="Samples per epoch (with --epochs).")
]
GpuHourPriceO = Annotated[
    float | None,
    typer.Option(
        "--gpu-hour-price",
        help="Dollars per GPU-hour: the run's cost (with --train-tokens or --epochs). "
        "Default: the catalog's approximate on-demand list price for the GPU, with its "
        "source and date (none for GPUs without one).",
        parser=finite_float,
    ),
]
ThroughputFromO = Annotated[
    Path | None,
    typer.Option(
        "--throughput-from",
        help="`batchfit probe ... --json` output for this model, setup, --seq-len and GPU: "
        "its measured steps replace the step-time model's (the nearest measured size's "
        "measured/predicted ratio where the plan's size was not measured).",
    ),
]
MaxGpusO = Annotated[
    int,
    typer.Option(
        "--max-gpus", help="With --num-gpus auto: the most GPUs tried (1, 2, 4, ... and it)."
    ),
]
AlternativesO = Annotated[
    str | None,
    typer.Option(
        "--alternatives",
        help="lines|traced: each alternative's largest micro-batch traced from the formulas' "
        "size until one fits that the traced slope says is the last (marked ≥: the next size "
        "is not traced; the chosen one is confirmed), or each confirmed at its size and the "
        "next as the choice is (slower). Default: lines, traced with --report. Either way an "
        "option the formulas put over 25% past the card is not traced (marked (formulas)).",
    ),
]
ReportO = Annotated[
    Path | None,
    typer.Option(
        "--report",
        help="One self-contained HTML page (no network): the plan, its breakdown, the "
        "traced step's timeline and the alternatives.",
    ),
]


@setup_options(parallel=True, auto_gpus=True)
def plan(
    model: ModelArg,
    gpu: GpuArg,
    setup: TrainingSetup,
    seq_len: SeqLenOpt = None,
    image_size: ImageSizeO = None,
    lengths: LengthsO = None,
    padding: PaddingO = None,
    global_batch: GlobalBatchO = None,
    global_batch_tokens: GlobalBatchTokensO = None,
    micro_batch: MicroBatchO = None,
    base_lr: BaseLrO = None,
    base_batch: BaseBatchO = None,
    base_batch_tokens: BaseBatchTokensO = None,
    base_betas: BaseBetasO = "0.9,0.999",
    base_eps: BaseEpsO = 1e-8,
    critical_batch: CriticalBatchO = None,
    critical_batch_tokens: CriticalBatchTokensO = None,
    headroom: Headroom = "0.5GiB",
    engine: EngineO = "trace",
    no_cache: NoCacheO = False,
    verbose: VerboseO = False,
    export_kind: ExportO = None,
    out: OutO = None,
    train_tokens: TrainTokensO = None,
    epochs: EpochsO = None,
    dataset_size: DatasetSizeO = None,
    gpu_hour_price: GpuHourPriceO = None,
    throughput_from: ThroughputFromO = None,
    learned_time: LearnedTimeO = True,
    max_gpus: MaxGpusO = DEFAULT_MAX_GPUS,
    report: ReportO = None,
    alternatives: AlternativesO = None,
    as_json: JsonO = False,
    num_gpus_auto: bool = False,
) -> None:
    """Plan micro-batch x accumulation x GPUs that hit a global batch exactly, and what fits."""
    run_tokens = _check_outputs(export_kind, out, report, train_tokens)
    looked_up = _look_up(model, gpu, setup, engine, _Sample(seq_len, image_size, lengths, padding))
    request = PlanRequest(
        looked_up.info,
        looked_up.gpu,
        setup,
        global_batch=global_batch,
        global_batch_tokens=global_batch_tokens,
        seq_len=seq_len if looked_up.lengths is None else None,  # --lengths truncates at it
        image_size=image_size,
        lengths=looked_up.lengths,
        num_gpus="auto" if num_gpus_auto else None,
        # the option's default stands for "not given": --max-gpus 8 alone is no mistake
        max_gpus=None if max_gpus == DEFAULT_MAX_GPUS else max_gpus,
        micro_batch_size=micro_batch,
        base_lr=base_lr,
        base_batch=base_batch,
        base_batch_tokens=base_batch_tokens,
        base_betas=parse_betas(base_betas),
        base_eps=base_eps,
        critical_batch=critical_batch,
        critical_batch_tokens=critical_batch_tokens,
        headroom_bytes=headroom,
        engine=looked_up.engine,
        alternatives=_alternatives(alternatives, report),
        train_tokens=run_tokens,
        epochs=epochs,
        dataset_size=dataset_size,
        gpu_hour_price=gpu_hour_price,
        throughput_from=read_probe(throughput_from) if throughput_from is not None else None,
        learned_time=learned_time,
    )
    # under --json a calibration file set aside is said in the JSON's warnings, as the rest
    heard: list[str] = []
    with _cache_switch(no_cache, verbose, quiet=as_json) as stage:
        result = make_plan(request, progress=stage, warn=heard.append if as_json else _warn)
    if heard:
        result = replace(result, warnings=(*heard, *result.warnings))
    _answer(result, looked_up, export_kind, out, report, as_json)


def _alternatives(given: str | None, report: Path | None) -> Literal["lines", "traced"]:
    """--alternatives as given; by default traced for the report (it shows each alternative's
    figure), from the lines otherwise."""
    mode = given or ("traced" if report is not None else "lines")
    return cast(Literal["lines", "traced"], check_choice("--alternatives", mode, ALTERNATIVES))


def _check_outputs(
    export_kind: str | None, out: Path | None, report: Path | None, train_tokens: str | None
) -> int | None:
    """The export and the files it and the report write, checked before anything runs; the
    run's tokens (``--train-tokens``) parsed."""
    # the exports load when `plan` runs, not for `batchfit --help`
    from batchfit.export import EXPORT_KINDS

    if export_kind is not None:
        check_choice("--export", export_kind, EXPORT_KINDS)
    if out is not None:
        if export_kind is None:
            raise UsageError("--out needs --export KIND")
        _check_output(out, "--out")
    if report is not None:
        _check_output(report, "--report")
    return None if train_tokens is None else parse_tokens(train_tokens)


@dataclass(frozen=True)
class _Sample:
    """The options that size one sample: --seq-len, --image-size, --lengths, --padding."""

    seq_len: int | None
    image_size: int | None
    lengths: list[str] | None
    padding: str | None


@dataclass(frozen=True)
class _LookedUp:
    """What the options name, looked up: the model, the GPU, the engine, the dataset's
    lengths (read from --lengths)."""

    info: ModelInfo
    gpu: GpuSpec
    engine: Engine
    lengths: LengthsSummary | None


def _look_up(model: str, gpu: str, setup: TrainingSetup, engine: str, sample: _Sample) -> _LookedUp:
    """The engine, the GPU and the model by name, and the --lengths files read; the plan's
    rules are ``PlanRequest``'s (``plan/request.py``)."""
    engine_name = parse_engine(engine)
    gpu_spec = get_gpu(gpu)
    info = models.resolve_model(model, setup.task)  # on its module: a test may stand in for it
    _, lengths_seen = sample_size(
        info,
        seq_len=sample.seq_len,
        image_size=sample.image_size,
        lengths=sample.lengths,
        padding=sample.padding,
    )
    return _LookedUp(info, gpu_spec, engine_name, lengths_seen)


def _answer(
    result: Plan,
    inputs: _LookedUp,
    export_kind: str | None,
    out: Path | None,
    report: Path | None,
    as_json: bool,
) -> None:
    """The exports and the report written, then the plan printed (or its JSON)."""
    # the exports and rich's tables load when a plan is printed, not for `batchfit --help`
    from batchfit.cli import render
    from batchfit.cli.render import plan as show
    from batchfit.export import export_caveats, launch_command

    exports, export_text = _exports(result, export_kind, out)
    if report is not None:
        show.write_report(result, inputs.info, inputs.gpu, report)
    launch = launch_command(result, export_kind, str(out) if out is not None else None)
    if export_kind is not None:
        caveats = export_caveats(result, export_kind)
        result = replace(result, warnings=(*result.warnings, *caveats))
    lengths = inputs.lengths
    if as_json:
        extra = {}
        if lengths is not None:
            extra = {"lengths": lengths.to_json(result.micro_batch_size)}
        _emit_json({**result.to_json(), "exports": {**exports, "launch": launch}, **extra})
        return
    # an export without --out is stdout's only text (`--export deepspeed > ds.json`):
    # the plan goes to stderr then
    alone = export_kind is not None and out is None
    with render.on_stderr() if alone else contextlib.nullcontext():
        if lengths is not None:
            render.note(lengths.describe(result.micro_batch_size))
        show.plan(result, inputs.info)
        render.note(f"launch: {launch}")
    if alone:
        print(export_text)


def _exports(
    result: Plan, export_kind: str | None, out: Path | None
) -> tuple[dict[str, Any], str | None]:
    """Write the export to ``out`` (that file only) or return its text: (JSON field, text)."""
    # the exports load when a plan is exported, not for `batchfit --help`
    from batchfit.export import export, write_export
    from batchfit.export import render as render_export

    if export_kind is None:
        return {}, None
    if out is not None:
        written = dict(write_export(result, export_kind, out))
        from batchfit.cli import render

        render.wrote(out, f"the {export_kind} export")
        return written, None
    data = export(result, export_kind)
    return {export_kind: data}, render_export(data, export_kind)
