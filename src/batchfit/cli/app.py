"""Commands: estimate, plan, models, gpus, probe. Compute lives in the library and the probe
layer (``search/_probe.py``); this file parses options and checks them before anything runs."""

from __future__ import annotations

import contextlib
import functools
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, cast, get_args

import typer

from batchfit._units import gib, human_bytes, parse_size
from batchfit.cli._workload import ImageSizeO, sample_size
from batchfit.cli.options import finite_float, setup_options
from batchfit.errors import UsageError
from batchfit.spec import TrainingSetup, check_choice

if TYPE_CHECKING:
    from batchfit.hardware import GpuSpec
    from batchfit.memory.types import MemoryEstimate
    from batchfit.models import ModelInfo
    from batchfit.plan import Plan

Engine = Literal["analytic", "trace"]
ENGINES: tuple[str, ...] = get_args(Engine)

app = typer.Typer(
    name="batchfit",
    help="What a training step needs, the micro-batch that fits, and exact accumulation plans.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


ModelArg = Annotated[
    str,
    typer.Argument(
        help="Catalog name (gpt2, llama-3.1-8b, ...), hub id, path to a config.json or its folder, "
        "or a bare size such as 7B.",
        show_default=False,
    ),
]
SeqLenOpt = Annotated[
    int | None,
    typer.Option(
        "--seq-len",
        "-s",
        help="Tokens per sample (with --lengths: the truncation, padding or pack length).",
        show_default=False,
    ),
]
LengthsO = Annotated[
    list[str] | None,
    typer.Option(
        "--lengths",
        help="A dataset's sequence lengths: one per line, or a JSON {length: samples}; "
        "FILE:WEIGHT and repeated for a multi-task mixture.",
        show_default=False,
    ),
]
PaddingO = Annotated[
    str | None,
    typer.Option(
        "--padding",
        help="longest (default: each micro-batch padded to its longest sample) | max (to "
        "--seq-len) | packed (rows of --seq-len): with --lengths.",
        show_default=False,
    ),
]
JsonO = Annotated[bool, typer.Option("--json", help="Print one JSON object, nothing else.")]
GpuO = Annotated[
    str | None,
    typer.Option("--gpu", help="Catalog GPU (`batchfit gpus`): implies --device cuda."),
]
Headroom = Annotated[
    str,
    typer.Option(
        "--headroom",
        help="Free memory to keep on the GPU, e.g. 1GiB; auto (plan): the 99th percentile of "
        "`batchfit calibration`'s records.",
    ),
]


def _engine(value: str) -> Engine:
    return cast(Engine, check_choice("--engine", value, ENGINES))


EngineO = Annotated[
    str,
    typer.Option(
        "--engine",
        help="trace (default: a dry run of the real step on fake tensors; the analytic engine "
        "answers, and says so, without torch) | analytic (formulas, no torch import)",
    ),
]
NoCacheO = Annotated[
    bool,
    typer.Option(
        "--no-cache",
        help="Trace again instead of reading dry-run results cached on disk (user cache dir).",
    ),
]


VerboseO = Annotated[
    bool,
    typer.Option(
        "--verbose",
        "-v",
        help="Notes on the trace cache (unreadable or unwritable files it skipped).",
    ),
]


@contextlib.contextmanager
def _cache_switch(no_cache: bool, verbose: bool = False) -> Iterator[Callable[[str], None]]:
    """The trace cache off for this command when --no-cache is given, its notes on stderr
    with --verbose; each dry run shown as progress on a terminal (they take seconds). Yields
    the function that names the stage the dry runs belong to (shown before each)."""
    import logging

    from batchfit import _cache
    from batchfit.cli import render
    from batchfit.memory.trace import estimate as _trace_estimate

    with contextlib.ExitStack() as stack:
        if no_cache:
            stack.enter_context(_cache.disabled())
        if verbose:
            handler = logging.StreamHandler()  # stderr
            handler.setFormatter(logging.Formatter("note: %(message)s"))
            _cache.log.addHandler(handler)
            _cache.log.setLevel(logging.INFO)
            stack.callback(_cache.log.removeHandler, handler)
        status = stack.enter_context(render.progress("dry runs"))
        stage = [""]

        def named(text: str) -> None:
            status(f"{stage[0]}: {text}" if stage[0] else text)

        def set_stage(text: str) -> None:
            stage[0] = text
            status(text)

        previous = _trace_estimate.on_dry_run
        _trace_estimate.on_dry_run = named
        stack.callback(setattr, _trace_estimate, "on_dry_run", previous)
        yield set_stage


def _emit_json(obj: dict[str, Any]) -> None:
    import json

    from batchfit._version import versions

    try:  # strict JSON: never NaN or Infinity, which JSON readers reject
        text = json.dumps({**obj, "versions": versions()}, indent=2, allow_nan=False)
    except ValueError:
        raise UsageError(
            "a result overflowed to a non-finite number: an input is out of any real range "
            "(e.g. --base-lr); give realistic values"
        ) from None
    print(text)


def _check_output(path: Path, option: str) -> None:
    """Refuse an output file that cannot be written, before any engine or trial runs."""
    folder = path.parent
    if not folder.is_dir():
        # the nearest part of the path that exists says which mistake it is
        above = next((p for p in folder.parents if p.exists()), None)
        if folder.exists() or (above is not None and not above.is_dir()):
            blocker = folder if folder.exists() else above
            raise UsageError(f"{option} {path}: {blocker} is a file, not a folder")
        raise UsageError(f"{option} {path}: the folder {folder} does not exist")
    if path.is_dir():
        raise UsageError(f"{option} {path} is a folder: name a file")
    if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise UsageError(f"{option} {path}: no permission to write there")


@app.command()
@setup_options(parallel=True)
def estimate(
    model: ModelArg,
    micro_batch: Annotated[
        int,
        typer.Option(
            "--micro-batch", "-b", help="Samples per GPU per forward/backward.", show_default=False
        ),
    ],
    setup: TrainingSetup,
    seq_len: SeqLenOpt = None,
    image_size: ImageSizeO = None,
    lengths: LengthsO = None,
    padding: PaddingO = None,
    device: Annotated[
        str | None,
        typer.Option("--device", help="cpu|cuda (default cuda; --gpu implies cuda)."),
    ] = None,
    gpu: GpuO = None,
    grad_accum: Annotated[
        int,
        typer.Option(
            "--grad-accum", help="Accumulation steps: above 1, gradients live through forward."
        ),
    ] = 1,
    engine: EngineO = "trace",
    no_cache: NoCacheO = False,
    verbose: VerboseO = False,
    explain: Annotated[
        bool,
        typer.Option(
            "--explain", help="Show the modules holding the most activation memory (trace)."
        ),
    ] = False,
    timeline: Annotated[
        Path | None,
        typer.Option(
            "--timeline",
            help="PNG of memory over the traced step by category, the peak marked (a dry "
            "run of the whole model).",
        ),
    ] = None,
    snapshot: Annotated[
        Path | None,
        typer.Option(
            "--snapshot",
            help="The same allocation stream as a PyTorch memory snapshot (pickle): open it "
            "at pytorch.org/memory_viz or with python -m torch.cuda._memory_viz.",
        ),
    ] = None,
    as_json: JsonO = False,
) -> None:
    """Estimate one training step's memory per GPU: weights, gradients, optimizer, activations."""
    from batchfit.cli import render
    from batchfit.hardware import get_gpu
    from batchfit.memory.device.totals import fits_on_card
    from batchfit.memory.estimate import estimate as run_estimate
    from batchfit.models import resolve_model

    if device is not None:
        check_choice("--device", device, ("cpu", "cuda"))
    if gpu is not None and device == "cpu":
        raise UsageError("--gpu and --device cpu contradict each other: drop one")
    engine_name = _engine(engine)
    if grad_accum < 1:
        raise UsageError(f"--grad-accum must be a positive integer, got {grad_accum}")
    for path, option in ((timeline, "--timeline"), (snapshot, "--snapshot")):
        if path is not None:
            _check_output(path, option)
    if timeline is not None:
        from batchfit.views import plots as _plots

        _plots.require("--timeline")
    gpu_spec = get_gpu(gpu) if gpu else None
    info = resolve_model(model, setup.task)
    seq, lengths_seen = sample_size(
        info, seq_len=seq_len, image_size=image_size, lengths=lengths, padding=padding
    )
    with _cache_switch(no_cache, verbose):
        result = run_estimate(
            info,
            setup,
            micro_batch_size=micro_batch,
            seq_len=seq,
            device="cpu" if device == "cpu" else "cuda",
            gpu=gpu_spec,
            engine=engine_name,
            grad_accum_steps=grad_accum,
        )
    if result.engine == "trace" and not result.is_image:  # the formulas model token models
        result = _compare_engines(result, info, setup, gpu_spec, grad_accum)
    if timeline is not None or snapshot is not None:
        _draw_timeline(result, info, gpu_spec, grad_accum, timeline, snapshot)
    if as_json:
        data = result.to_json()
        if gpu_spec is not None:
            data["gpu_bytes"] = gpu_spec.memory_bytes
            data["headroom_bytes"] = gpu_spec.memory_bytes - result.device_total_bytes
            data["fits"] = fits_on_card(result.device_total_bytes, gpu_spec.memory_bytes)
        if lengths_seen is not None:
            data["lengths"] = lengths_seen.to_json()
        _emit_json(data)
    else:
        if lengths_seen is not None:
            render.note(lengths_seen.describe())
        render.estimate(result, info, gpu_spec, explain=explain)


def _draw_timeline(
    result: MemoryEstimate,
    info: ModelInfo,
    gpu: GpuSpec | None,
    grad_accum: int,
    png: Path | None,
    pickle_path: Path | None,
) -> None:
    """``--timeline`` / ``--snapshot``: a dry run of the whole step, drawn and written."""
    from batchfit.views import timeline as tl

    if result.engine != "trace":
        raise UsageError(
            "--timeline and --snapshot draw a dry run of the step, which this setup does not "
            "have (the analytic engine answered): drop them, or change the setup"
        )
    device: Literal["cpu", "cuda"] = "cpu" if result.device == "cpu" else "cuda"
    from batchfit.cli import render

    with render.progress(f"dry run of the whole step for {png or pickle_path} ..."):
        drawn = tl.step_timeline(
            info,
            result.setup,
            micro_batch_size=result.micro_batch_size,
            seq_len=result.seq_len,
            device=device,
            gpu=gpu,
            grad_accum_steps=grad_accum,
        )
    title = (
        f"{info.name}: micro-batch {result.micro_batch_size} x {result.seq_len}"
        + (f", accumulation {grad_accum}" if grad_accum > 1 else "")
        + (
            f" ({tl.traced_micro_steps(grad_accum)} drawn; the rest repeat the 2nd)"
            if grad_accum > tl.traced_micro_steps(grad_accum)
            else ""
        )
        + f", {result.setup.precision}, on {gpu.name if gpu else device}"
    )
    if png is not None:
        tl.plot(drawn, png, title, gpu.memory_bytes if gpu else None)
    if pickle_path is not None:
        tl.write_snapshot(drawn, pickle_path, device)


def _compare_engines(
    traced: MemoryEstimate,
    info: ModelInfo,
    setup: TrainingSetup,
    gpu: GpuSpec | None,
    grad_accum: int,
) -> MemoryEstimate:
    """Say so when the formulas and the dry run disagree by more than 15%."""
    from dataclasses import replace

    from batchfit.memory.estimate import estimate as run_estimate

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


@app.command()
@setup_options(parallel=True, auto_gpus=True)
def plan(
    model: ModelArg,
    gpu: Annotated[
        str, typer.Option("--gpu", help="Catalog GPU (`batchfit gpus`).", show_default=False)
    ],
    setup: TrainingSetup,
    seq_len: SeqLenOpt = None,
    image_size: ImageSizeO = None,
    lengths: LengthsO = None,
    padding: PaddingO = None,
    global_batch: Annotated[
        int | None,
        typer.Option("--global-batch", help="Target global batch in samples."),
    ] = None,
    global_batch_tokens: Annotated[
        int | None,
        typer.Option("--global-batch-tokens", help="Target global batch in tokens."),
    ] = None,
    micro_batch: Annotated[
        int | None,
        typer.Option(
            "--micro-batch", "-b", help="Fix the micro-batch instead of the largest that fits."
        ),
    ] = None,
    base_lr: Annotated[
        float | None,
        typer.Option("--base-lr", help="Learning rate tuned at --base-batch.", parser=finite_float),
    ] = None,
    base_batch: Annotated[
        int | None,
        typer.Option("--base-batch", help="Batch --base-lr was tuned at, in samples."),
    ] = None,
    base_batch_tokens: Annotated[
        int | None,
        typer.Option("--base-batch-tokens", help="Batch --base-lr was tuned at, in tokens."),
    ] = None,
    base_betas: Annotated[
        str,
        typer.Option(
            "--base-betas",
            help="Adam's betas at the base batch: the plan offers the rescaled ones.",
        ),
    ] = "0.9,0.999",
    base_eps: Annotated[
        float,
        typer.Option("--base-eps", help="Adam's eps at the base batch.", parser=finite_float),
    ] = 1e-8,
    critical_batch: Annotated[
        int | None,
        typer.Option(
            "--critical-batch",
            help="Critical batch in samples (e.g. StepResult.noise_scale measured by "
            "Accumulator(noise_scale=True)): the LR stops growing there.",
        ),
    ] = None,
    critical_batch_tokens: Annotated[
        int | None,
        typer.Option("--critical-batch-tokens", help="Critical batch in tokens."),
    ] = None,
    headroom: Headroom = "0.5GiB",
    engine: EngineO = "trace",
    no_cache: NoCacheO = False,
    verbose: VerboseO = False,
    export_kind: Annotated[
        str | None,
        typer.Option("--export", help="hf|deepspeed|accelerate|lightning"),
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option("--out", help="The one file --export writes (default: print it)."),
    ] = None,
    train_tokens: Annotated[
        str | None,
        typer.Option(
            "--train-tokens",
            help="Tokens of the whole run (20B, 2e10 or 20000000000): adds its time (and cost).",
        ),
    ] = None,
    epochs: Annotated[
        float | None,
        typer.Option("--epochs", help="Passes over --dataset-size samples: the run's length."),
    ] = None,
    dataset_size: Annotated[
        int | None, typer.Option("--dataset-size", help="Samples per epoch (with --epochs).")
    ] = None,
    gpu_hour_price: Annotated[
        float | None,
        typer.Option(
            "--gpu-hour-price",
            help="Dollars per GPU-hour: the run's cost (with --train-tokens or --epochs). "
            "Default: the catalog's approximate on-demand list price for the GPU, with its "
            "source and date (none for GPUs without one).",
            parser=finite_float,
        ),
    ] = None,
    throughput_from: Annotated[
        Path | None,
        typer.Option(
            "--throughput-from",
            help="`batchfit probe ... --json` output for this model, setup, --seq-len and GPU: "
            "its measured steps replace the step-time model's (the nearest measured size's "
            "measured/predicted ratio where the plan's size was not measured).",
        ),
    ] = None,
    max_gpus: Annotated[
        int,
        typer.Option(
            "--max-gpus", help="With --num-gpus auto: the most GPUs tried (1, 2, 4, ... and it)."
        ),
    ] = 8,
    report: Annotated[
        Path | None,
        typer.Option(
            "--report",
            help="One self-contained HTML page (no network): the plan, its breakdown, the "
            "traced step's timeline and the alternatives.",
        ),
    ] = None,
    as_json: JsonO = False,
    num_gpus_auto: bool = False,
) -> None:
    """Plan micro-batch x accumulation x GPUs that hit a global batch exactly, and what fits."""
    from batchfit.cli import render
    from batchfit.export import EXPORT_KINDS
    from batchfit.hardware import get_gpu
    from batchfit.memory.estimate import check_workload
    from batchfit.models import resolve_model
    from batchfit.plan import make_plan, make_plan_auto, parse_betas, read_probe

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
    from batchfit.cli.batch_laws import parse_tokens

    run_tokens = None if train_tokens is None else parse_tokens(train_tokens)
    if gpu_hour_price and gpu_hour_price > 0 and run_tokens is None and epochs is None:
        raise UsageError(
            "--gpu-hour-price prices the run: give its length too (--train-tokens N, or "
            "--epochs E --dataset-size N)"
        )
    if (epochs is None) != (dataset_size is None):
        raise UsageError("--epochs and --dataset-size go together (the run's length in samples)")
    if epochs is not None and not epochs > 0:
        raise UsageError(f"--epochs must be positive, got {epochs}")
    train_samples = None
    if epochs is not None and dataset_size is not None:
        train_samples = math.ceil(epochs * dataset_size)
    engine_name = _engine(engine)
    gpu_spec = get_gpu(gpu)
    headroom_note = None
    if headroom.strip().lower() == "auto":
        from batchfit import calibration

        records = calibration.load(
            warn=lambda message: typer.echo(f"batchfit: warning: {message}", err=True)
        )
        auto = calibration.auto_headroom(records, gpu_spec.name)
        headroom_bytes = int(auto.fraction * gpu_spec.memory_bytes)
        headroom_note = (
            f"--headroom auto: {auto.fraction:.1%} of {gib(gpu_spec.memory_bytes)} = "
            f"{gib(headroom_bytes)} ({auto.why})"
        )
    else:
        headroom_bytes = parse_size(headroom, what="--headroom", allow_zero=True)
    if headroom_bytes >= gpu_spec.memory_bytes:
        raise UsageError(
            f"--headroom {headroom} is all of {gpu_spec.name}'s "
            f"{gib(gpu_spec.memory_bytes)}: keep less free, e.g. 0.5GiB"
        )
    info = resolve_model(model, setup.task)
    seq, lengths_seen = sample_size(
        info, seq_len=seq_len, image_size=image_size, lengths=lengths, padding=padding
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
    with _cache_switch(no_cache, verbose) as stage:
        planner = (
            functools.partial(make_plan_auto, max_gpus=max_gpus, progress=stage)
            if num_gpus_auto
            else make_plan
        )
        result = planner(
            info,
            gpu_spec,
            setup,
            seq_len=seq,
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
            train_samples=train_samples,
            gpu_hour_price=gpu_hour_price,
            throughput_from=probe_file,
            headroom_bytes=headroom_bytes,
            engine=engine_name,
        )
    if headroom_note is not None:
        result = replace(result, warnings=(headroom_note, *result.warnings))
    exports, export_text = _exports(result, export_kind, out)
    if report is not None:
        _write_report(result, info, gpu_spec, report)
    from batchfit.export import launch_command

    launch = launch_command(result, export_kind, str(out) if out is not None else None)
    if export_kind is not None:
        from batchfit.export import export_caveats

        caveats = export_caveats(result, export_kind)
        result = replace(result, warnings=(*result.warnings, *caveats))
    if as_json:
        extra = {"lengths": lengths_seen.to_json()} if lengths_seen is not None else {}
        _emit_json({**result.to_json(), "exports": {**exports, "launch": launch}, **extra})
    else:
        # an export without --out is stdout's only text (`--export deepspeed > ds.json`):
        # the plan goes to stderr then
        alone = export_kind is not None and out is None
        with render.on_stderr() if alone else contextlib.nullcontext():
            if lengths_seen is not None:
                render.note(lengths_seen.describe())
            render.plan(result, info)
            render.note(f"launch: {launch}")
        if alone:
            print(export_text)
        elif export_kind is not None:
            render.export_note(export_kind, out, export_text)


def _write_report(result: Plan, info: ModelInfo, gpu: GpuSpec, path: Path) -> None:
    """``plan --report``: the page, with the chosen setup's traced step drawn in it (a dry run
    of the whole model) when the trace engine answered."""
    import os
    import tempfile

    from batchfit.views import html as _html

    png = None
    est = result.estimate
    if est.engine == "trace" and not est.is_image:
        from batchfit.cli import render
        from batchfit.views import plots as _plots
        from batchfit.views import timeline as tl

        _plots.require("--report")
        with render.progress("dry run of the whole step for the report ..."):
            drawn = tl.step_timeline(
                info,
                est.setup,
                micro_batch_size=est.micro_batch_size,
                seq_len=est.seq_len,
                device="cuda",
                gpu=gpu,
                grad_accum_steps=result.grad_accum_steps,
            )
        with tempfile.TemporaryDirectory() as tmp:
            picture = Path(tmp) / "timeline.png"
            accum = result.grad_accum_steps
            title = (
                f"{info.name}: micro-batch {est.micro_batch_size} x {est.seq_len}"
                + (f", accumulation {accum}" if accum > 1 else "")
                + f", {est.setup.precision}, on {gpu.name}"
            )
            tl.plot(drawn, picture, title, gpu.memory_bytes)
            png = picture.read_bytes()
    page = _html.report_page(result.to_json(), png)
    tmp_path = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp_path.write_text(page)
        os.replace(tmp_path, path)
    except OSError as e:
        raise UsageError(f"cannot write --report {path}: {e.strerror}") from None
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


def _exports(
    result: Plan, export_kind: str | None, out: Path | None
) -> tuple[dict[str, Any], str | None]:
    """Write the export to ``out`` (that file only) or return its text: (JSON field, text)."""
    from batchfit.export import export, write_export
    from batchfit.export import render as render_export

    if export_kind is None:
        return {}, None
    if out is not None:
        return dict(write_export(result, export_kind, out)), None
    data = export(result, export_kind)
    return {export_kind: data}, render_export(data, export_kind)


@app.command()
def models(as_json: JsonO = False) -> None:
    """List the catalog models (config facts ship with batchfit; no download)."""
    from batchfit.cli import render
    from batchfit.models import catalog_names, resolve_model

    infos = [resolve_model(name) for name in catalog_names()]
    if as_json:
        _emit_json({"models": [render.model_row(i) for i in infos]})
    else:
        render.models(infos)


@app.command()
@setup_options()
def gpus(
    setup: TrainingSetup,
    model: Annotated[
        str | None,
        typer.Argument(help="With a model: the largest micro-batch that fits on each GPU."),
    ] = None,
    seq_len: Annotated[
        int | None,
        typer.Option("--seq-len", "-s", help="Tokens per sample (needed with MODEL)."),
    ] = None,
    image_size: ImageSizeO = None,
    headroom: Annotated[str, typer.Option("--headroom", help="Free memory to keep.")] = "0.5GiB",
    engine: EngineO = "trace",
    no_cache: NoCacheO = False,
    verbose: VerboseO = False,
    as_json: JsonO = False,
) -> None:
    """List the catalog GPUs; with MODEL --seq-len, what fits on each of them.

    Each row follows one rule (printed under the table): the fastest exact option by the time
    model at its largest micro-batch, with the hours a billion tokens take; CPU offload only
    when over 25% faster; rungs that change training only when nothing exact fits.
    """
    from batchfit.cli import render
    from batchfit.hardware import all_gpus

    gpu_list = list(all_gpus().values())
    if model is None:
        if seq_len is not None or image_size is not None:
            raise UsageError("--seq-len needs a MODEL: batchfit gpus MODEL --seq-len S")
        if as_json:
            _emit_json({"gpus": [render.gpu_row(g) for g in gpu_list]})
        else:
            render.gpus(gpu_list)
        return
    from batchfit.memory.estimate import check_workload
    from batchfit.models import resolve_model
    from batchfit.plan import fit_table

    headroom_bytes = parse_size(headroom, what="--headroom", allow_zero=True)
    info = resolve_model(model, setup.task)
    if seq_len is None and info.task != "image-classification":
        raise UsageError("batchfit gpus MODEL needs --seq-len")
    seq_len, _ = sample_size(info, seq_len=seq_len, image_size=image_size)
    check_workload(info, 1, seq_len)
    engine_name = _engine(engine)
    with _cache_switch(no_cache, verbose):
        rows = fit_table(
            info,
            setup,
            gpu_list,
            seq_len=seq_len,
            headroom_bytes=headroom_bytes,
            engine=engine_name,
        )
    from batchfit.memory.estimate import usable_engine

    answered, _ = usable_engine(engine_name)
    if as_json:
        _emit_json(
            {
                "model": info.name,
                **(
                    {"seq_len": None, "image_size": seq_len}
                    if info.task == "image-classification"
                    else {"seq_len": seq_len}
                ),
                "engine": answered,
                "grad_accum_steps": 1,
                "gpus": [r.to_json() for r in rows],
            }
        )
    else:
        render.fit_table(info, seq_len, rows, answered)


@app.callback(invoke_without_command=True)
def _root(
    version: Annotated[bool, typer.Option("--version", help="Show versions and exit.")] = False,
) -> None:
    if version:
        from batchfit._version import versions

        print(" ".join(f"{k} {v}" for k, v in versions().items()))
        raise typer.Exit(0)


@app.command()
@setup_options(sharding=True)
def probe(
    model: ModelArg,
    device: Annotated[
        str,
        typer.Option("--device", help="cpu|cuda: where the real steps run.", show_default=False),
    ],
    setup: TrainingSetup,
    seq_len: SeqLenOpt = None,
    image_size: ImageSizeO = None,
    memory_budget: Annotated[
        str | None,
        typer.Option(
            "--memory-budget",
            help="Memory the training state may take, e.g. 6GiB (required on "
            "the CPU: it becomes an OS limit for the trials).",
        ),
    ] = None,
    choose: Annotated[
        str,
        typer.Option(help="throughput (fastest; within 2% the smaller) | max (largest that fits)"),
    ] = "throughput",
    max_micro_batch: Annotated[
        int | None, typer.Option("--max-micro-batch", help="Largest size to consider.")
    ] = None,
    steps_per_trial: Annotated[
        int,
        typer.Option(
            "--steps-per-trial",
            help="Real steps for each size that is timed or chosen (the first is not timed, so "
            "at least 2); a size only measured runs one.",
        ),
    ] = 3,
    dataset_size: Annotated[
        int | None,
        typer.Option("--dataset-size", help="Samples per epoch: adds time per epoch to the table."),
    ] = None,
    global_batch: Annotated[
        int | None,
        typer.Option(
            "--global-batch", help="Also plan accumulation for this global batch (samples)."
        ),
    ] = None,
    plot: Annotated[
        Path | None,
        typer.Option("--plot", help="PNG of throughput and peak memory against the micro-batch."),
    ] = None,
    nproc: Annotated[
        int,
        typer.Option(
            "--nproc",
            help="Ranks to run under torchrun (gloo on the CPU, NCCL on CUDA), sharded as "
            "--sharding ddp|fsdp says; every rank runs the same trials and they agree. "
            "Communication is not run in trials (samples/s leaves it out).",
        ),
    ] = 1,
    as_json: JsonO = False,
) -> None:
    """Find the fastest micro-batch on the real device, in a few real training steps."""
    from batchfit.cli import render_probe
    from batchfit.memory.estimate import check_workload
    from batchfit.models import resolve_model
    from batchfit.search import _probe

    check_choice("--device", device, ("cpu", "cuda"))
    check_choice("--choose", choose, ("throughput", "max"))
    _check_probe_numbers(steps_per_trial, max_micro_batch, dataset_size, global_batch)
    if plot is not None:
        _check_output(plot, "--plot")
        render_probe.require_matplotlib()
    budget = parse_size(memory_budget, what="--memory-budget") if memory_budget else None
    _check_device(device, budget, max_micro_batch)
    setup = _ranks_setup(setup, nproc, device)
    info = resolve_model(model, setup.task)
    if seq_len is None and info.task != "image-classification":
        raise UsageError("batchfit probe MODEL needs --seq-len (tokens per sample)")
    seq_len, _ = sample_size(info, seq_len=seq_len, image_size=image_size)
    check_workload(info, 1, seq_len)
    _probe.check_budget(info, setup, seq_len, device, budget)
    spec = _probe.make_spec(
        model, setup, device, seq_len, budget, choose, max_micro_batch, steps_per_trial, nproc
    )
    with render_probe.trial_progress(quiet=as_json) as on_trial:
        result = _probe.run(spec, on_trial)
    report = _probe.report(result, global_batch=global_batch, dataset_size=dataset_size)
    if plot is not None:
        render_probe.probe_plot(result, plot, budget)
    if as_json:
        size = (
            {"seq_len": None, "image_size": seq_len}
            if info.task == "image-classification"
            else {"seq_len": seq_len}
        )
        from batchfit.plan import probe_identity

        ident = probe_identity(device, setup)  # what a plan's --throughput-from checks
        _emit_json({"model": info.name, "device": device, **size, **ident, **report.to_json()})
    else:
        render_probe.probe_table(info, report, seq_len, budget, plot)


def _ranks_setup(setup: TrainingSetup, nproc: int, device: str) -> TrainingSetup:
    """The probe's setup for ``--nproc`` ranks: one rank per GPU, DDP unless FSDP is asked."""
    from batchfit.search._ranks import SHARDINGS

    if nproc < 1:
        raise UsageError(f"--nproc must be a positive integer, got {nproc}")
    if nproc == 1:
        if setup.sharding not in ("none", "ddp") or setup.num_gpus > 1:
            raise UsageError(
                "probe: sharding and several GPUs need ranks to run: add --nproc N "
                "(e.g. --nproc 2 --sharding fsdp)"
            )
        return setup
    if setup.sharding not in SHARDINGS:
        raise UsageError(
            f"probe --nproc runs torch.distributed (--sharding ddp or fsdp), not "
            f"{setup.sharding}: DeepSpeed ranks are launched by DeepSpeed's own launcher"
        )
    if setup.num_gpus not in (1, nproc):
        raise UsageError(f"--num-gpus {setup.num_gpus} disagrees with --nproc {nproc}")
    if device == "cuda":
        import torch

        visible = torch.cuda.device_count()
        if nproc > visible:
            raise UsageError(f"--nproc {nproc}: only {visible} CUDA device(s) are visible")
    sharding = "ddp" if setup.sharding == "none" else setup.sharding
    return replace(setup, num_gpus=nproc, sharding=sharding)


def _check_probe_numbers(
    steps_per_trial: int,
    max_micro_batch: int | None,
    dataset_size: int | None,
    global_batch: int | None,
) -> None:
    if steps_per_trial < 2:
        raise UsageError("--steps-per-trial must be at least 2 (the first step is not timed)")
    for name, value in (
        ("--max-micro-batch", max_micro_batch),
        ("--dataset-size", dataset_size),
        ("--global-batch", global_batch),
    ):
        if value is not None and value < 1:
            raise UsageError(f"{name} must be a positive integer, got {value}")


def _check_device(device: str, budget: int | None, max_micro_batch: int | None) -> None:
    if device == "cpu" and budget is None and max_micro_batch is None:
        raise UsageError(
            "on the CPU give --memory-budget (the trials run under an OS limit) "
            "or --max-micro-batch"
        )
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UsageError(
                "--device cuda: no CUDA device is visible here (use --device cpu "
                "with --memory-budget, or `batchfit estimate --gpu NAME`)"
            )


# registered on import: `batchfit monitor` and `batchfit calibration` live in their own module,
# `batchfit batch-size` in its own
import batchfit.cli.batch_laws  # noqa: E402, F401
from batchfit.cli import measured  # noqa: E402, F401
