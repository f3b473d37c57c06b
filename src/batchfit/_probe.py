"""The model-aware probe behind ``batchfit probe``: build the model, search, report.

On the CPU the search runs in a child process (``python -m batchfit._probe SPEC``) whose OS
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
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

from batchfit._memwatch import _status_bytes
from batchfit._units import human_bytes
from batchfit.errors import UsageError

# The first trial aims this far below the predicted limit: the trace's worst error against real
# CPU steps is 1.2% (docs/benchmarks.md); on CUDA, unmeasured here, the margin is wider.
START_MARGIN = {"cpu": 0.02, "cuda": 0.05}


def child_env() -> dict[str, str]:
    """Environment for a budgeted CPU child: freed blocks go back to the kernel at once."""
    return {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "HF_HUB_OFFLINE": "1"}


def run_child(spec: dict[str, Any], on_line: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Run the probe in a fresh process; stream its trial lines; return its result line."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "batchfit._probe", json.dumps(spec)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(),
    )
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
    err = proc.stderr.read()
    proc.wait()
    if final is None:
        tail = err.strip().splitlines()[-1] if err.strip() else f"exit code {proc.returncode}"
        raise RuntimeError(f"the probe process failed: {tail}")
    if "usage_error" in final:
        raise UsageError(final["usage_error"])
    return final


@contextlib.contextmanager
def _limit_data(budget: int | None) -> Iterator[None]:
    if budget is None:
        yield
        return
    old = resource.getrlimit(resource.RLIMIT_DATA)
    resource.setrlimit(resource.RLIMIT_DATA, (_status_bytes("VmData") + budget, old[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, old)


def probe(spec: dict[str, Any], emit: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Build the model of ``spec`` on its device and search; ``emit`` gets each trial."""
    import torch

    from batchfit._oom import is_oom
    from batchfit.memory import _hf_trace, trace
    from batchfit.models import resolve_model
    from batchfit.search import find_batch_size
    from batchfit.spec import TrainingSetup

    device = torch.device(spec["device"])
    info = resolve_model(spec["model"], spec.get("task"))
    setup = TrainingSetup(**spec["setup"]).resolved(
        device="cpu" if device.type == "cpu" else "cuda",
        bf16_supported=device.type == "cpu" or torch.cuda.is_bf16_supported(),
    )
    budget = spec.get("memory_budget")
    seq = spec["seq_len"]
    warm_up(info, setup)
    room = budget
    if room is None and device.type == "cuda":
        room = torch.cuda.get_device_properties(device).total_memory
    start, per_sample, need = spec.get("start"), None, None
    if room is not None:
        predicted, per_sample, need = predict(info, setup, seq, device.type, room, spec.get("high"))
        start = start or predicted
    start = start or spec.get("high") or 1
    emit({"start": start, "bytes_per_sample": per_sample})
    failed = False
    with _limit_data(budget if device.type == "cpu" else None):
        try:
            with trace.quiet(), torch.device(device):
                parts = _hf_trace.step_parts(info, setup, micro=1, seq=seq, emulate_cuda=False)
        except (RuntimeError, MemoryError) as e:
            if not is_oom(e):
                raise
            failed = True
        if failed:
            return {
                "usage_error": f"--memory-budget {(budget or 0) / 2**30:.2f} GiB cannot even "
                "hold the model: give more (the estimate's weights figure is the minimum)"
            }
        model, opt = parts.model, parts.optimizer

        def make(n: int) -> Any:
            with torch.device(device):
                return _hf_trace.batch_fn(info, n, seq)()

        def step(batch: Any) -> None:
            # the loop the estimators trace: outputs live through backward, as in most loops
            trace.training_steps(
                model,
                opt,
                lambda: batch,
                parts.loss_of,
                autocast_dtype=parts.autocast_dtype,
                device_type=device.type,
                steps=1,
            )

        try:
            with trace.quiet():
                result = find_batch_size(
                    step,
                    make,
                    device=device,
                    memory_budget=budget,
                    low=1,
                    high=spec.get("high"),
                    start=start,
                    bytes_per_sample=per_sample,
                    choose=spec["choose"],
                    steps_per_trial=spec.get("steps_per_trial", 3),
                    model=model,
                    optimizer=opt,
                    on_trial=lambda t: emit({"trial": t.to_json()}),
                    budget_applied=device.type == "cpu",
                    restore=False,  # this process exits after the search
                )
        except ValueError as e:
            if need is None or "does not fit" not in str(e):
                raise
            raise ValueError(
                f"{e}: the trace engine puts one step at micro-batch 1 at {human_bytes(need)}"
            ) from None
    notes = stand_ins(setup)
    if notes:
        result = dataclasses.replace(result, notes=result.notes + tuple(notes))
    return {"result": result.to_json()}


def warm_up(info: Any, setup: Any) -> None:
    """One step of a 1-layer copy at a tiny size, before any limit: imports, kernels and thread
    pools are library start-up, not the training state's (the benchmarks' peers do the same)."""
    from batchfit.memory import _hf_trace, trace

    with trace.quiet():
        tiny = _hf_trace.step_parts(info, setup, micro=1, seq=8, emulate_cuda=False, depth=1)
        trace.training_steps(
            tiny.model,
            tiny.optimizer,
            tiny.make_batch,
            tiny.loss_of,
            autocast_dtype=tiny.autocast_dtype,
            steps=1,
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
            "qlora: the probe trains a 16-bit LoRA base, not 4-bit layers; the peak and speed "
            "are not QLoRA's (use `batchfit estimate` for its memory)"
        )
    return notes


def main() -> None:
    spec = json.loads(sys.argv[1])

    def emit(message: dict[str, Any]) -> None:
        print(json.dumps(message), flush=True)

    try:
        final = probe(spec, emit)
    except (UsageError, ValueError) as e:
        final = {"usage_error": str(e)}
    emit(final)


if __name__ == "__main__":
    main()
