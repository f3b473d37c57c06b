"""``batchfit plan MODEL --gpu G``: micro-batch x accumulation x GPUs for a global batch. This
module parses the options and checks them; ``plan/`` computes, ``render.plan`` prints."""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, Any

import typer

from batchfit import models
from batchfit._units import gib, parse_size
from batchfit.cli._workload import ImageSizeO, sample_size
from batchfit.cli.batch_size import parse_tokens
from batchfit.cli.common import _cache_switch, _check_output, _emit_json
from batchfit.cli.options import (
    Engine,
    EngineO,
    Headroom,
    JsonO,
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
from batchfit.memory.estimate import check_workload
from batchfit.models import ModelInfo
from batchfit.plan import Plan, ProbeFile, make_plan, make_plan_auto, parse_betas, read_probe
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
    max_gpus: MaxGpusO = 8,
    report: ReportO = None,
    as_json: JsonO = False,
    num_gpus_auto: bool = False,
) -> None:
    """Plan micro-batch x accumulation x GPUs that hit a global batch exactly, and what fits."""
    run_tokens = _check_options(max_gpus, num_gpus_auto, export_kind, out, report, train_tokens)
    inputs = _plan_inputs(
        model,
        gpu,
        setup,
        _Sample(seq_len, image_size, lengths, padding),
        engine=engine,
        headroom=headroom,
        run=_RunLength(run_tokens, epochs, dataset_size, gpu_hour_price),
        global_batch_tokens=global_batch_tokens,
        micro_batch=micro_batch,
        throughput_from=throughput_from,
    )
    with _cache_switch(no_cache, verbose) as stage:
        planner = (
            functools.partial(make_plan_auto, max_gpus=max_gpus, progress=stage)
            if num_gpus_auto
            else make_plan
        )
        result = planner(
            inputs.info,
            inputs.gpu,
            setup,
            seq_len=inputs.seq_len,
            global_batch=global_batch,
            global_batch_tokens=global_batch_tokens,
            micro_batch_size=micro_batch,
            base_lr=base_lr,
            base_batch=base_batch,
            base_batch_tokens=base_batch_tokens,
            base_betas=parse_betas(base_betas),
            base_eps=base_eps,
            critical_batch=critical_batch,
            critical_batch_tokens=critical_batch_tokens,
            train_tokens=run_tokens,
            train_samples=inputs.train_samples,
            gpu_hour_price=gpu_hour_price,
            throughput_from=inputs.probe_file,
            headroom_bytes=inputs.headroom_bytes,
            engine=inputs.engine,
        )
    _answer(inputs.with_headroom_note(result), inputs, export_kind, out, report, as_json)


def _check_options(
    max_gpus: int,
    num_gpus_auto: bool,
    export_kind: str | None,
    out: Path | None,
    report: Path | None,
    train_tokens: str | None,
) -> int | None:
    """The options that go together, and the outputs, checked before anything runs; the
    run's tokens (``--train-tokens``) parsed."""
    # the exports load when `plan` runs, not for `batchfit --help`
    from batchfit.export import EXPORT_KINDS

    if max_gpus != 8 and not num_gpus_auto:
        raise UsageError("--max-gpus goes with --num-gpus auto")
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
class _RunLength:
    """The run's length (--train-tokens, or --epochs over --dataset-size) and its price."""

    tokens: int | None
    epochs: float | None
    dataset_size: int | None
    gpu_hour_price: float | None


@dataclass(frozen=True)
class _PlanInputs:
    """What the planner takes beyond the options passed through as given."""

    info: ModelInfo
    gpu: GpuSpec
    seq_len: int
    lengths: LengthsSummary | None
    engine: Engine
    train_samples: int | None
    headroom_bytes: int
    headroom_note: str | None
    probe_file: ProbeFile | None

    def with_headroom_note(self, result: Plan) -> Plan:
        """The plan with ``--headroom auto``'s figure and reason as its first warning."""
        if self.headroom_note is None:
            return result
        return replace(result, warnings=(self.headroom_note, *result.warnings))


