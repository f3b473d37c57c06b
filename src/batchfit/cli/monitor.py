"""``batchfit monitor -- CMD``: run a training command and watch its memory against its plan;
a run measured beside a plan becomes a calibration record (``batchfit calibration``). The
live line and the summary are ``render.monitor``'s."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Annotated, Any

import typer

from batchfit.cli.common import _check_output, _emit_json
from batchfit.cli.options import JsonO
from batchfit.errors import UsageError
from batchfit.views import plots as _plots

if TYPE_CHECKING:
    from batchfit.monitor import MonitorResult, Sample

DEFAULT_TOLERANCE = 512 * 2**20  # a plan without a headroom figure (an estimate's JSON)


@dataclass(frozen=True)
class PlanFile:
    """What ``monitor --plan`` reads of a ``plan --json`` (or ``estimate --json``) file."""

    gpu_figure: int  # what nvidia-smi would show for one GPU (device_total_bytes)
    tolerance: int  # the headroom the plan asked for
    model: str
    device: str  # the plan's GPU (catalog name), "" for a CPU estimate
    setup_key: str  # the setup and sizes, for the calibration record


def read_plan(path: Path) -> PlanFile:
    """Read and check a ``--plan`` file (exit 2 with one line when it is not one)."""
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise UsageError(f"cannot read --plan {path}: {e.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UsageError(
            f"--plan {path} is not JSON: give the output of `batchfit plan ... --json`"
        ) from None
    peak = _byte_count(data, "peak_bytes", path) if isinstance(data, dict) else None
    if peak is None:
        raise UsageError(
            f"--plan {path} has no peak_bytes: give the output of `batchfit plan ... --json` "
            "or `batchfit estimate ... --json`"
        )
    gpu_figure = _byte_count(data, "device_total_bytes", path) or peak
    tolerance = _byte_count(data, "headroom_wanted_bytes", path) or DEFAULT_TOLERANCE
    sizes = {k: data.get(k) for k in ("setup", "micro_batch_size", "seq_len", "grad_accum_steps")}
    return PlanFile(
        gpu_figure=int(gpu_figure),
        tolerance=int(tolerance),
        model=str(data.get("model", "?")),
        device=str(data.get("gpu") or ""),
        setup_key=json.dumps(sizes, sort_keys=True, separators=(",", ":"), default=str),
    )


def _byte_count(data: dict[str, Any], key: str, path: Path) -> int | None:
    """A plan's byte figure, checked where it is read: a whole number >= 0, or absent."""
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        shown = json.dumps(value)[:40]
        raise UsageError(
            f"--plan {path}: {key} is {shown}, not a number of bytes: give the output of "
            "`batchfit plan ... --json`"
        )
    return value


def record_calibration(
    result: MonitorResult,
    plan: PlanFile,
    command: list[str],
    note: Callable[[str], None],
    runtime: int | None = None,
) -> bool:
    """A run measured beside its plan becomes a calibration record: on a GPU, the largest
    process against the plan's per-GPU figure; on the CPU (a CPU estimate, ``estimate
    --device cpu --json``), the largest process's resident peak against the estimate plus
    what the same Python holds before its first tensor (``monitor.runtime_bytes``: the
    interpreter, torch, transformers; measured here unless ``runtime`` gives it), since RSS
    counts both. A GPU plan measured as RSS is not comparable: no record, and ``note`` says
    why."""
    from batchfit import calibration  # the records load for a run with --plan only

    if not result.samples:
        return False
    if result.source == "nvml":
        if not plan.device:
            note("no calibration record: the plan is a CPU estimate, the run used a GPU")
            return False
        measured = max((max(s.processes.values(), default=0) for s in result.samples), default=0)
        device, estimated = plan.device, plan.gpu_figure
    else:
        if plan.device:
            note(
                f"no calibration record: the plan is for a GPU ({plan.device}) and this run "
                "was measured on the CPU (RSS); give it an `estimate --device cpu --json`"
            )
            return False
        if runtime is None:
            runtime = _runtime(command, note)
        if runtime is None:
            note("no calibration record: the runtime baseline could not be measured")
            return False
        # the largest process: its sampled high-water mark, or the tree's largest as the
        # kernel kept it when the command was reaped
        measured = max(max(result.process_peaks().values(), default=0), result.reaped_peak)
        device, estimated = "cpu", plan.gpu_figure + runtime
    return calibration.append(
        calibration.Record(
            source="monitor",
            model=plan.model,
            setup=plan.setup_key,
            device=device,
            estimated_bytes=int(estimated),
            measured_bytes=int(measured),
        )
    )


