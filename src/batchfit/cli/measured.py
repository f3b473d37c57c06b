"""Commands about measured runs: `batchfit monitor` (watch a training command against its plan)
and `batchfit calibration` (how far measurements came from their estimates)."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Annotated, Any

import typer

from batchfit._units import BYTES_IN_GIB, human_bytes
from batchfit.cli.app import JsonO, _check_output, _emit_json, app
from batchfit.errors import UsageError

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
    result: Any,
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
    from batchfit import calibration

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
    from batchfit import monitor as mon

    python = mon.python_of(command)
    note(f"measuring what {Path(python).name} holds before its tensors (a few seconds)")
    runtime = mon.runtime_bytes(python)
    if runtime is None:
        note(f"{python} could not import torch: its runtime is not counted")
    return runtime


@app.command(context_settings={"allow_interspersed_args": False})
def monitor(
    command: Annotated[
        list[str] | None,
        typer.Argument(help="The training command, after --: batchfit monitor -- python train.py"),
    ] = None,
    plan: Annotated[
        Path | None,
        typer.Option(
            "--plan",
            help="A `plan --json` (or `estimate --json`) file: warn when memory passes its "
            "figure by more than the headroom it asked for.",
        ),
    ] = None,
    interval: Annotated[float, typer.Option(help="Seconds between samples.")] = 1.0,
    log: Annotated[
        Path | None, typer.Option("--log", help="JSONL file: one line per sample, as taken.")
    ] = None,
    plot: Annotated[
        Path | None, typer.Option("--plot", help="PNG of memory over time, written at the end.")
    ] = None,
    record: Annotated[
        bool,
        typer.Option(
            "--record/--no-record",
            help="With --plan: add the run to the calibration file (--no-record for a test run).",
        ),
    ] = True,
    as_json: JsonO = False,
) -> None:
    """Run a training command and watch its memory (GPU per process through NVML, else RSS).

    Exits with the command's exit code. Signals (Ctrl-C, SIGTERM) reach the command and every
    process it started; they end with batchfit. With --plan, a warning the moment the run
    passes the plan's figure. With --json, the command's stdout goes to stderr, so that stdout
    holds the one JSON object.
    """
    from batchfit import monitor as mon
    from batchfit.views import plots as _plots

    if not command:
        raise UsageError("give the command after --: batchfit monitor [options] -- CMD ...")
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
    planned = limit = runtime = None
    model = ""
    plan_file = None

    def note(message: str) -> None:
        typer.echo(f"batchfit monitor: {message}", err=True)

    if plan is not None:
        plan_file = read_plan(plan)
        planned, model = plan_file.gpu_figure, plan_file.model
        if not plan_file.device and not mon.samples_gpu():
            # a CPU estimate counts tensors; the resident set also holds the interpreter,
            # torch and transformers: the plan's line and its limit start from that baseline
            runtime = _runtime(command, note)
            planned += runtime or 0
        limit = planned + plan_file.tolerance
    live = _LiveLine(enabled=not as_json and sys.stderr.isatty(), planned=planned)

    def drift(sample: mon.Sample) -> None:
        live.clear()
        typer.echo(
            f"batchfit monitor: warning: {human_bytes(_compared(sample))} at "
            f"{sample.seconds:.0f} s is above the plan for {model} ({human_bytes(planned or 0)}) "
            f"by more than its headroom",
            err=True,
        )

    log_file: IO[str] | None = mon.write_log_path(log) if log is not None else None
    try:
        result = mon.run(
            command,
            interval=interval,
            log=log_file,
            limit_bytes=limit,
            on_sample=lambda s, _r: live.show(s),
            on_drift=drift,
            compare=_compared,
            stdout=2 if as_json else None,  # stdout is the JSON object's alone
        )
    finally:
        live.clear()
        if log_file is not None:
            log_file.close()
    if result.exit_code == 127 and not result.samples:
        typer.echo(f"batchfit monitor: {command[0]}: command not found", err=True)
    if result.start_error:
        typer.echo(f"batchfit monitor: {command[0]}: cannot run it: {result.start_error}", err=True)
    if plot is not None:
        label = "plan + runtime (interpreter, torch)" if runtime else "plan"
        mon.plot(result, plot, limit, planned, label)
    if (
        plan_file is not None
        and record
        and record_calibration(result, plan_file, command, note, runtime)
    ):
        typer.echo("batchfit monitor: recorded for `batchfit calibration`", err=True)
    if as_json:
        try:
            _emit_json(result.to_json())
            sys.stdout.flush()
        except BrokenPipeError:  # the reader left (`| head`): the command's code still counts
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    else:
        typer.echo(
            f"batchfit monitor: peak {human_bytes(result.peak_bytes)} ({result.source}) over "
            f"{result.seconds:.1f} s, {len(result.samples)} samples, exit code {result.exit_code}"
            + (f"; plan {human_bytes(planned)}" if planned else "")
            + (f" (with {human_bytes(runtime)} of runtime: interpreter, torch)" if runtime else ""),
            err=True,
        )
    raise typer.Exit(result.exit_code)


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


def _compared(sample: Any) -> int:
    """What a plan's per-GPU figure is compared with: the largest process (one per GPU)."""
    return max(sample.processes.values(), default=0)


