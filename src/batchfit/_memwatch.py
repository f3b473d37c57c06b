"""Memory budgets and peak measurement for real trials, on CUDA and on the CPU.

On CUDA a budget is the process's memory fraction of the caching allocator, and the peak is
``max_memory_allocated``. On the CPU a budget is an OS limit on the data segment
(``RLIMIT_DATA``), so an over-budget step really fails with the allocator's error, and the peak
is the kernel's RSS high-water mark (reset through ``/proc/self/clear_refs`` before each trial).
Limits and fractions are restored on exit. Under ``torch.distributed`` every decision is agreed
between ranks: a trial fails if any rank failed, and all ranks take the same next size.
"""

from __future__ import annotations

import resource
from types import TracebackType
from typing import Any

import torch

from batchfit._libc import libc as _libc
from batchfit._oom import _malloc_trim
from batchfit._units import human_bytes
from batchfit.errors import NoFitError

PROC_STATUS = "/proc/self/status"


def status_bytes(field: str) -> int:
    """A ``kB`` field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``, ``VmData``) in bytes.

    Raises ``OSError`` where the figure cannot be read (no procfs: not Linux; or the kernel
    does not report ``field``), never a stand-in value: the search sets its OS limit and
    measures its peaks from these figures, and a silent 0 would set a limit far below what
    the process holds or report a peak of nothing. A caller that can do without the figure
    (the Transformers callback off Linux) checks for ``PROC_STATUS`` first.

    Example:
        >>> status_bytes("VmRSS") > 0
        True
    """
    with open(PROC_STATUS) as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"{PROC_STATUS} has no {field} line: this kernel does not report it")


def _return_freed_blocks(on: bool) -> None:
    """glibc: serve blocks of 64 KiB and more by mmap, so a freed tensor leaves the process
    and the RSS high-water mark follows each step (the CLI's child sets this through
    ``MALLOC_MMAP_THRESHOLD_``); off: glibc's initial threshold, 128 KiB."""
    mallopt = getattr(_libc(), "mallopt", None)  # glibc only
    if mallopt is not None:
        mallopt(-3, 65536 if on else 128 * 1024)  # M_MMAP_THRESHOLD
    _malloc_trim()


def live_bytes(model: torch.nn.Module | None, optimizer: Any | None) -> int:
    """Bytes of the model's parameters, gradients and buffers and of the optimizer's state."""
    seen: set[int] = set()
    total = 0

    def add(t: Any) -> None:
        nonlocal total
        local = getattr(t, "_local_tensor", None)  # FSDP2's DTensor: this rank's shard
        if isinstance(local, torch.Tensor):
            t = local
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()

    if model is not None:
        for p in model.parameters():
            add(p)
            add(p.grad)
        for b in model.buffers():
            add(b)
    if optimizer is not None:
        for state in optimizer.state.values():
            for value in state.values():
                add(value)
    return total


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


class MemoryWatch:
    """Applies a memory budget for the duration of a search and measures each trial's peak."""

    def __init__(
        self,
        device: torch.device,
        budget_bytes: int | None,
        *,
        model: torch.nn.Module | None = None,
        optimizer: Any | None = None,
        budget_applied: bool = False,
    ) -> None:
        self.device = device
        self.budget = budget_bytes
        self.budget_applied = budget_applied
        self.model, self.optimizer = model, optimizer
        self.live = live_bytes(model, optimizer)
        self.available_bytes: int | None = None
        self._old_limit: tuple[int, int] | None = None
        self._base = 0

    # --- the budget ------------------------------------------------------------------------
    def __enter__(self) -> MemoryWatch:
        if self.device.type == "cuda":
            total = torch.cuda.get_device_properties(self.device).total_memory
            if self.budget is not None:
                if self.budget > total:
                    raise ValueError(f"memory budget {self.budget} B exceeds the GPU's {total} B")
                torch.cuda.set_per_process_memory_fraction(self.budget / total, self.device)
            self.available_bytes = self.budget or total
        elif self.budget is not None and self.budget_applied:
            # The caller set the OS limit before the model was built. RLIMIT_DATA counts address
            # space, not resident memory: the room a step may grow into is what is left under the
            # limit now; trials measure growth, so the fit compares like with like.
            soft = resource.getrlimit(resource.RLIMIT_DATA)[0]
            self.available_bytes = soft - status_bytes("VmData") + self.live
        elif self.budget is not None:
            if self.budget <= self.live:
                raise NoFitError(
                    f"a budget of {human_bytes(self.budget)} is below the "
                    f"{human_bytes(self.live)} the model and optimizer already hold: give more"
                )
            _return_freed_blocks(True)
            self._old_limit = resource.getrlimit(resource.RLIMIT_DATA)
            soft = status_bytes("VmData") + self.budget - self.live
            hard = self._old_limit[1]
            if hard != resource.RLIM_INFINITY:
                soft = min(soft, hard)
            resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
            self.available_bytes = self.budget
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._old_limit is not None:
            resource.setrlimit(resource.RLIMIT_DATA, self._old_limit)
            _return_freed_blocks(False)
        if self.device.type == "cuda" and self.budget is not None:
            torch.cuda.set_per_process_memory_fraction(1.0, self.device)

    # --- measuring -------------------------------------------------------------------------
    def reset_peak(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        if self.model is not None or self.optimizer is not None:
            # what is alive now: state a failed trial created (optimizer moments) counts too
            self.live = live_bytes(self.model, self.optimizer)
        _malloc_trim()  # free heap pages leave: a step's growth shows in the RSS
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        self._base = status_bytes("VmRSS")

    def peak_bytes(self) -> int:
        """The trial's peak of the training state (weights included), comparable to budgets."""
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return status_bytes("VmHWM") - self._base + self.live

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def drop_gradients(self) -> None:
        """A failed step's partial gradients must not leak into the next trial."""
        if self.model is not None:
            self.model.zero_grad(set_to_none=True)
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)

    # --- agreement between ranks ---------------------------------------------------------------
    def agree(self, ok: bool) -> bool:
        """All ranks fail a trial if any rank ran out of memory (all-reduce MIN of a flag)."""
        if not _distributed():
            return ok
        flag = torch.tensor([1 if ok else 0], dtype=torch.uint8, device=self._comm_device())
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
        return bool(flag.item())

    def agree_size(self, size: int | None) -> int | None:
        """All ranks take the smallest proposal for the next size (0: stop)."""
        if not _distributed():
            return size
        value = torch.tensor([size or 0], dtype=torch.int64, device=self._comm_device())
        torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MIN)
        return int(value.item()) or None

    def agree_speed(self, speed: float) -> float:
        """A step is as fast as the slowest rank."""
        if not _distributed():
            return speed
        value = torch.tensor([speed], dtype=torch.float64, device=self._comm_device())
        torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MIN)
        return float(value.item())

    def _comm_device(self) -> torch.device:
        backend = torch.distributed.get_backend()
        return self.device if backend == "nccl" else torch.device("cpu")
