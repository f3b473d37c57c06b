"""The trace engine: run the real training step on fake tensors and count every allocation.

The real transformers model, the real loss, ``backward()``, the real optimizer's ``step()`` and
``zero_grad(set_to_none=True)``, twice (optimizers allocate state on the first step), under
``FakeTensorMode`` on the CPU: shapes and dtypes are real, no memory is. Deep homogeneous stacks
are traced at two depths and extrapolated per layer, so a 70B model costs what 4 layers cost.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from batchfit.memory._tracker import CATEGORIES, AllocationTracker, Timeline

PHASES = ("forward", "backward", "optimizer-step", "zero-grad")


@dataclass(frozen=True)
class PhaseResult:
    """Components at one phase's peak (bytes)."""

    phase: str
    components: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.components.values())


@dataclass(frozen=True)
class TraceResult:
    """What a traced step allocated: each phase's peak, and the overall peak."""

    phases: tuple[PhaseResult, ...]
    seconds: float
    top_modules: tuple[tuple[str, int], ...] = ()
    events: tuple[tuple[int, int], ...] = field(default=(), repr=False)
    reserved_bytes: int = 0  # from the caching allocator simulation (CUDA runs only)

    @property
    def peak(self) -> PhaseResult:
        return max(self.phases, key=lambda p: p.total)


def _autocast(
    dtype: torch.dtype | None, device_type: str = "cpu"
) -> contextlib.AbstractContextManager[Any]:
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=dtype)


