"""What several GPUs send each other in a training step, and when (ZeRO paper, Rajbhandari et
al. 2020, section 7: data parallelism and ZeRO-1/2 move 2 x Psi elements per step, ZeRO-3 3 x).

Volumes are the size of the whole tensor a collective works on (a ring all-gather or
reduce-scatter then moves ``(N - 1) / N`` of it through each GPU's link, an all-reduce twice
that), split by when the bytes move, because that decides what compute can hide them:

- ``micro``: every micro-step, beside compute (FSDP/ZeRO-3 gather the parameters in forward
  and again in backward, with prefetch; ZeRO-2/3 reduce-scatter each micro-step's gradients:
  DeepSpeed's stage 2 and 3 partition gradients as backward produces them);
- ``last_backward``: once per step, beside the last micro-step's backward (DDP's bucketed
  all-reduce, ZeRO-1's reduction at the accumulation boundary, FSDP2's reduce-scatter when the
  earlier micro-steps ran without gradient sync);
- ``after_step``: once per step with nothing to hide behind (ZeRO-1/2 all-gather the updated
  16-bit parameters after the optimizer step).
"""

from __future__ import annotations

from dataclasses import dataclass

from batchfit.spec import TrainingSetup, is_deepspeed


@dataclass(frozen=True)
class Traffic:
    """Bytes of the tensors collectives work on, by when they move (see the module docstring);
    ``reduce`` and ``gather`` are the two halves of an all-reduce."""

    micro_gather: float = 0.0
    micro_reduce: float = 0.0
    last_backward_gather: float = 0.0
    last_backward_reduce: float = 0.0
    after_step_gather: float = 0.0

    def per_step(self, grad_accum_steps: int = 1) -> float:
        """Bytes per optimizer step (all collectives, tensor sizes)."""
        micro = (self.micro_gather + self.micro_reduce) * grad_accum_steps
        last = self.last_backward_gather + self.last_backward_reduce
        return micro + last + self.after_step_gather


def traffic(setup: TrainingSetup, total_params: int, trainable_params: int) -> Traffic:
    """Collective traffic of one rank for ``setup`` (resolved); nothing on one GPU.

    Example:
        >>> t = traffic(TrainingSetup(precision="amp-bf16", num_gpus=8, sharding="ddp"), 10, 10)
        >>> t.last_backward_reduce, t.last_backward_gather  # fp32 gradients, all-reduced
        (40.0, 40.0)
        >>> t = traffic(TrainingSetup(precision="bf16", num_gpus=8, sharding="fsdp"), 10, 10)
        >>> t.micro_gather, t.last_backward_reduce  # gathers twice per micro-step, bf16
        (40.0, 20.0)
    """
    if setup.num_gpus <= 1 or setup.sharding == "none":
        return Traffic()
    sixteen = setup.precision in ("bf16", "fp16", "amp-bf16", "amp-fp16")
    if is_deepspeed(setup):
        # DeepSpeed communicates its module's parameters and gradients: 16-bit under
        # bf16/fp16, fp32 under fp32 (memory/formulas/deepspeed.py)
        b = 2.0 if sixteen else 4.0
        grads, params = trainable_params * b, trainable_params * b
        if setup.sharding == "zero1":
            return Traffic(last_backward_reduce=grads, after_step_gather=params)
        if setup.sharding == "zero2":
            return Traffic(micro_reduce=grads, after_step_gather=params)
        # ZeRO-3 gathers every parameter (frozen ones too) in forward and in backward
        return Traffic(micro_gather=2.0 * total_params * b, micro_reduce=grads)
    if setup.sharding == "fsdp":
        # FSDP2 with MixedPrecisionPolicy(param_dtype=16-bit, reduce_dtype=fp32) under AMP
        # (memory/trace/fsdp.py): 16-bit gathers, fp32 reduce-scatters; pure 16-bit reduces in
        # 16-bit
        gather_b = 2.0 if sixteen else 4.0
        reduce_b = 2.0 if setup.precision in ("bf16", "fp16") else 4.0
        return Traffic(
            micro_gather=2.0 * total_params * gather_b,
            last_backward_reduce=trainable_params * reduce_b,
        )
    # DDP all-reduces the gradients in their dtype: fp32 under AMP (fp32 parameters)
    grads = trainable_params * (2.0 if setup.precision in ("bf16", "fp16") else 4.0)
    return Traffic(last_backward_reduce=grads, last_backward_gather=grads)


def comm_bytes_per_step(setup: TrainingSetup, total_params: int, trainable_params: int) -> int:
    """Bytes of collectives per optimizer step at one micro-step (the planner's tie-break).

    Example:
        >>> s = TrainingSetup(precision="amp-bf16", num_gpus=8, sharding="zero2")
        >>> comm_bytes_per_step(s, 1000, 1000)  # 2 x Psi in bf16
        4000
    """
    return int(traffic(setup, total_params, trainable_params).per_step())
