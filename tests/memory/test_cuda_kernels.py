"""The CUDA emulation keeps what an H100 kept (benchmarks/data/gpu_validate_h100.json):
SDPA under autocast on 16-bit copies, its output in (batch, seq, heads, dim) memory, a boolean
mask turned into a saved 16-bit bias, dropout's bool mask."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from batchfit.hardware import get_gpu
from batchfit.memory.device.kernels import cuda_autocast_policy, cuda_kernels
from batchfit.memory.estimate import estimate
from batchfit.models import resolve_model
from batchfit.spec import TrainingSetup

MEASURED = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "gpu_validate_h100.json"


def _saved(out: torch.Tensor) -> list[torch.Tensor]:
    return [t for t in out.grad_fn.saved_tensors if t is not None]


def test_sdpa_under_autocast_saves_16bit_copies_of_fp32_inputs():
    q = torch.randn(2, 4, 64, 16, requires_grad=True)  # fp32, as after Qwen3's q_norm
    with torch.autocast("cpu", dtype=torch.bfloat16), cuda_autocast_policy():
        out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert out.dtype == torch.bfloat16
    assert {t.dtype for t in _saved(out) if t.dim() == 4} == {torch.bfloat16}


def test_sdpa_output_needs_no_copy_to_go_back_to_batch_major():
    q = torch.randn(2, 4, 64, 16, requires_grad=True)
    with cuda_kernels():
        out = F.scaled_dot_product_attention(q, q, q)
    assert out.shape == q.shape
    assert out.transpose(1, 2).is_contiguous()  # the model's .contiguous() copies nothing


@pytest.mark.parametrize(
    ("mask", "bias_shape", "bias_dtype"),
    [
        (torch.ones(2, 1, 64, 64, dtype=torch.bool), (2, 1, 64, 64), torch.float32),
        (torch.zeros(2, 1, 64, 50), (2, 1, 64, 64), torch.float32),  # padded to 16
    ],
)
def test_sdpa_with_a_mask_saves_the_kernel_bias(mask, bias_shape, bias_dtype):
    q = torch.randn(2, 4, 64, 16, requires_grad=True)
    k = torch.randn(2, 4, mask.shape[-1], 16)
    with cuda_kernels():
        out = F.scaled_dot_product_attention(q, k, k, attn_mask=mask)
    biases = [t for t in _saved(out) if t.shape[:2] == (2, 1)]
    assert len(biases) == 1
    assert biases[0].dtype == bias_dtype
    assert biases[0].untyped_storage().nbytes() == 4 * torch.Size(bias_shape).numel()


def test_dropout_saves_a_bool_mask_as_cuda_does():
    x = torch.randn(64, 128, requires_grad=True)
    with cuda_kernels():
        y = F.dropout(x, 0.1, training=True)
    assert y.grad_fn.name() == "NativeDropoutBackward0"
    assert y.grad_fn._saved_result1.dtype == torch.bool
    with cuda_kernels():
        assert F.dropout(x, 0.1, training=False) is x  # eval: untouched


@pytest.mark.slow
@pytest.mark.parametrize("case_id", ["c03", "c05", "c12"])
def test_trace_matches_h100_max_memory_allocated(case_id):
    """The cases whose H100 memory histories found these kernels' costs: within 1%."""
    raw = json.loads(MEASURED.read_text())
    case = next(c for c in raw["cases"] if c["id"] == case_id)
    measured = raw["results"][case_id]["max_allocated_bytes"]
    info = resolve_model(case["model"], case["task"])
    gpu = get_gpu("h100-80gb")
    setup = TrainingSetup(**case["setup"]).resolved(device="cuda", bf16_supported=True)
    est = estimate(
        info, setup, micro_batch_size=case["micro"], seq_len=case["seq"], gpu=gpu, device="cuda"
    )
    assert est.peak_bytes == pytest.approx(measured, rel=0.01)