@contextlib.contextmanager
def fake_mode() -> Iterator[Any]:
    """A FakeTensorMode that lets real (non-fake) constants mix in, as model code needs."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        yield mode


def training_steps(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    make_batch: Callable[[], dict[str, Any]],
    loss_of: Callable[[Any, dict[str, Any]], torch.Tensor],
    *,
    autocast_dtype: torch.dtype | None = None,
    steps: int = 2,
    grad_accum_steps: int = 1,
    on_phase: Callable[[str], None] = lambda _phase: None,
    device_type: str = "cpu",
) -> None:
    """The plain training loop a dry run traces and a real run measures: one code path.

    ``out = model(**batch); loss.backward()`` keeps the outputs (logits) alive through backward;
    ``zero_grad(set_to_none=True)`` after each step.
    """
    for _ in range(steps):
        for _ in range(grad_accum_steps):
            on_phase("forward")
            batch = make_batch()
            with _autocast(autocast_dtype, device_type):
                if isinstance(batch, dict):
                    out = model(**batch)
                elif isinstance(batch, (tuple, list)):
                    out = model(*batch)
                else:
                    out = model(batch)
                loss = loss_of(out, batch)
            on_phase("backward")
            loss.backward()  # type: ignore[no-untyped-call, unused-ignore]
            del out, loss, batch
        on_phase("optimizer-step")
        optimizer.step()
        on_phase("zero-grad")
        optimizer.zero_grad(set_to_none=True)


def run_steps(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    make_batch: Callable[[], dict[str, Any]],
    loss_of: Callable[[Any, dict[str, Any]], torch.Tensor],
    *,
    autocast_dtype: torch.dtype | None = None,
    steps: int = 2,
    grad_accum_steps: int = 1,
    extra_other: Callable[[AllocationTracker], None] | None = None,
) -> TraceResult:
    """Run ``steps`` optimizer steps of ``grad_accum_steps`` micro-steps under the tracker.

    Works on fake and on real CPU tensors alike. The model's outputs are held until backward
    ends, as in the plain loop ``out = model(**batch); out.loss.backward()``.
    """
    start = time.perf_counter()
    tracker = AllocationTracker()
    for p in model.parameters():
        tracker.track(p, "weights")
    for b in model.buffers():
        tracker.track(b, "weights")
    handles = []
    for p in model.parameters():
        if p.requires_grad:
            handles.append(
                p.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call, unused-ignore]
                    lambda param: tracker.label(param.grad, "gradients")
                )
            )
    module_names = {id(m): n or "(top level: loss and outputs)" for n, m in model.named_modules()}

    stack: list[str] = []

    def enter(module: torch.nn.Module, *_: Any) -> None:
        if tracker.phase == "forward":
            stack.append(module_names.get(id(module), ""))
            tracker.module = stack[-1]

    def leave(module: torch.nn.Module, *_: Any) -> None:
        if tracker.phase == "forward" and stack:
            stack.pop()
            # Work after a submodule returns (the loss after lm_head) is its parent's.
            tracker.module = stack[-1] if stack else ""

    handles.append(torch.nn.modules.module.register_module_forward_pre_hook(enter))
    handles.append(torch.nn.modules.module.register_module_forward_hook(leave))

    def on_phase(phase: str) -> None:
        if phase in ("forward", "backward"):
            stack.clear()
            tracker.module = ""
        tracker.set_phase(phase)
        if phase == "zero-grad":  # the step just ran: its state tensors are the optimizer's
            for state in optimizer.state.values():
                for value in state.values():
                    if isinstance(value, torch.Tensor):
                        tracker.label(value, "optimizer_state")

    try:
        with tracker:
            if extra_other is not None:
                extra_other(tracker)
            training_steps(
                model,
                optimizer,
                make_batch,
                loss_of,
                autocast_dtype=autocast_dtype,
                steps=steps,
                grad_accum_steps=grad_accum_steps,
                on_phase=on_phase,
            )
    finally:
        for handle in handles:
            handle.remove()
    return _result(tracker.timeline, time.perf_counter() - start)


def _result(timeline: Timeline, seconds: float) -> TraceResult:
    phases = []
    for phase in PHASES:
        peak = timeline.phase_peaks.get(phase)
        if peak is None or peak.total < 0:
            continue
        phases.append(PhaseResult(phase, timeline.components(timeline.live_at(peak.event_index))))
    best = max(phases, key=lambda p: p.total)
    best_peak = timeline.phase_peaks[best.phase]
    by_module: dict[str, int] = {}
    for key in timeline.live_at(best_peak.event_index):
        if timeline.category(key) == "activations" and key in timeline.module_of:
            name = timeline.module_of[key]
            by_module[name] = by_module.get(name, 0) + timeline.sizes[key]
    top = tuple(sorted(by_module.items(), key=lambda kv: -kv[1])[:10])
    return TraceResult(tuple(phases), seconds, top, tuple(timeline.events))


def extrapolate(
    shallow: TraceResult, deep: TraceResult, depth_shallow: int, depth_deep: int, depth: int
) -> TraceResult:
    """Per phase and category, extend two traces of a homogeneous stack to ``depth`` layers."""
    scale = (depth - depth_shallow) / (depth_deep - depth_shallow)
    phases = []
    deep_by = {p.phase: p for p in deep.phases}
    for low in shallow.phases:
        high = deep_by.get(low.phase)
        if high is None:
            continue
        phases.append(
            PhaseResult(
                low.phase,
                {
                    c: max(
                        0,
                        round(low.components[c] + scale * (high.components[c] - low.components[c])),
                    )
                    for c in CATEGORIES
                },
            )
        )
    # The allocator's overhead (reserved beyond the peak) comes from how a few large blocks
    # fit into segments, not from a per-layer term: extrapolating it amplifies noise, so the
    # larger of the two traced overheads is carried over.
    over_low = shallow.reserved_bytes - shallow.peak.total
    over_high = deep.reserved_bytes - deep.peak.total
    result = TraceResult(tuple(phases), shallow.seconds + deep.seconds, deep.top_modules)
    if shallow.reserved_bytes or deep.reserved_bytes:
        result = replace(result, reserved_bytes=result.peak.total + max(0, over_low, over_high))
    return result


def quiet() -> contextlib.AbstractContextManager[Any]:
    """Silence library warnings during a dry run (they are about fake inputs, not the user)."""
    stack = contextlib.ExitStack()
    stack.enter_context(warnings.catch_warnings())
    warnings.simplefilter("ignore")
    try:
        from transformers.utils import logging as hf_logging

        level = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # type: ignore[no-untyped-call, unused-ignore]
        stack.callback(hf_logging.set_verbosity, level)
    except ImportError:
        pass
    return stack
