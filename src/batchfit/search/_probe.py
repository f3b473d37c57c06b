"""The model-aware probe behind ``batchfit probe``: build the model, search, report.

On the CPU the search runs in a child process (``python -m batchfit.search._probe SPEC``) whose OS
data limit is set before the model is built, with glibc returning freed blocks to the kernel
(``MALLOC_MMAP_THRESHOLD_``), so an over-budget step fails for real and a fresh budget applies.
The child prints one JSON line per trial and a last line with the result.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from batchfit._memwatch import status_bytes
from batchfit._units import human_bytes
from batchfit.errors import NoFitError, UsageError

if TYPE_CHECKING:
    from batchfit.calibration import Record
    from batchfit.models import ModelInfo
    from batchfit.search import SearchResult, Trial
    from batchfit.spec import TrainingSetup

# The first trial aims this far below the predicted limit: the trace's worst error against real
# CPU steps is 1.2% (docs/benchmarks.md); on CUDA, unmeasured here, the margin is wider.
START_MARGIN = {"cpu": 0.02, "cuda": 0.05}


def child_env() -> dict[str, str]:
    """Environment for a budgeted CPU child: freed blocks go back to the kernel at once."""
    return {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "HF_HUB_OFFLINE": "1"}


def make_spec(
    model: str,
    setup: TrainingSetup,
    device: str,
    seq_len: int,
    budget: int | None,
    choose: str,
    high: int | None,
    steps_per_trial: int,
    nproc: int = 1,
) -> dict[str, Any]:
    """The probe's request, as JSON for the child process (or each of ``nproc`` ranks)."""
    fields = dataclasses.asdict(setup)
    return {
        "model": model,
        "task": setup.task,
        "setup": {k: (list(v) if isinstance(v, tuple) else v) for k, v in fields.items()},
        "device": device,
        "seq_len": seq_len,
        "memory_budget": budget,
        "choose": choose,
        "start": None,  # the probe predicts it with the trace engine
        "high": high,
        "steps_per_trial": steps_per_trial,
        "nproc": nproc,
    }


def run(spec: dict[str, Any], on_line: Callable[[dict[str, Any]], None]) -> SearchResult:
    """Search where ``spec`` says: in a budgeted child process on the CPU, here on CUDA, on
    ``spec["nproc"]`` ranks under torchrun (:mod:`batchfit.search._ranks`)."""
    if spec.get("nproc", 1) > 1:
        return run_ranks(spec, on_line)
    if spec["device"] == "cpu":
        return run_child(spec, on_line)
    return probe(spec, on_line)


def run_ranks(spec: dict[str, Any], on_line: Callable[[dict[str, Any]], None]) -> SearchResult:
    """The probe on ``spec["nproc"]`` torchrun ranks; every rank's choice must be rank 0's."""
    from batchfit.errors import RankFailure
    from batchfit.search import SearchResult
    from batchfit.search._ranks import launch

    env = child_env() if spec["device"] == "cpu" else {**os.environ, "HF_HUB_OFFLINE": "1"}
    final, ranks = launch(spec, env, on_line)
    assert final is not None
    if "usage_error" in final:
        raise UsageError(final["usage_error"])
    result = SearchResult.from_json(final["result"])
    chosen = {(r["micro_batch_size"], r["max_fitting_micro_batch"]) for r in ranks}
    if chosen != {(result.micro_batch_size, result.max_fitting_micro_batch)}:
        raise RankFailure(f"the ranks disagree on the micro-batch: {sorted(chosen)}")
    return result


def run_child(spec: dict[str, Any], on_line: Callable[[dict[str, Any]], None]) -> SearchResult:
    """Run the probe in a fresh process; stream its trial lines; return its result.

    The child dies with this process (see :func:`_die_with_parent`), and is killed and reaped
    here when this process is interrupted (Ctrl-C, SIGTERM) or fails.
    """
    from batchfit.search import SearchResult

    proc = subprocess.Popen(
        [sys.executable, "-m", "batchfit.search._probe", json.dumps(spec, allow_nan=False)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**child_env(), _PARENT_ENV: str(os.getpid())},
    )
    try:
        final, err = _read_child(proc, on_line)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    if final is None:
        if proc.returncode < 0:
            number = -proc.returncode
            raise UsageError(
                f"the trial process was killed by signal {number}"
                f"{' (out of memory?)' if number == signal.SIGKILL else ''}: no result; "
                "try again with a smaller --memory-budget or --max-micro-batch"
            )
        tail = err.strip().splitlines()[-1] if err.strip() else f"exit code {proc.returncode}"
        raise RuntimeError(f"the probe process failed: {tail}")
    if "usage_error" in final:
        raise UsageError(final["usage_error"])
    return SearchResult.from_json(final["result"])


