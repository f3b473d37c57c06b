"""The model-aware probe behind ``batchfit probe``: build the model, search, report.

On the CPU the search runs in a child process (``python -m batchfit.search.probe SPEC``) whose OS
data limit is set before the model is built, with glibc returning freed blocks to the kernel
(``MALLOC_MMAP_THRESHOLD_``), so an over-budget step fails for real and a fresh budget applies.
The child prints one JSON line per trial and a last line with the result.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import torch

from batchfit import search
from batchfit._oom import is_oom
from batchfit._units import human_bytes
from batchfit.errors import NoFitError, RankFailure, UsageError
from batchfit.memory.trace import dry_run as trace
from batchfit.memory.trace import hf as _hf_trace
from batchfit.models import resolve_model
from batchfit.search import _ranks
from batchfit.search._child import child_env, limit_data, run_child
from batchfit.search._child import die_with_parent as _die_with_parent
from batchfit.search._predict import (
    START_MARGIN,
    calibration_record,
    check_budget,
    predict,
    record_calibration,
    run_setup,
    stand_ins,
    warm_up,
)
from batchfit.search._ranks import SHARDINGS as SHARDINGS
from batchfit.search._report import AccumulationPlan, ProbeReport, report
from batchfit.search._trials import SearchResult
from batchfit.spec import TrainingSetup

# What callers reach as ``_probe.NAME``: the CLI, the benchmarks, the tests.
__all__ = [
    "START_MARGIN",
    "AccumulationPlan",
    "ProbeReport",
    "calibration_record",
    "check_budget",
    "child_env",
    "main",
    "make_spec",
    "predict",
    "probe",
    "report",
    "run",
    "run_child",
    "run_ranks",
    "run_setup",
    "stand_ins",
    "warm_up",
]


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
    env = child_env() if spec["device"] == "cpu" else {**os.environ, "HF_HUB_OFFLINE": "1"}
    final, ranks = _ranks.launch(spec, env, on_line)
    assert final is not None
    if "usage_error" in final:
        raise UsageError(final["usage_error"])
    result = SearchResult.from_json(final["result"])
    chosen = {(r["micro_batch_size"], r["max_fitting_micro_batch"]) for r in ranks}
    if chosen != {(result.micro_batch_size, result.max_fitting_micro_batch)}:
        raise RankFailure(f"the ranks disagree on the micro-batch: {sorted(chosen)}")
    return result


def probe(spec: dict[str, Any], emit: Callable[[dict[str, Any]], None]) -> SearchResult:
    """Build the model of ``spec`` on its device and search; ``emit`` gets each trial.

    Raises:
        NoFitError: the model, or one step at micro-batch 1, does not fit.
    """
    rank, nproc = _ranks.world()
    device = torch.device(spec["device"])
    info = resolve_model(spec["model"], spec.get("task"))
    setup = run_setup(info, TrainingSetup(**spec["setup"]), device.type)
    budget = (spec.get("rank_budgets") or [spec.get("memory_budget")] * nproc)[rank]
    spec = {**spec, "memory_budget": budget}
    warm_up(info, setup)
    # what the libraries made (torch._dynamo's modules with the first optimizer) out of the
    # collector's reach: each caught OOM's gc.collect (release_memory) scans the trials' objects
    gc.collect()
    gc.freeze()
    start, per_sample, need = _start(spec, info, setup, device)  # before any process group
    wrap = None
    if nproc > 1:
        device = _ranks.init(device.type)
        start = _ranks.agree_min(start, device)
        wrap = _ranks.wrapper(setup, device)
    emit({"start": start, "bytes_per_sample": per_sample})
    with limit_data(budget if device.type == "cpu" else None):
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
        notes += record_calibration(result, info, setup, spec["seq_len"], device)
    if nproc > 1:
        notes.append(_ranks.note(setup, nproc, "gloo" if device.type == "cpu" else "nccl"))
    if notes:
        result = dataclasses.replace(result, notes=result.notes + tuple(notes))
    return result


def _start(
    spec: dict[str, Any], info: Any, setup: Any, device: Any
) -> tuple[int, int | None, int | None]:
    """The first size, the bytes a sample adds and the peak at 1 (None: no budget to aim at)."""
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
        return search.find_batch_size(  # looked up here: tests replace it
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


def main() -> None:
    """The child: one JSON line per trial, then the result or the user's error."""
    _die_with_parent()
    spec = json.loads(sys.argv[1])

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
    # Everything is said and flushed, the process group is gone: skip the interpreter's
    # teardown of torch and transformers (1-5 s on a loaded machine) the parent would wait on.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
