"""kernels.emulation acts only inside its ``with`` and leaves the process clean."""

import pytest
import torch
import torch.nn.functional as F

from batchfit.hardware import get_gpu
from batchfit.memory.device.kernels import _CudaEmulation, emulation
from batchfit.memory.estimate import estimate
from batchfit.spec import TrainingSetup

ORIGINAL_SDPA = F.scaled_dot_product_attention


def _clean() -> bool:
    return F.scaled_dot_product_attention is ORIGINAL_SDPA and (
        torch._C._len_torch_function_stack() == 0
    )


def _unpatched() -> bool:
    """SDPA is torch's own and no CUDA emulation mode is on (a meta-device mode may be)."""
    modes = torch.overrides._get_current_function_mode_stack()
    return F.scaled_dot_product_attention is ORIGINAL_SDPA and not any(
        isinstance(m, _CudaEmulation) for m in modes
    )


def test_emulation_does_nothing_until_entered():
    kernels = emulation(True)
    assert _clean()
    with kernels:
        q = torch.randn(1, 2, 8, 4, requires_grad=True)
        out = F.scaled_dot_product_attention(q, q, q)
        assert out.grad_fn.name().startswith("FlashAttentionMemoryBackward")
    assert _clean()


def test_emulation_leaves_no_trace_after_an_exception():
    with pytest.raises(RuntimeError, match="boom"), emulation(True):
        raise RuntimeError("boom")
    assert _clean()


def test_a_failing_cuda_trace_leaves_the_process_clean():
    seen = []

    def model_fn() -> torch.nn.Module:
        seen.append(_unpatched())  # the user's code runs unpatched
        raise RuntimeError("the user's model_fn failed")

    with pytest.raises(RuntimeError, match="model_fn failed"):
        estimate(
            model_fn,
            TrainingSetup(precision="fp32"),
            batch_fn=lambda: torch.zeros(2, 4),
            device="cuda",
            gpu=get_gpu("a100-80gb"),
        )
    assert seen == [True]
    assert _clean()