def _plan_inputs(
    model: str,
    gpu: str,
    setup: TrainingSetup,
    sample: _Sample,
    *,
    engine: str,
    headroom: str,
    run: _RunLength,
    global_batch_tokens: int | None,
    micro_batch: int | None,
    throughput_from: Path | None,
) -> _PlanInputs:
    """The plan's inputs, looked up and checked in the order the errors must come.

    Plan rules (they belong with the planner's request; the rest is looking up the engine,
    the GPU, the model, the sample size and the probe file):

    - a price needs the run's length (--train-tokens, or --epochs with --dataset-size);
    - --epochs and --dataset-size go together, --epochs is positive;
    - epochs x dataset size, rounded up, is the run's length in samples;
    - --headroom auto is the calibration records' 99th percentile for the GPU, as a share
      of its memory, with a note saying so;
    - the headroom is less than the GPU's memory;
    - --global-batch-tokens counts tokens: not for an image model, nor with dynamic padding;
    - the workload (micro-batch, sample size) is one the model can take.
    """
    if run.gpu_hour_price and run.gpu_hour_price > 0 and run.tokens is None and run.epochs is None:
        raise UsageError(
            "--gpu-hour-price prices the run: give its length too (--train-tokens N, or "
            "--epochs E --dataset-size N)"
        )
    if (run.epochs is None) != (run.dataset_size is None):
        raise UsageError("--epochs and --dataset-size go together (the run's length in samples)")
    if run.epochs is not None and not run.epochs > 0:
        raise UsageError(f"--epochs must be positive, got {run.epochs}")
    train_samples = None
    if run.epochs is not None and run.dataset_size is not None:
        train_samples = math.ceil(run.epochs * run.dataset_size)
    engine_name = parse_engine(engine)
    gpu_spec = get_gpu(gpu)
    headroom_bytes, headroom_note = _headroom(headroom, gpu_spec)
    if headroom_bytes >= gpu_spec.memory_bytes:
        raise UsageError(
            f"--headroom {headroom} is all of {gpu_spec.name}'s "
            f"{gib(gpu_spec.memory_bytes)}: keep less free, e.g. 0.5GiB"
        )
    info = models.resolve_model(model, setup.task)  # on its module: a test may stand in for it
    seq, lengths_seen = sample_size(
        info,
        seq_len=sample.seq_len,
        image_size=sample.image_size,
        lengths=sample.lengths,
        padding=sample.padding,
    )
    if global_batch_tokens and info.task == "image-classification":
        raise UsageError(
            f"--global-batch-tokens counts tokens; {info.name} sees images: give --global-batch"
        )
    if lengths_seen is not None and lengths_seen.padding == "longest" and global_batch_tokens:
        raise UsageError(
            "--global-batch-tokens needs a fixed number of tokens per sample, and with dynamic "
            "padding (--padding longest) a step's tokens vary: give --global-batch in samples, "
            "or --padding packed (or max) with --seq-len"
        )
    check_workload(info, micro_batch or 1, seq)
    probe_file = read_probe(throughput_from) if throughput_from is not None else None
    return _PlanInputs(
        info,
        gpu_spec,
        seq,
        lengths_seen,
        engine_name,
        train_samples,
        headroom_bytes,
        headroom_note,
        probe_file,
    )


def _headroom(headroom: str, gpu: GpuSpec) -> tuple[int, str | None]:
    """``--headroom``: a size, or ``auto`` from the calibration records (with its note)."""
    if headroom.strip().lower() != "auto":
        return parse_size(headroom, what="--headroom", allow_zero=True), None
    # the calibration records load for --headroom auto only
    from batchfit import calibration

    records = calibration.load(
        warn=lambda message: typer.echo(f"batchfit: warning: {message}", err=True)
    )
    auto = calibration.auto_headroom(records, gpu.name)
    headroom_bytes = int(auto.fraction * gpu.memory_bytes)
    note = (
        f"--headroom auto: {auto.fraction:.1%} of {gib(gpu.memory_bytes)} = "
        f"{gib(headroom_bytes)} ({auto.why})"
    )
    return headroom_bytes, note


def _answer(
    result: Plan,
    inputs: _PlanInputs,
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
        extra = {"lengths": lengths.to_json()} if lengths is not None else {}
        _emit_json({**result.to_json(), "exports": {**exports, "launch": launch}, **extra})
        return
    # an export without --out is stdout's only text (`--export deepspeed > ds.json`):
    # the plan goes to stderr then
    alone = export_kind is not None and out is None
    with render.on_stderr() if alone else contextlib.nullcontext():
        if lengths is not None:
            render.note(lengths.describe())
        show.plan(result, inputs.info)
        render.note(f"launch: {launch}")
    if alone:
        print(export_text)
    elif export_kind is not None:
        show.export_note(export_kind, out, export_text)


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
        return dict(write_export(result, export_kind, out)), None
    data = export(result, export_kind)
    return {export_kind: data}, render_export(data, export_kind)