def _read_child(
    proc: subprocess.Popen[str], on_line: Callable[[dict[str, Any]], None]
) -> tuple[dict[str, Any] | None, str]:
    assert proc.stdout is not None and proc.stderr is not None
    final: dict[str, Any] | None = None
    for line in proc.stdout:
        try:
            message = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "trial" in message or "start" in message:
            on_line(message)
        else:
            final = message
    return final, proc.stderr.read()


# The parent's pid, for the child to notice that it was orphaned.
_PARENT_ENV = "BATCHFIT_PROBE_PARENT"


def _die_with_parent() -> None:
    """End this child when its parent dies, however it dies (SIGKILL included): the kernel
    sends SIGKILL on Linux (``PR_SET_PDEATHSIG``); elsewhere a thread polls the parent's pid."""
    from batchfit._libc import die_with_parent, libc

    parent = int(os.environ.get(_PARENT_ENV, "0")) or os.getppid()
    lib = libc() if sys.platform == "linux" else None
    if lib is not None:
        die_with_parent(lib)
    else:
        threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    if os.getppid() != parent:  # the parent died before the line above
        os._exit(1)


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


@contextlib.contextmanager
def _limit_data(budget: int | None) -> Iterator[None]:
    if budget is None:
        yield
        return
    old = resource.getrlimit(resource.RLIMIT_DATA)
    resource.setrlimit(resource.RLIMIT_DATA, (status_bytes("VmData") + budget, old[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, old)


def probe(spec: dict[str, Any], emit: Callable[[dict[str, Any]], None]) -> SearchResult:
    """Build the model of ``spec`` on its device and search; ``emit`` gets each trial.

    Raises:
        NoFitError: the model, or one step at micro-batch 1, does not fit.
    """
    import torch

    from batchfit.models import resolve_model
    from batchfit.search import _ranks
    from batchfit.spec import TrainingSetup

    rank, nproc = _ranks.world()
    device = torch.device(spec["device"])
    info = resolve_model(spec["model"], spec.get("task"))
    setup = run_setup(info, TrainingSetup(**spec["setup"]), device.type)
    budget = (spec.get("rank_budgets") or [spec.get("memory_budget")] * nproc)[rank]
    spec = {**spec, "memory_budget": budget}
    warm_up(info, setup)
    start, per_sample, need = _start(spec, info, setup, device)  # before any process group
    wrap = None
    if nproc > 1:
        device = _ranks.init(device.type)
        start = _ranks.agree_min(start, device)
        wrap = _ranks.wrapper(setup, device)
    emit({"start": start, "bytes_per_sample": per_sample})
    with _limit_data(budget if device.type == "cpu" else None):
        parts, no_room = _build_step(info, setup, spec["seq_len"], device, budget, wrap)
        if nproc > 1:  # every rank stops if one cannot hold the model
            short = _ranks.failed_ranks(no_room is not None, device)
            if short and no_room is None:
                no_room = f"rank {short[0]} cannot hold the model in its --memory-budget"
        if no_room is not None:
            raise NoFitError(no_room)
        try:
            result = _search(spec, info, parts, device, start, per_sample, emit)
        except NoFitError as e:
            if need is None:
                raise
            why = f"the trace engine puts one step at micro-batch 1 at {human_bytes(need)}"
            raise NoFitError(f"{e}: {why}") from None
    notes = stand_ins(setup)
    if device.type == "cuda" and nproc == 1:
        notes += _record_calibration(result, info, setup, spec["seq_len"], device)
    if nproc > 1:
        notes.append(_ranks.note(setup, nproc, "gloo" if device.type == "cpu" else "nccl"))
    if notes:
        result = dataclasses.replace(result, notes=result.notes + tuple(notes))
    return result


def run_setup(info: ModelInfo, asked: TrainingSetup, device_type: str) -> TrainingSetup:
    """The setup the probe's steps run on ``device_type``: the defaults resolved for it, the
    attention the model class runs."""
    import torch

    return dataclasses.replace(
        asked.resolved(
            device="cpu" if device_type == "cpu" else "cuda",
            bf16_supported=device_type == "cpu" or torch.cuda.is_bf16_supported(),
        ),
        attention=info.resolve_attention(asked.attention),  # what the model class runs
    )


def calibration_record(
    result: SearchResult, info: Any, setup: Any, seq: int, device_type: str, device_kind: str
) -> Record | None:
    """The largest measured peak of ``result`` beside the trace engine's estimate for the same
    setup and micro-batch, as a calibration record; None when no size fitted.

    The estimate is the one the probe's prediction makes (``device_type`` says which kernels
    it emulates); on the CPU this builds the record all the same, for the tests: the probe
    only keeps CUDA's (a CPU peak is resident memory, not comparable).
    """
    from batchfit import calibration
    from batchfit.memory.estimate import estimate

    measured = [t for t in result.trials if t.ok and t.peak_bytes is not None]
    if not measured:
        return None
    largest = max(measured, key=lambda t: (t.micro_batch_size, t.peak_bytes or 0))
    est = estimate(
        info,
        setup,
        micro_batch_size=largest.micro_batch_size,
        seq_len=seq,
        device="cpu" if device_type == "cpu" else "cuda",
        engine="trace",
    )
    return calibration.Record(
        source="probe",
        model=info.name,
        setup=calibration.setup_key(est),
        device=device_kind,
        estimated_bytes=est.peak_bytes,
        measured_bytes=int(largest.peak_bytes or 0),
    )


def _record_calibration(
    result: SearchResult, info: Any, setup: Any, seq: int, device: Any
) -> list[str]:
    """A CUDA probe's measurement joins the calibration file (``batchfit calibration``);
    the note that says so."""
    import torch

    from batchfit import calibration
    from batchfit.hardware import catalog_gpu

    name = torch.cuda.get_device_name(device)
    # the catalog's name joins the records of plans made for this GPU (plan --headroom auto)
    kind = catalog_gpu(name, torch.cuda.get_device_properties(device).total_memory)
    kind = kind or name.lower()
    record = calibration_record(result, info, setup, seq, "cuda", kind)
    if record is None or not calibration.append(record):
        return []
    return [
        f"the measured peak of the largest size beside the trace's estimate "
        f"({record.error:+.1%}) is recorded for `batchfit calibration`"
    ]


def _start(
    spec: dict[str, Any], info: Any, setup: Any, device: Any
) -> tuple[int, int | None, int | None]:
    """The first size, the bytes a sample adds and the peak at 1 (None: no budget to aim at)."""
    import torch

    room = spec.get("memory_budget")
    if room is None and device.type == "cuda":
        room = torch.cuda.get_device_properties(device).total_memory
    start, per_sample, need = spec.get("start"), None, None
    if room is not None:
        predicted, per_sample, need = predict(
            info, setup, spec["seq_len"], device.type, room, spec.get("high")
        )
        start = start or predicted
    return start or spec.get("high") or 1, per_sample, need


def _build_step(
    info: Any,
    setup: Any,
    seq: int,
    device: Any,
    budget: int | None,
    wrap: Callable[[Any], Any] | None = None,
) -> tuple[Any, str | None]:
    """The model (wrapped for its rank), optimizer and loss of the step, built under the
    limit; or None and why, when the model does not fit."""
    import torch

    from batchfit._oom import is_oom
    from batchfit.memory.trace import dry_run as trace
    from batchfit.memory.trace import hf as _hf_trace

    try:
        with trace.quiet(), torch.device(device):
            parts = _hf_trace.step_parts(
                info, setup, micro=1, seq=seq, emulate_cuda=False, prepare=wrap
            )
            return parts, None
    except (RuntimeError, MemoryError) as e:
        if not is_oom(e):
            raise
    # returned after the except block, whose traceback holds the failed tensors
    return None, (
        f"--memory-budget {human_bytes(budget or 0)} cannot even hold the model: give "
        "more (the estimate's weights figure is the minimum)"
    )


def _search(
    spec: dict[str, Any],
    info: Any,
    parts: Any,
    device: Any,
    start: int,
    per_sample: int | None,
    emit: Callable[[dict[str, Any]], None],
) -> SearchResult:
    """find_batch_size over the probe's step: the loop the estimators trace."""
    import torch

    from batchfit.memory.trace import dry_run as trace
    from batchfit.memory.trace import hf as _hf_trace
    from batchfit.search import find_batch_size

    seq = spec["seq_len"]

    def make(n: int) -> Any:
        with torch.device(device):
            return _hf_trace.batch_fn(info, n, seq)()

    def step(batch: Any) -> None:
        trace.training_steps(
            parts.model,
            parts.optimizer,
            lambda: batch,
            parts.loss_of,
            autocast_dtype=parts.autocast_dtype,
            device_type=device.type,
            steps=1,
            loop=spec["setup"].get("loop", "trainer"),
        )

    with trace.quiet():
        return find_batch_size(
            step,
            make,
            device=device,
            memory_budget=spec.get("memory_budget"),
            low=1,
            high=spec.get("high"),
            start=start,
            bytes_per_sample=per_sample,
            choose=spec["choose"],
            steps_per_trial=spec.get("steps_per_trial", 3),
            model=parts.model,
            optimizer=parts.optimizer,
            on_trial=lambda t: emit({"trial": t.to_json()}),
            budget_applied=device.type == "cpu",
            restore=False,  # this process exits after the search
        )


@dataclasses.dataclass(frozen=True)
class AccumulationPlan:
    """A global batch as a micro-batch that ran times accumulation steps."""

    micro_batch_size: int
    grad_accum_steps: int
    global_batch_size: int

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class ProbeReport:
    """What ``batchfit probe`` reports: the search, and what the options asked on top of it."""

    result: SearchResult
    plan: AccumulationPlan | None = None
    dataset_size: int | None = None
    notes: tuple[str, ...] = ()

    def epoch_seconds(self, trial: Trial) -> float | None:
        """Time for one pass over ``dataset_size`` samples at the trial's speed."""
        if self.dataset_size is None or not trial.samples_per_s:
            return None
        return self.dataset_size / trial.samples_per_s

    def to_json(self) -> dict[str, Any]:
        data = self.result.to_json()
        data["notes"] = [*data["notes"], *self.notes]
        if self.plan is not None:
            data["plan"] = self.plan.to_json()
        if self.dataset_size is not None:
            data["dataset_size"] = self.dataset_size
            for row, trial in zip(data["trials"], self.result.trials, strict=True):
                row["epoch_seconds"] = self.epoch_seconds(trial)
        return data


def report(
    result: SearchResult, *, global_batch: int | None, dataset_size: int | None
) -> ProbeReport:
    """The probe's report: an accumulation plan for ``global_batch`` from a size that ran (the
    largest up to the choice that divides it), or a note saying there is none."""
    if global_batch is None:
        return ProbeReport(result, dataset_size=dataset_size)
    ran = {t.micro_batch_size for t in result.trials if t.ok}
    divides = [n for n in ran if n <= result.micro_batch_size and global_batch % n == 0]
    if not divides:
        note = (
            f"no size that ran divides --global-batch {global_batch}; for a plan: "
            f"`batchfit plan MODEL --global-batch {global_batch} --micro-batch N`"
        )
        return ProbeReport(result, dataset_size=dataset_size, notes=(note,))
    micro = max(divides)
    plan = AccumulationPlan(micro, global_batch // micro, global_batch)
    return ProbeReport(result, plan=plan, dataset_size=dataset_size)


def check_budget(
    info: ModelInfo, setup: TrainingSetup, seq_len: int, device: str, budget: int | None
) -> None:
    """Refuse a budget below what one step at micro-batch 1 needs (analytic engine), before
    any trial runs, with the figure."""
    from batchfit.memory.estimate import estimate

    if budget is None:
        return
    need = estimate(
        info,
        setup,
        micro_batch_size=1,
        seq_len=seq_len,
        device="cpu" if device == "cpu" else "cuda",
        # the formulas are instant; an image model only the trace models
        engine="trace" if info.arch.family == "vision" else "analytic",
    ).peak_bytes
    if need > budget:
        raise UsageError(
            f"--memory-budget {human_bytes(budget)} is below the {human_bytes(need)} one step of "
            "micro-batch 1 needs (weights, gradients, optimizer state, activations): "
            "give at least that"
        )


def warm_up(info: Any, setup: Any) -> None:
    """One step of a 1-layer copy at a tiny size, before any limit: imports, kernels and thread
    pools are library start-up, not the training state's (the benchmarks' peers do the same)."""
    from batchfit.memory.trace import dry_run as trace
    from batchfit.memory.trace import hf as _hf_trace

    # an image model: two small images, a few patches each (BatchNorm refuses one value per
    # channel, which one image of a few pixels gives at the end of a ResNet)
    micro, seq = (2, max(32, 2 * info.arch.patch_size)) if info.arch.family == "vision" else (1, 8)
    with trace.quiet():
        tiny = _hf_trace.step_parts(info, setup, micro=micro, seq=seq, emulate_cuda=False, depth=1)
        trace.training_steps(
            tiny.model,
            tiny.optimizer,
            tiny.make_batch,
            tiny.loss_of,
            autocast_dtype=tiny.autocast_dtype,
            steps=1,
            loop=setup.loop,
        )


def predict(
    info: Any, setup: Any, seq: int, device_type: str, room: int, high: int | None
) -> tuple[int, int, int]:
    """The first size to try, the peak bytes each sample adds and the peak at micro-batch 1,
    from a dry run of the step.

    The trace engine (the analytic one where the trace does not apply) predicts the peak at
    micro-batch 1 and 8; the start is the largest size whose predicted peak stays
    ``START_MARGIN`` (the trace's error against real steps, and some) below ``room``, checked
    by a prediction on each side, which also gives the slope there.
    """
    from batchfit.memory.estimate import estimate

    cache: dict[int, int] = {}

    def peak(m: int) -> int:
        if m not in cache:
            cache[m] = estimate(
                info,
                setup,
                micro_batch_size=m,
                seq_len=seq,
                device="cpu" if device_type == "cpu" else "cuda",
                engine="trace",
            ).peak_bytes
        return cache[m]

    slope = max(1, (peak(8) - peak(1)) // 7)
    target = room * (1 - START_MARGIN[device_type])
    cap = high or 1 << 20
    guess = min(cap, max(1, 1 + int((target - peak(1)) // slope)))
    # the line's guess, then a gallop away from it and a bisection: a few predictions
    if peak(guess) <= target:
        lo, hi, step = guess, None, 1
        while hi is None and lo < cap:
            nxt = min(cap, lo + step)
            lo, hi, step = (nxt, None, 2 * step) if peak(nxt) <= target else (lo, nxt, step)
        hi = hi or lo + 1
    else:
        lo, hi, step = 0, guess, 1
        while lo == 0 and hi > 1:
            nxt = max(1, hi - step)
            lo, hi, step = (nxt, hi, step) if peak(nxt) <= target else (0, nxt, 2 * step)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if peak(mid) <= target else (lo, mid)
    n = max(1, lo)
    # The slope where the search starts, unless the line's is smaller: a prediction that jumps
    # between two sizes must not stop the search early (too small a slope costs one OOM).
    return n, max(1, min(peak(n + 1) - peak(n), slope)), peak(1)


def stand_ins(setup: Any) -> list[str]:
    """What the probe's step runs in place of the setup's, when this machine cannot run it."""
    import importlib.util

    import torch

    notes = []
    bnb = importlib.util.find_spec("bitsandbytes") is not None and torch.cuda.is_available()
    if setup.optimizer in ("adamw-8bit", "paged-adamw-8bit") and not bnb:
        notes.append(
            f"{setup.optimizer}: bitsandbytes does not run here; an emulation with the same "
            "state sizes ran, so the peak is close but the speed is not bitsandbytes'"
        )
    if setup.method == "qlora":
        notes.append(
            "qlora: bitsandbytes' 4-bit layers are emulated (the same packed storage and "
            "dequantised 16-bit weight per matmul), so the peak is QLoRA's but the speed is not "
            "bitsandbytes'"
        )
    return notes


def main() -> None:
    """The child: one JSON line per trial, then the result or the user's error."""
    _die_with_parent()
    spec = json.loads(sys.argv[1])

    from batchfit.search import _ranks

    rank, nproc = _ranks.world()

    def emit(message: dict[str, Any]) -> None:
        if rank == 0:  # the ranks run the same trials: one of them speaks
            print(json.dumps(message, allow_nan=False), flush=True)

    final: dict[str, Any]
    summary: dict[str, Any] = {"rank": rank}
    summaries: list[dict[str, Any]] | None = None
    try:
        try:
            result = probe(spec, emit)
            final = {"result": result.to_json()}
            summary.update(
                micro_batch_size=result.micro_batch_size,
                max_fitting_micro_batch=result.max_fitting_micro_batch,
            )
        except UsageError as e:  # a bug's ValueError must show its traceback, not exit 2
            final = {"usage_error": str(e)}
            summary.update(usage_error=str(e), no_fit=isinstance(e, NoFitError))
        if nproc > 1:
            summaries = _ranks.gather(summary)  # None: the ranks never joined a group
    finally:
        _ranks.finish()
    emit(final)
    if nproc > 1:
        # rank 0 speaks for all once they joined (one writer: no lines interleave on the
        # shared pipe); otherwise each rank says its own, short line
        for line in summaries if summaries is not None else [summary]:
            if summaries is None or rank == 0:
                print(json.dumps({"rank_summary": line}, allow_nan=False), flush=True)


if __name__ == "__main__":
    main()