def _runtime(command: list[str], note: Callable[[str], None]) -> int | None:
    """What the command's Python holds before its first tensor (``monitor.runtime_bytes``)."""
    from batchfit import monitor as mon  # the process monitor loads to run, not for --help

    python = mon.python_of(command)
    known = mon.cached_runtime_bytes(python)
    if known is not None:
        return known
    note(f"measuring what {Path(python).name} holds before its tensors (a few seconds)")
    runtime = mon.runtime_bytes(python)
    if runtime is None:
        note(f"{python} could not import torch: its runtime is not counted")
    return runtime


CommandArg = Annotated[
    list[str] | None,
    typer.Argument(help="The training command, after --: batchfit monitor -- python train.py"),
]
PlanO = Annotated[
    Path | None,
    typer.Option(
        "--plan",
        help="A `plan --json` (or `estimate --json`) file: warn when memory passes its "
        "figure by more than the headroom it asked for.",
    ),
]
IntervalO = Annotated[float, typer.Option(help="Seconds between samples.")]
LogO = Annotated[
    Path | None, typer.Option("--log", help="JSONL file: one line per sample, as taken.")
]
PlotO = Annotated[
    Path | None, typer.Option("--plot", help="PNG of memory over time, written at the end.")
]
RecordO = Annotated[
    bool,
    typer.Option(
        "--record/--no-record",
        help="With --plan: add the run to the calibration file (--no-record for a test run).",
    ),
]


def monitor(
    command: CommandArg = None,
    plan: PlanO = None,
    interval: IntervalO = 1.0,
    log: LogO = None,
    plot: PlotO = None,
    record: RecordO = True,
    as_json: JsonO = False,
) -> None:
    """Run a training command and watch its memory (GPU per process through NVML, else RSS).

    Exits with the command's exit code. Signals (Ctrl-C, SIGTERM) reach the command and every
    process it started; they end with batchfit. With --plan, a warning the moment the run
    passes the plan's figure. With --json, the command's stdout goes to stderr, so that stdout
    holds the one JSON object.
    """
    # the process monitor and the rendering load to run, not for `batchfit --help`
    from batchfit import monitor as mon
    from batchfit.cli.render.monitor import summary

    if not command:
        raise UsageError("give the command after --: batchfit monitor [options] -- CMD ...")
    log, plot = _checked(interval, log, plot)
    watch = _watch(plan, command)
    result = _run(command, watch, interval, log, as_json)
    if result.exit_code == 127 and not result.samples:
        typer.echo(f"batchfit monitor: {command[0]}: command not found", err=True)
    if result.start_error:
        typer.echo(f"batchfit monitor: {command[0]}: cannot run it: {result.start_error}", err=True)
    if plot is not None:
        label = "plan + runtime (interpreter, torch)" if watch.runtime else "plan"
        mon.plot(result, plot, watch.limit, watch.planned, label)
    if (
        watch.plan is not None
        and record
        and record_calibration(result, watch.plan, command, _note, watch.runtime)
    ):
        typer.echo("batchfit monitor: recorded for `batchfit calibration`", err=True)
    if as_json:
        try:
            _emit_json(result.to_json())
            sys.stdout.flush()
        except BrokenPipeError:  # the reader left (`| head`): the command's code still counts
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    else:
        typer.echo(summary(result, watch.planned, watch.runtime), err=True)
    raise typer.Exit(result.exit_code)


