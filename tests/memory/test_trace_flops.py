"""The dry run counts the FLOPs of the step it runs (torch's FLOP formulas for matmuls and
convolutions, the emulated attention kernels' own count), per sample: a catalog ViT-Base's
forward is the published 17.56 GMACs; backward is twice forward, plus the recomputed forward
under checkpointing (up to where torch's checkpoint stops it); the count is the same per
sample at any micro-batch size, a line in the depth, and kept by the cache. An image model's
step is timed from it, with the bytes the other operators move."""

from __future__ import annotations

from dataclasses import replace

import pytest

from batchfit.hardware import get_gpu
from batchfit.memory.device import kernels
from batchfit.memory.estimate import estimate
from batchfit.memory.trace.result import (
    CATEGORIES,
    PhaseResult,
    TraceResult,
    extrapolate,
    result_from_json,
    result_to_json,
)
from batchfit.models import resolve_model
from batchfit.spec import TrainingSetup
from batchfit.speed import step_time

# ViT-B/16 at 224 px: 17.56 GMACs a forward (the ViT paper's and timm's count: patch
# embedding, 12 layers' projections and MLP over 197 tokens, and attention's two matmuls)
VIT_B_FORWARD = 2 * 17.56e9


@pytest.fixture(scope="module")
def vit() -> object:
    return resolve_model("vit-base-patch16-224", task="image-classification")


def _flops(model: object, micro: int, **setup: object) -> tuple[float, float]:
    est = estimate(
        model,  # type: ignore[arg-type]
        TrainingSetup(**setup),  # type: ignore[arg-type]
        micro_batch_size=micro,
        seq_len=224,
        gpu=get_gpu("t4"),
    )
    forward, backward, moved_forward, moved_backward = est.extras["flops_per_sample"]
    assert moved_forward > 0 and moved_backward > 0  # the other operators' bytes
    return forward, backward


def test_vit_base_forward_is_its_published_count_and_backward_twice_it(vit):
    forward, backward = _flops(vit, 2)
    assert forward == pytest.approx(VIT_B_FORWARD, rel=0.002)
    # input gradients and weight gradients (none for the pixels), attention's 5 matmuls to 2
    assert backward / forward == pytest.approx(2.0, abs=0.03)
    assert not kernels.FLOP_SINKS  # the attention kernels report to no one after the run


def test_the_count_is_per_sample_and_checkpointing_adds_the_recomputed_forward(vit):
    forward, backward = _flops(vit, 2)
    assert _flops(vit, 5) == pytest.approx((forward, backward), rel=1e-9)
    ckpt_forward, ckpt_backward = _flops(vit, 2, grad_ckpt=True)
    assert ckpt_forward == pytest.approx(forward, rel=1e-9)
    # the 12 layers run forward again in backward (the patch embedding and the head do not),
    # up to the last op whose output backward needs: torch's non-reentrant checkpoint stops
    # its recompute there, before the MLP's second matmul (its output is only added)
    patch_embedding = 2 * 196 * 768 * 768
    head = 2 * 768 * 1000
    second_mlp_matmuls = 12 * 2 * 197 * 3072 * 768
    recomputed = ckpt_backward - backward
    expected = forward - patch_embedding - head - second_mlp_matmuls
    assert recomputed == pytest.approx(expected, rel=0.002)


def test_flops_are_a_line_in_the_depth_and_survive_the_cache():
    phases = (PhaseResult("forward", dict.fromkeys(CATEGORIES, 1), "m"),)
    low = TraceResult(phases, 0.0, flops=(10.0, 20.0, 1.0, 2.0))
    high = TraceResult(phases, 0.0, flops=(13.0, 26.0, 2.0, 4.0))
    assert extrapolate(low, high, 2, 3, 12).flops == (40.0, 80.0, 11.0, 22.0)
    assert result_from_json(result_to_json(high)).flops == (13.0, 26.0, 2.0, 4.0)
    old = result_to_json(high)
    del old["flops"]  # a record of an older batchfit: no count, no error
    assert result_from_json(old).flops == (0.0, 0.0, 0.0, 0.0)
    with pytest.raises(ValueError):
        result_from_json({**old, "flops": [1.0, 2.0]})


