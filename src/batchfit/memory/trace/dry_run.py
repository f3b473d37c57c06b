"""The trace engine: run the real training step on fake tensors and count every allocation.

The real transformers model, the real loss, ``backward()``, the real optimizer's ``step()`` and
``zero_grad(set_to_none=True)`` (a first optimizer step on zero gradients creates the state), under
``FakeTensorMode`` on the CPU: shapes and dtypes are real, no memory is. Deep homogeneous stacks
are traced at two depths and extrapolated per layer, so a 70B model costs what 4 layers cost.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from batchfit.memory.trace.moments import Moments, tag_layers
from batchfit.memory.trace.result import (
    PHASES,
    LayerLog,
    MomentLog,
    PhaseResult,
    TraceResult,
    extrapolate,
    moments_of,
)
from batchfit.memory.trace.tracker import AllocationTracker, Layer, Timeline
from batchfit.spec import Loop

__all__ = [
    "PHASES",
    "FirstStepNotReplayable",
    "PhaseResult",
    "TraceResult",
    "extrapolate",
    "fake_mode",
    "layer_stacks",
    "quiet",
    "run_steps",
    "training_steps",
]


def _autocast(
    dtype: torch.dtype | None, device_type: str = "cpu"
) -> contextlib.AbstractContextManager[Any]:
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=dtype)


@contextlib.contextmanager
def fake_mode() -> Iterator[Any]:
    """A FakeTensorMode that lets real (non-fake) constants mix in, as model code needs."""
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        yield mode


def _call(model: torch.nn.Module, batch: Any) -> Any:
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


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
    loop: Loop = "trainer",
) -> None:
    """The training loop a dry run traces and a real run measures: one code path.

    ``loop="trainer"``: only the loss outlives forward, as in HF Trainer (``compute_loss``
    returns the loss, then ``del inputs``) and Lightning (``training_step`` returns the loss).
    ``"keep-outputs"``: ``out = model(**batch); out.loss.backward()`` holds the outputs (the
    logits) through backward, as hand-written loops do. ``zero_grad(set_to_none=True)``
    after each step.
    """
    for _ in range(steps):
        for _ in range(grad_accum_steps):
            on_phase("forward")
            batch = make_batch()
            with _autocast(autocast_dtype, device_type):
                out = _call(model, batch)
                loss = loss_of(out, batch)
            kept = (out, batch) if loop == "keep-outputs" else ()
            del out, batch
            on_phase("backward")
            loss.backward()  # type: ignore[no-untyped-call, unused-ignore]
            del loss, kept
        on_phase("optimizer-step")
        optimizer.step()
        on_phase("zero-grad")
        optimizer.zero_grad(set_to_none=True)


def layer_stacks(model: torch.nn.Module) -> tuple[tuple[torch.nn.Module, ...], ...]:
    """The model's stacks of repeated layers (decoder, encoder), in forward order.

    A stack is an ``nn.ModuleList`` of modules of one class, not nested in another stack
    (T5's ``block[i].layer`` is a list inside a layer).
    """
    stacks: list[tuple[torch.nn.Module, ...]] = []
    inside: set[int] = set()
    for module in model.modules():
        if id(module) in inside or not isinstance(module, torch.nn.ModuleList) or not len(module):
            continue
        if len({type(m) for m in module}) == 1 and isinstance(module[0], torch.nn.Module):
            stacks.append(tuple(module))
            inside.update(id(m) for layer in module for m in layer.modules())
    return tuple(stacks)


def _prime(optimizer: torch.optim.Optimizer, events: list[tuple[int, int]]) -> tuple[int, int]:
    """The first optimizer step on zero gradients: it creates the optimizer's state.

    A first step's forward and backward peak below the second's (the state does not exist
    yet), so only its effect matters, and a dry run saves half its time. Returns where the
    ``step()`` began and ended in ``events``: what a real first step's ``step()`` allocates
    (the state, then its temporaries), gradients of any value being alike to it.
    """
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.requires_grad:
                param.grad = torch.zeros_like(param)
    begin = len(events)
    optimizer.step()
    end = len(events)
    optimizer.zero_grad(set_to_none=True)
    return begin, end


class FirstStepNotReplayable(Exception):
    """The primed run cannot stand for a whole first step: the priming step's gradients
    outlived its ``zero_grad`` (gradients zeroed, not dropped, as before torch 2.0), where a
    real first step allocates them in its backward."""


def _whole_first_step(
    timeline: Timeline, primed: tuple[int, int, int]
) -> tuple[tuple[tuple[int, int], ...], LayerLog]:
    """The allocator's history of a whole first step then the measured one, from a primed run,
    and which layer made each of its events.

    ``primed``: where the prime's gradients began and its ``step()`` began and ended. A real
    first step runs the measured step's forward and backward (the same operators on the same
    shapes), then the prime's ``step()`` (it creates the state), then frees the gradients as
    the measured step does; the measured step follows as it ran. Tensors the first step makes
    get keys of their own; it frees nothing it did not make.
    """
    events, layers, marks = timeline.events, timeline.event_layers, timeline.phase_marks
    grads_begin, step_begin, step_end = primed
    measured = next(i for i, phase in marks if phase == "forward" and i >= step_end)
    grads = {key for key, delta in events[grads_begin:step_begin] if delta > 0}
    if grads - {key for key, delta in events[step_end:measured] if delta < 0}:
        raise FirstStepNotReplayable
    optimizer = next(i for i, phase in marks if phase == "optimizer-step" and i >= measured)
    zero = next(i for i, phase in marks if phase == "zero-grad" and i >= optimizer)
    fresh: dict[int, int] = {}
    top = max((key for key, _ in events), default=0)
    key_layers = dict(timeline.key_layers)
    out: list[tuple[int, int]] = [*events[:grads_begin]]
    out_layers: list[Layer | None] = [*layers[:grads_begin]]

    def copy(begin: int, end: int) -> None:
        for (key, delta), layer in zip(events[begin:end], layers[begin:end], strict=True):
            if delta > 0:
                new = fresh.setdefault(key, top + 1 + len(fresh))
                if key in key_layers:
                    key_layers[new] = key_layers[key]
            elif key not in fresh:
                continue
            out.append((fresh[key], delta))
            out_layers.append(layer)

    copy(measured, optimizer)
    out.extend(events[step_begin:step_end])
    out_layers.extend(layers[step_begin:step_end])
    copy(zero, len(events))
    out.extend(events[measured:])
    out_layers.extend(layers[measured:])
    return tuple(out), LayerLog(tuple(out_layers), key_layers, timeline.stack_depths)


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
    loop: Loop = "trainer",
    gemm_scratch: bool = False,
    prime: bool = True,
    gloo_scratch: bool = False,
    replay_first_step: bool = False,
    samples: int = 1,
) -> TraceResult:
    """Run ``steps`` optimizer steps of ``grad_accum_steps`` micro-steps under the tracker.

    Works on fake and on real CPU tensors alike; ``loop`` as in :func:`training_steps`. All but
    the last step are primed (:func:`_prime`): only the last one's moments are measured.
    ``prime=False`` runs every step whole, for the allocator simulation: a real first step
    creates the optimizer state after its backward, in blocks the freed activations left,
    which fragments the cache the later steps run in (measured on an H100: qwen2.5-1.5b, 8 x
    256, reserved 36.9 GiB; simulated 32.9 after a primed step, 36.7 after a whole one).
    ``gemm_scratch``: count the CPU bf16 fallback matmul's fp32 accumulator
    (:class:`AllocationTracker`); for a step that runs on such a CPU. ``gloo_scratch``: count
    gloo's copy of each reduce-scatter's input; for sharded CPU ranks. ``replay_first_step``
    (with ``prime``): the result's ``events`` are the allocator's history of a whole first step
    then the measured one (:func:`_whole_first_step`), as ``prime=False`` records them, at
    half its cost; its ``timeline`` is the primed run's. ``samples``: the micro-batch size, by
    which the result's ``flops`` (per micro-step, counted by the tracker) are divided.
    """
    start = time.perf_counter()
    tracker = AllocationTracker(gemm_scratch, gloo_scratch)
    handles = _track_parameters(tracker, model)
    modules = _ForwardModules(tracker, model)
    handles.extend(modules.handles)
    stacks = layer_stacks(model)
    tag_layers(tracker, stacks)
    moments = Moments(tracker, stacks)
    handles.extend(moments.handles)

    def on_phase(phase: str) -> None:
        if phase in ("forward", "backward"):
            modules.reset()
        moments.enter(phase)
        _label_step_tensors(tracker, model, optimizer, phase)

    try:
        with tracker:
            if extra_other is not None:
                extra_other(tracker)
            primed = None
            if steps > 1 and prime:
                grads_begin = len(tracker.timeline.events)
                primed = (grads_begin, *_prime(optimizer, tracker.timeline.events))
                on_phase("zero-grad")  # labels the state; the next step is step 2
                steps -= 1
            training_steps(
                model,
                optimizer,
                make_batch,
                loss_of,
                autocast_dtype=autocast_dtype,
                steps=steps,
                grad_accum_steps=grad_accum_steps,
                on_phase=on_phase,
                loop=loop,
            )
    finally:
        for handle in handles:
            handle.remove()
    result = _result(tracker.timeline, time.perf_counter() - start, _flops(tracker, samples))
    if replay_first_step and primed is not None:
        events, layers = _whole_first_step(tracker.timeline, primed)
        result = replace(result, events=events, layers=layers)
    return result


def _track_parameters(tracker: AllocationTracker, model: torch.nn.Module) -> list[Any]:
    """Count the model's parameters and buffers as weights, and each gradient as a gradient
    once accumulated; returns the hooks' handles."""
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
    return handles


