"""``batchfit.profile_memory``: what any block of your code holds at its peak, measured, in the
shape of an estimate.

The block runs for real under the same allocation tracker the dry run uses (a dispatch mode
that counts every tensor storage, born and freed), so the peak comes split into weights,
gradients, optimizer state, activations and other, exactly as an estimate is; beside it the
device's own figure: ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` on CUDA, the
process's RSS high-water mark on the CPU (Linux), both measured over the block.

    with batchfit.profile_memory(model, optimizer) as prof:
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
    print(prof.result.peak_bytes, prof.result.components)

or as a decorator (``@batchfit.profile_memory(model)``): the wrapped function's last result is
on ``wrapper.profile``.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from batchfit._memwatch import status_bytes
from batchfit.memory.trace.tracker import AllocationTracker
from batchfit.views.html import estimate_html

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class MemoryProfile:
    """A measured block: components at the tracked peak (bytes), the device's own peaks."""

    components: dict[str, int]
    peak_bytes: int  # tensors alive at the block's peak (what the tracker counted)
    device: str
    device_peak_bytes: int | None  # CUDA: max_memory_allocated; CPU: RSS high-water growth
    reserved_bytes: int | None  # CUDA: max_memory_reserved over the block
    seconds: float

    def to_json(self) -> dict[str, Any]:
        return {
            "components": dict(self.components),
            "peak_bytes": self.peak_bytes,
            "device": self.device,
            "device_peak_bytes": self.device_peak_bytes,
            "reserved_bytes": self.reserved_bytes,
            "seconds": self.seconds,
        }

    def _repr_html_(self) -> str:
        data = {**self.to_json(), "model": "measured block", "engine": "measured"}
        return estimate_html(data)


class profile_memory:
    """Measure a block (``with``) or a function (decorator); see the module docstring.

    ``model`` and ``optimizer`` name what is weights, gradients and optimizer state (without
    them everything alive before the block is ``other``). ``device``: where to read the device
    peak ("cuda", "cuda:1", "cpu"); by default the model's device, else the CPU.

    Example:
        >>> net = torch.nn.Linear(256, 256)
        >>> opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        >>> with profile_memory(net, opt) as prof:
        ...     net(torch.randn(32, 256)).sum().backward()
        ...     opt.step()
        >>> prof.result.components["weights"], prof.result.components["gradients"]
        (263168, 263168)
    """

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        device: str | torch.device | None = None,
    ) -> None:
        self.model, self.optimizer = model, optimizer
        if device is None and model is not None:
            first = next(model.parameters(), None)
            device = first.device if first is not None else "cpu"
        self.device = torch.device(device or "cpu")
        self.result: MemoryProfile | None = None
        self._stack: contextlib.ExitStack | None = None

    def __enter__(self) -> profile_memory:
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(self._measure())
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._stack is not None
        self._stack.close()

    def __call__(self, fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with self:
                out = fn(*args, **kwargs)
            wrapper.profile = self.result  # type: ignore[attr-defined]
            return out

        return wrapper  # type: ignore[return-value]

    @contextlib.contextmanager
    def _measure(self) -> Iterator[None]:
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            base = torch.cuda.memory_allocated(self.device)
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # the RSS high-water mark restarts from here
            base = status_bytes("VmRSS")
        tracker = AllocationTracker()
        self._label_state(tracker)
        start = time.perf_counter()
        tracker.set_phase("forward", "")  # what the block allocates counts as activations
        try:
            with tracker:
                yield
                self._label_state(tracker)  # gradients and state the block created
        finally:
            seconds = time.perf_counter() - start
            if cuda:
                torch.cuda.synchronize(self.device)
                device_peak = torch.cuda.max_memory_allocated(self.device) - base
                reserved: int | None = torch.cuda.max_memory_reserved(self.device)
            else:
                device_peak = status_bytes("VmHWM") - base
                reserved = None
            self.result = _result(tracker, str(self.device), device_peak, reserved, seconds)

    def _label_state(self, tracker: Any) -> None:
        if self.model is not None:
            for p in self.model.parameters():
                tracker.track(p, "weights")
                if p.grad is not None:
                    tracker.track(p.grad, "gradients")
            for b in self.model.buffers():
                tracker.track(b, "weights")
        if self.optimizer is not None:
            for state in self.optimizer.state.values():
                for value in state.values():
                    if isinstance(value, torch.Tensor):
                        tracker.track(value, "optimizer_state")


def _result(
    tracker: Any, device: str, device_peak: int, reserved: int | None, seconds: float
) -> MemoryProfile:
    timeline = tracker.timeline
    best, best_index, total = -1, 0, 0
    for index, (_key, delta) in enumerate(timeline.events):
        total += delta
        if total > best:
            best, best_index = total, index + 1
    components = timeline.components(timeline.live_at(best_index))
    return MemoryProfile(
        components=components,
        peak_bytes=sum(components.values()),
        device=device,
        device_peak_bytes=device_peak,
        reserved_bytes=reserved,
        seconds=seconds,
    )
