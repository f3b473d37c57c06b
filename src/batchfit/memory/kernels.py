"""CUDA kernels' memory in a CPU dry run, kept at this path; it lives in
``batchfit.memory.device.kernels``."""

from batchfit.memory.device.kernels import (
    FlashAttentionMemory,
    cuda_autocast_policy,
    cuda_kernels,
    emulation,
)

__all__ = ["FlashAttentionMemory", "cuda_autocast_policy", "cuda_kernels", "emulation"]