class _ForwardModules:
    """Tells the tracker whose forward is running (the innermost module), so that each
    activation is attributed to the module that made it."""

    def __init__(self, tracker: AllocationTracker, model: torch.nn.Module):
        self.tracker = tracker
        self.names = {id(m): n or "(top level: loss and outputs)" for n, m in model.named_modules()}
        self.stack: list[str] = []
        self.handles = [
            torch.nn.modules.module.register_module_forward_pre_hook(self._enter),
            torch.nn.modules.module.register_module_forward_hook(self._leave),
        ]

    def _enter(self, module: torch.nn.Module, *_: Any) -> None:
        if self.tracker.phase == "forward":
            self.stack.append(self.names.get(id(module), ""))
            self.tracker.module = self.stack[-1]

    def _leave(self, module: torch.nn.Module, *_: Any) -> None:
        if self.tracker.phase == "forward" and self.stack:
            self.stack.pop()
            # Work after a submodule returns (the loss after lm_head) is its parent's.
            self.tracker.module = self.stack[-1] if self.stack else ""

    def reset(self) -> None:
        """Outside any module: a forward or a backward begins."""
        self.stack.clear()
        self.tracker.module = ""


def _label_step_tensors(
    tracker: AllocationTracker,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    phase: str,
) -> None:
    """Label what no hook sees as it is made, as ``phase`` begins: the gradients before the
    optimizer step, the optimizer's state after it."""
    if phase == "optimizer-step":  # FSDP2 sets its sharded gradients without a hook
        for param in model.parameters():
            if param.grad is not None:
                tracker.label(param.grad, "gradients")
    if phase == "zero-grad":  # the step just ran: its state tensors are the optimizer's
        for owner, state in optimizer.state.items():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    tracker.label(value, "optimizer_state")
                    tracker.same_layer(value, owner)


