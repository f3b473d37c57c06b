"""``batchfit monitor``: run a training command, watch its memory, compare it with a plan."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import IO, Annotated, Any

import typer

from batchfit._units import BYTES_IN_GIB, human_bytes
from batchfit.cli.app import JsonO, _check_output, _emit_json, app
from batchfit.errors import UsageError

DEFAULT_TOLERANCE = 512 * 2**20  # a plan without a headroom figure (an estimate's JSON)


def read_plan(path: Path) -> tuple[int, int, int | None, str]:
    """A plan's (or an estimate's) ``--json`` output: the per-GPU figure, its tolerance (the
    headroom the plan asked for), the process figure a CPU run compares with, the model."""
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise UsageError(f"cannot read --plan {path}: {e.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UsageError(
            f"--plan {path} is not JSON: give the output of `batchfit plan ... --json`"
        ) from None
    if not isinstance(data, dict) or not isinstance(data.get("peak_bytes"), int):
        raise UsageError(
            f"--plan {path} has no peak_bytes: give the output of `batchfit plan ... --json` "
            "or `batchfit estimate ... --json`"
        )
    gpu_figure = data.get("device_total_bytes") or data["peak_bytes"]
    tolerance = data.get("headroom_wanted_bytes") or DEFAULT_TOLERANCE
    return int(gpu_figure), int(tolerance), int(data["peak_bytes"]), str(data.get("model", "?"))


@app.command(
    context_settings={"allow_interspersed_args": False},
    no_args_is_help=True,
)
def monitor(
    command: Annotated[
        list[str],
        typer.Argument(help="The training command, after --: batchfit monitor -- python train.py"),
    ],
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
    as_json: JsonO = False,
) -> None:
    """Run a training command and watch its memory (GPU per process through NVML, else RSS).

    Exits with the command's exit code. Signals (Ctrl-C, SIGTERM) reach the command; it dies
    with batchfit. With --plan, a warning the moment the run passes the plan's figure.
    """
    from batchfit import _plots
    from batchfit import monitor as mon

    if not command:
        raise UsageError("monitor needs a command: batchfit monitor [options] -- CMD ...")
    if not interval > 0 or interval != interval or interval > 3600:
        raise UsageError(f"--interval must be between 0 and 3600 seconds, got {interval}")
    for path, option in ((log, "--log"), (plot, "--plot")):
        if path is not None:
            _check_output(path, option)
    if plot is not None:
        _plots.require()
    planned = limit = None
    model = ""
    if plan is not None:
        planned, tolerance, _, model = read_plan(plan)
        limit = planned + tolerance
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
        )
    finally:
        live.clear()
        if log_file is not None:
            log_file.close()
    if result.exit_code == 127 and not result.samples:
        typer.echo(f"batchfit monitor: {command[0]}: command not found", err=True)
    if plot is not None:
        mon.plot(result, plot, limit, planned)
    if as_json:
        _emit_json(result.to_json())
    else:
        typer.echo(
            f"batchfit monitor: peak {human_bytes(result.peak_bytes)} ({result.source}) over "
            f"{result.seconds:.1f} s, {len(result.samples)} samples, exit code {result.exit_code}"
            + (f"; plan {human_bytes(planned)}" if planned else ""),
            err=True,
        )
    raise typer.Exit(result.exit_code)


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