def _note(message: str) -> None:
    typer.echo(f"batchfit monitor: {message}", err=True)


def _checked(
    interval: float, log: Path | None, plot: Path | None
) -> tuple[Path | None, Path | None]:
    """--interval in range; --log and --plot writable (symlinks followed), before the run."""
    if not interval > 0:  # NaN too
        raise UsageError(f"--interval must be greater than 0 seconds, got {interval}")
    if interval > 3600:
        raise UsageError(f"--interval must be at most 3600 seconds, got {interval}")
    if log is not None:
        log = _check_target(log, "--log")
    if plot is not None:
        plot = _check_target(plot, "--plot")
    if plot is not None:
        _plots.require()
    return log, plot


@dataclass(frozen=True)
class _Watch:
    """What the run is compared with: the plan's figure (with the runtime baseline on the CPU)
    and the limit past which it drifted; all None without --plan."""

    plan: PlanFile | None = None
    planned: int | None = None
    limit: int | None = None
    runtime: int | None = None


def _watch(plan: Path | None, command: list[str]) -> _Watch:
    from batchfit import monitor as mon  # the process monitor loads to run, not for --help

    if plan is None:
        return _Watch()
    plan_file = read_plan(plan)
    planned, runtime = plan_file.gpu_figure, None
    if not plan_file.device and not mon.samples_gpu():
        # a CPU estimate counts tensors; the resident set also holds the interpreter,
        # torch and transformers: the plan's line and its limit start from that baseline
        runtime = _runtime(command, _note)
        planned += runtime or 0
    return _Watch(plan_file, planned, planned + plan_file.tolerance, runtime)


def _run(
    command: list[str], watch: _Watch, interval: float, log: Path | None, as_json: bool
) -> MonitorResult:
    """The command run and sampled, the live line on a terminal, a warning on drift."""
    # the process monitor and the rendering load to run, not for `batchfit --help`
    from batchfit import monitor as mon
    from batchfit.cli.render.monitor import LiveLine, drift_warning

    live = LiveLine(enabled=not as_json and sys.stderr.isatty(), planned=watch.planned)
    model = watch.plan.model if watch.plan is not None else ""

    def drift(sample: Sample) -> None:
        live.clear()
        typer.echo(drift_warning(_compared(sample), sample.seconds, model, watch.planned), err=True)

    log_file: IO[str] | None = mon.write_log_path(log) if log is not None else None
    try:
        return mon.run(
            command,
            interval=interval,
            log=log_file,
            limit_bytes=watch.limit,
            on_sample=lambda s, _r: live.show(s),
            on_drift=drift,
            compare=_compared,
            stdout=2 if as_json else None,  # stdout is the JSON object's alone
        )
    finally:
        live.clear()
        if log_file is not None:
            log_file.close()


def _check_target(path: Path, option: str) -> Path:
    """Refuse an output that cannot be written, before the command runs: the folder must take
    a new file (one is created and removed there) and an existing target must be a regular
    file (not a device or a pipe). A symlink is written through: its target is returned."""
    try:
        target = path.resolve() if path.is_symlink() else path
    except (OSError, RuntimeError):  # a symlink loop
        raise UsageError(f"{option} {path}: a symlink that leads nowhere: name a file") from None
    _check_output(target, option)
    if target.exists() and not target.is_file():
        raise UsageError(f"{option} {path} is not a regular file (a device or a pipe): name a file")
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".check", dir=target.parent)
        os.close(fd)
        os.unlink(probe)
        if target.exists():  # opened without truncating: its content stays until the run
            os.close(os.open(target, os.O_WRONLY | os.O_APPEND))
    except OSError as e:
        raise UsageError(f"{option} {path}: cannot write there: {e.strerror}") from None
    return target


def _compared(sample: Sample) -> int:
    """What a plan's per-GPU figure is compared with: the largest process (one per GPU)."""
    return max(sample.processes.values(), default=0)