def _flops(tracker: AllocationTracker, samples: int) -> tuple[float, float, float, float]:
    """Each sample's FLOPs in one micro-step (forward; backward with any recompute), then the
    bytes its other operators move (forward; backward)."""
    per = max(tracker.forwards, 1) * max(samples, 1)
    flops, traffic = tracker.flops, tracker.traffic
    return (
        flops["forward"] / per,
        flops["backward"] / per,
        traffic["forward"] / per,
        traffic["backward"] / per,
    )


def _result(
    timeline: Timeline, seconds: float, flops: tuple[float, float, float, float]
) -> TraceResult:
    events = tuple(timeline.events)
    log = MomentLog(
        events,
        tuple(timeline.moment_marks),
        {key: timeline.category(key) for key in timeline.sizes},
        dict(timeline.module_of),
        flops,
    )
    phases, top = moments_of(events, log)
    layers = LayerLog(tuple(timeline.event_layers), timeline.key_layers, timeline.stack_depths)
    return TraceResult(
        phases, seconds, top, events, timeline=timeline, layers=layers, moments=log, flops=flops
    )


def quiet() -> contextlib.AbstractContextManager[Any]:
    """Silence library warnings during a dry run (they are about fake inputs, not the user)."""
    stack = contextlib.ExitStack()
    stack.enter_context(warnings.catch_warnings())
    warnings.simplefilter("ignore")
    try:
        # lazy: transformers (~1 s); a user's own module needs none of it
        from transformers.utils import logging as hf_logging

        level = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # type: ignore[no-untyped-call, unused-ignore]
        stack.callback(hf_logging.set_verbosity, level)
    except ImportError:
        pass
    return stack