def test_an_image_model_is_timed_from_its_counted_flops(vit):
    t4 = get_gpu("t4")
    amp = replace(TrainingSetup(), precision="amp-fp16")
    assert step_time(vit, amp, t4, micro_batch_size=32, seq_len=224) is None  # nothing counted
    counted = (VIT_B_FORWARD, 2 * VIT_B_FORWARD, 1e9, 2e9)
    at_32 = step_time(vit, amp, t4, micro_batch_size=32, seq_len=224, flops_per_sample=counted)
    at_64 = step_time(vit, amp, t4, micro_batch_size=64, seq_len=224, flops_per_sample=counted)
    assert at_32 is not None and at_64 is not None
    assert at_32.tokens_per_micro_step == 32  # an image model's step counts images
    assert at_32.step_seconds() < at_64.step_seconds() < 2 * at_32.step_seconds() + 1e-9
    # compute at the T4's 65 TFLOP/s fp16 peak or slower
    assert at_32.micro_seconds > 32 * 3 * VIT_B_FORWARD / 65e12
    # the other operators' 3 GB a sample more cost their bytes over the card's bandwidth
    more = (VIT_B_FORWARD, 2 * VIT_B_FORWARD, 2e9, 4e9)
    heavier = step_time(vit, amp, t4, micro_batch_size=32, seq_len=224, flops_per_sample=more)
    assert heavier is not None
    extra = heavier.micro_seconds - at_32.micro_seconds
    assert extra == pytest.approx(32 * 3e9 / (t4.bandwidth_gb_s * 1e9 * 0.8), rel=1e-6)


def test_a_depthwise_convolution_s_backward_costs_twice_its_forward():
    """torch's formula counts a grouped convolution's weight gradient as if every input channel
    met every output channel (ConvNeXt's backward came out 7.7x its forward); each gradient
    costs the forward's FLOPs."""
    import torch

    from batchfit.memory.trace.tracker import _conv_backward_flops

    x = torch.empty(2, 8, 16, 16, device="meta")
    weight = torch.empty(8, 1, 7, 7, device="meta")  # depthwise: 8 groups of one channel
    grad_out = torch.empty(2, 8, 16, 16, device="meta")
    forward = 2 * 2 * 8 * 1 * 7 * 7 * 16 * 16
    common = (None, [1, 1], [3, 3], [1, 1], False, [0, 0], 8)
    assert _conv_backward_flops(grad_out, x, weight, *common, [True, True, False]) == 2 * forward
    # the first layer's input needs no gradient
    assert _conv_backward_flops(grad_out, x, weight, *common, [False, True, False]) == forward


def test_a_causal_attention_counts_half_the_blocks():
    """Flash and memory-efficient kernels skip the masked half of a causal attention."""
    import torch

    said: list[float] = []
    kernels.FLOP_SINKS.append(said.append)
    try:
        q = torch.zeros(1, 2, 8, 4, requires_grad=True)
        kernels.FlashAttentionMemory.apply(q, q, q, None, False).sum().backward()
        kernels.FlashAttentionMemory.apply(q, q, q, None, True).sum().backward()
    finally:
        kernels.FLOP_SINKS.remove(said.append)
    full = 2 * 2 * 8 * 8 * 4  # a matmul's multiply-adds over the 2 heads, 2 FLOPs each
    assert said == [2 * full, 5 * full, full, 2.5 * full]


def test_an_own_module_s_step_is_counted_and_timed_on_a_gpu():
    """Two linears over 64 samples: forward 2 x (1024 x 4096 + 4096 x 10) FLOPs a sample; backward
    the weights' gradients of both and the second's input gradient (the input needs none)."""
    import torch

    def make() -> torch.nn.Module:
        return torch.nn.Sequential(
            torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 10)
        )

    est = estimate(
        make,
        TrainingSetup(precision="amp-bf16"),
        batch_fn=lambda: torch.randn(64, 1024),
        loss_fn=lambda out, _batch: out.float().logsumexp(-1).mean(),
        gpu=get_gpu("a100-80gb"),
    )
    forward, backward, moved_forward, moved_backward = est.extras["flops_per_sample"]
    assert forward == 2 * (1024 * 4096 + 4096 * 10)
    assert backward == 2 * (1024 * 4096 + 2 * 4096 * 10)
    assert moved_forward > 0 and moved_backward > 0  # GELU, the casts, the loss
    speed = est.speed_json()
    assert speed["step_seconds"] and speed["tokens_per_s_per_gpu"]  # samples a second
    assert speed["step_seconds"] > 64 * (forward + backward) / 312e12  # past the bf16 peak
