"""The one test for "this failed because memory ran out", and giving memory back afterwards.

Every search and recovery path (probe, ``MicroBatcher``) asks :func:`is_oom`; nothing else in
batchfit matches error messages.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable

import torch

from batchfit._libc import libc as _libc

# torch.OutOfMemoryError is public from torch 2.5; before, the same class lived in torch.cuda.
OutOfMemoryError: type[RuntimeError] = getattr(
    torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError
)
# torch.cuda.is_initialized carries no annotations: typed once here for mypy --strict.
_cuda_initialized: Callable[[], bool] = torch.cuda.is_initialized
_OOM_TYPES: tuple[type[BaseException], ...] = (
    OutOfMemoryError,
    MemoryError,  # Python-level allocations (collation, numpy) under an OS limit
)

# Allocation failures that reach Python as a plain RuntimeError, by backend. Only real
# allocation failures: halving the batch fixes these and nothing else.
_OOM_MESSAGES = (
    "CUDA out of memory",  # caching allocator on old torch (no OutOfMemoryError type yet)
    "CUDA error: out of memory",  # cudaMalloc outside the caching allocator (context, cuBLAS)
    "HIP out of memory",  # ROCm caching allocator
    "hipErrorOutOfMemory",  # ROCm runtime
    "XPU out of memory",  # Intel GPUs
    "MPS backend out of memory",  # Apple GPUs
    "DefaultCPUAllocator: can't allocate memory",  # CPU allocator, e.g. under RLIMIT_DATA
    "DefaultCPUAllocator: not enough memory",  # CPU allocator on Windows
    "CUBLAS_STATUS_ALLOC_FAILED",  # cuBLAS handle / workspace allocation
    "CUDNN_STATUS_ALLOC_FAILED",  # cuDNN workspace allocation
    "PT_DEVMEM Allocation failed",  # Habana HPU
)
# Not listed: CUDNN_STATUS_NOT_SUPPORTED (accelerate treats it as OOM). It also means a
# genuinely unsupported configuration, and halving down to a micro-batch of 1 would hide it.


def is_oom(exc: BaseException) -> bool:
    """Whether ``exc`` means an allocation failed, on any device.

    The exception type decides first (``torch.OutOfMemoryError``, ``MemoryError``); then the
    message of a ``RuntimeError``, for the backends that raise one (see ``_OOM_MESSAGES``).

    Example:
        >>> is_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
        True
        >>> is_oom(RuntimeError("[enforce fail at alloc_cpu.cpp:117] "
        ...                     "DefaultCPUAllocator: can't allocate memory: you tried ..."))
        True
        >>> is_oom(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
        False
    """
    if isinstance(exc, _OOM_TYPES):
        return True
    if isinstance(exc, RuntimeError):
        text = str(exc)
        return any(message in text for message in _OOM_MESSAGES)
    return False


def release_memory() -> None:
    """Give memory back after a caught OOM: collect cycles, empty the CUDA cache, trim the heap.

    Call it after the ``except`` block has ended, when the traceback (and with it the failed
    step's tensors) is gone.
    """
    gc.collect()
    if torch.cuda.is_available() and _cuda_initialized():
        torch.cuda.empty_cache()
    if sys.platform.startswith("linux"):
        _malloc_trim()


def _malloc_trim() -> None:
    # glibc keeps freed heap pages; under RLIMIT_DATA they still count.
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None)  # musl and other libcs have none
    if trim is not None:
        trim(0)