class _LiveLine:
    """One line on stderr, rewritten at each sample: current, peak, and the plan's figure."""

    def __init__(self, *, enabled: bool, planned: int | None) -> None:
        self.enabled, self.planned, self.peak = enabled, planned, 0

    def show(self, sample: Any) -> None:
        self.peak = max(self.peak, sample.total_bytes)
        if not self.enabled:
            return
        gib = sample.total_bytes / BYTES_IN_GIB
        line = f"monitor: {gib:.2f} GiB now, peak {self.peak / BYTES_IN_GIB:.2f} GiB"
        if self.planned:
            line += f", plan {self.planned / BYTES_IN_GIB:.2f} GiB"
        sys.stderr.write("\r" + line[:120].ljust(80))
        sys.stderr.flush()

    def clear(self) -> None:
        if self.enabled:
            sys.stderr.write("\r" + " " * 80 + "\r")
            sys.stderr.flush()


@app.command()
def calibration(as_json: JsonO = False) -> None:
    """How far measured peaks came from their estimates, by GPU and torch version.

    Records come from `monitor --plan` (on a GPU against a plan; on the CPU against an
    `estimate --device cpu --json`, RSS with the Python runtime added), the probe and the
    training callbacks with a plan; `plan --headroom auto` uses their 99th percentile for
    the plan's GPU (CPU records never count for a GPU).
    """
    from rich.table import Table

    from batchfit import calibration as cal
    from batchfit.cli.render import out

    records = cal.load(warn=lambda message: typer.echo(f"batchfit: warning: {message}", err=True))
    rows = cal.summary(records)
    headroom = cal.auto_headroom(records)
    if as_json:
        _emit_json(
            {
                "path": str(cal.path()),
                "records": len(records),
                "by_device": rows,
                "headroom_auto": headroom.fraction,
                "headroom_why": headroom.why,
            }
        )
        return
    out.print(f"calibration records: {len(records)} in {cal.path()}")
    if rows:
        table = Table(title="measured / estimated - 1", title_justify="left")
        for column in ("device", "torch", "records", "median", "p90", "p99", "worst"):
            table.add_column(column, justify="left" if column in ("device", "torch") else "right")
        for r in rows:
            table.add_row(
                r["device"],
                r["torch"],
                str(r["records"]),
                *(f"{r[k]:+.1%}" for k in ("median", "p90", "p99", "worst")),
            )
        out.print(table)
    out.print(f"plan --headroom auto (GPU records): {headroom.fraction:.1%} ({headroom.why})")
