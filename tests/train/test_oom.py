"""``batchfit._oom.is_oom``: the type first, then the listed messages; a real CPU OOM counts."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from batchfit._oom import is_oom, release_memory


@pytest.mark.parametrize(
    "exc",
    [
        torch.OutOfMemoryError("anything"),
        MemoryError(),
        RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronous"),
        RuntimeError("HIP out of memory. Tried to allocate 2.00 GiB"),
        RuntimeError("XPU out of memory, please use `empty_cache` to release all unoccupied"),
        RuntimeError("MPS backend out of memory (MPS allocated: 1.2 GB)"),
        RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
    ],
)
def test_out_of_memory(exc: BaseException) -> None:
    assert is_oom(exc)


@pytest.mark.parametrize(
    "exc",
    [
        RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 4x3)"),
        RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED"),
        ValueError("CUDA out of memory"),  # not a RuntimeError: somebody else's message
        KeyboardInterrupt(),
    ],
)
def test_not_out_of_memory(exc: BaseException) -> None:
    assert not is_oom(exc)


def test_real_cpu_allocator_failure() -> None:
    """PyTorch's own message under an OS limit, from a child process."""
    code = (
        "import resource, torch\n"
        "from batchfit._oom import is_oom\n"
        "resource.setrlimit(resource.RLIMIT_DATA, (2**30, resource.RLIM_INFINITY))\n"
        "try:\n"
        "    torch.empty(2**31, dtype=torch.uint8)\n"
        "except Exception as exc:\n"
        "    print(type(exc).__name__, is_oom(exc), 'DefaultCPUAllocator' in str(exc))\n"
    )
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=True,
    )
    name, oom, cpu_message = out.stdout.split()
    assert (oom, cpu_message) == ("True", "True")
    assert name in ("RuntimeError", "OutOfMemoryError")


def test_release_memory_runs_without_cuda() -> None:
    release_memory()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_real_cuda_oom_and_release() -> None:
    total = torch.cuda.get_device_properties(0).total_memory
    try:
        torch.empty(2 * total, dtype=torch.uint8, device="cuda")
    except Exception as exc:
        assert is_oom(exc)
    else:
        pytest.fail("allocating twice the GPU's memory succeeded")
    release_memory()
    assert torch.cuda.memory_reserved() < total // 2
