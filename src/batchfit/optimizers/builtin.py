"""The optimizers batchfit ships: torch.optim's SGD, Adam and AdamW, bitsandbytes' 8-bit AdamW
(plain and paged), transformers' Adafactor, Lion, Adan and SophiaG. Each is one
``register(OptimizerSpec(...))`` below; ``docs/design.md`` says what each field means to the
engines."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from batchfit.optimizers.base import (
    BNB_BLOCK,
    BNB_MIN_8BIT_SIZE,
    TORCH_IMPLS,
    Accesses,
    ExportNames,
    Factory,
    Impl,
    LrRule,
    OptimizerSpec,
    ParamTensor,
    StepContext,
    register,
)

if TYPE_CHECKING:  # torch only for the dry run's factories
    import torch

GOYAL = LrRule("linear", "Goyal et al. 2017")  # linear scaling rule: eta -> kappa * eta
# Malladi et al. 2022, square-root scaling rule (SDE): eta -> sqrt(kappa) * eta, and β1, β2, ε
MALLADI = LrRule("sqrt", "Malladi et al. 2022", adam_betas=True)
UNSOURCED = LrRule("sqrt", None, unsourced_why="it keeps other state than Adam")

# torch.optim's foreach and per-parameter loop run one kernel per operation, each streaming its
# tensors: AdamW in torch/optim/adam.py _multi_tensor_adam (torch 2.13, decoupled weight decay
# on, capturable off): _foreach_mul_(params) 2, _foreach_lerp_(exp_avgs, grads) 3,
# _foreach_mul_(exp_avg_sqs) 2, _foreach_addcmul_(exp_avg_sqs, grads, grads) 3,
# _foreach_sqrt 2, _foreach_div_ 2, _foreach_add_(eps) 2, _foreach_addcdiv_(params) 4 = 20;
# Adam without weight decay 18; SGD _foreach_add_ 3, with momentum _foreach_mul_ 2 + add_ 3 +
# add_ 3 = 8. _single_tensor_adam runs the same operations tensor by tensor (the CPU's count).
# A fused kernel reads each tensor once and writes the updated ones back: AdamW reads weights,
# gradients and two moments and writes three of them = 7.
# Optimizers outside torch.optim have no counted CPU loop: AdamW's 20 stands in (STAND_IN_CPU).
STAND_IN_CPU = 20
# Adan in sail-sg/Adan adan.py (max_grad_norm=0, no_prox=False), _multi_tensor_adan op by op
# (_single_tensor_adan runs the same ones tensor by tensor): _foreach_mul_(grads, clip) 2,
# _foreach_add_(neg_pre_grads, grads) 3, _foreach_mul_(exp_avgs) 2, _foreach_add_(exp_avgs,
# grads) 3, _foreach_mul_(exp_avg_diffs) 2, _foreach_add_(exp_avg_diffs, neg_pre_grads) 3,
# _foreach_mul_(neg_pre_grads) 2, _foreach_add_(neg_pre_grads, grads) 3,
# _foreach_mul_(exp_avg_sqs) 2, _foreach_addcmul_(exp_avg_sqs, neg_pre_grads, neg_pre_grads) 3,
# _foreach_sqrt 2, _foreach_div_ 2, _foreach_add_(eps) 2, _foreach_addcdiv_(params, exp_avgs) 4,
# _foreach_addcdiv_(params, exp_avg_diffs) 4, _foreach_div_(params) 2,
# _foreach_zero_(neg_pre_grads) 1, _foreach_add_(neg_pre_grads, grads) 3 = 45. batchfit
# registers no fused Adan (sail-sg's fused=True needs its compiled CUDA extension), and
# DeepSpeed, which has no Adan type, steps the client's optimizer: a fused ask runs these 45 too.
ADAN_ACCESSES = 45
# SophiaG in Liu et al.'s sophia.py, _single_tensor_sophiag op by op (capturable off; its only
# loop, on every device): param.mul_(1 - lr * wd) 2, exp_avg.mul_(beta1) 2,
# exp_avg.add_(grad) 3, exp_avg.abs() 2, rho * bs * hess 2, + 1e-15 2, abs / denominator 3,
# .clamp(None, 1) 2, exp_avg.sign() 2, param.addcmul_(sign, ratio) 4 = 24. The Hessian refresh
# the training loop runs every k steps (update_hessian: hessian.mul_ 2 + addcmul_ 3, after a
# backward on sampled labels) is outside step() and not counted. DeepSpeed has no Sophia type
# and steps the client's optimizer: a fused ask runs these 24 too.
SOPHIA_ACCESSES = 24


def _torch_optim(cls_name: str, lr: float, **extra: Any) -> Factory:
    """A factory for ``torch.optim.<cls_name>`` with the implementation asked for."""

    def build(params: list[torch.nn.Parameter], impl: Impl) -> torch.optim.Optimizer:
        import torch  # lazy: torch (~1 s) only when the dry run builds the optimizer

        kwargs = {"fused": True} if impl == "fused" else {"foreach": impl == "foreach"}
        cls = getattr(torch.optim, cls_name)
        return cls(params, lr=lr, **extra, **kwargs)  # type: ignore[no-any-return]

    return build


def _emulated(cls_name: str, lr: float) -> Factory:
    """A factory for an optimizer written in ``optimizers/_torch.py``."""

    def build(params: list[torch.nn.Parameter], impl: Impl) -> torch.optim.Optimizer:
        from batchfit.optimizers import _torch  # lazy: torch (~1 s), the dry run only

        return getattr(_torch, cls_name)(params, lr=lr)  # type: ignore[no-any-return]

    return build


def _adafactor(params: list[torch.nn.Parameter], impl: Impl) -> torch.optim.Optimizer:
    # lazy: transformers (~1 s), only for Adafactor
    from transformers.optimization import Adafactor

    return Adafactor(  # type: ignore[no-untyped-call, unused-ignore, no-any-return]
        params, lr=1e-3, relative_step=False, scale_parameter=False, warmup_init=False
    )


def _adan(params: list[torch.nn.Parameter], impl: Impl) -> torch.optim.Optimizer:
    from batchfit.optimizers import _torch  # lazy: torch (~1 s), the dry run only

    return _torch.Adan(params, lr=1e-3, foreach=impl == "foreach")


def _sophia(params: list[torch.nn.Parameter], impl: Impl) -> torch.optim.Optimizer:
    from batchfit.optimizers import _torch  # lazy: torch (~1 s), the dry run only

    return _torch.SophiaG(params, lr=1e-4)  # one loop, whatever impl asks


def _no_state(t: ParamTensor, elem: int) -> float:
    return 0


def _one_buffer(t: ParamTensor, elem: int) -> float:
    return t.numel * elem  # one momentum buffer


def _two_moments(t: ParamTensor, elem: int) -> float:
    return 2 * t.numel * elem  # exp_avg, exp_avg_sq


def _adan_state(t: ParamTensor, elem: int) -> float:
    # sail-sg/Adan adan.py step(): exp_avg, exp_avg_sq, exp_avg_diff = zeros_like(p) and
    # neg_pre_grad = p.grad.clone() (the gradient's dtype, the state's under AMP and pure 16-bit)
    return 4 * t.numel * elem


def _sophia_state(t: ParamTensor, elem: int) -> float:
    # sophia.py SophiaG.step(): exp_avg, hessian = zeros_like(p) (the step counter is a CPU scalar)
    return 2 * t.numel * elem


def _bnb_8bit(t: ParamTensor, elem: int) -> float:
    if t.numel < BNB_MIN_8BIT_SIZE:
        return 2 * t.numel * 4
    return 2 * (t.numel + 4 * math.ceil(t.numel / BNB_BLOCK))


def _factored(t: ParamTensor, elem: int) -> float:
    # HF Adafactor (beta1=None): fp32 row and column second moments for >= 2-D tensors.
    if len(t.shape) >= 2:
        rows = math.prod(t.shape[:-1])
        cols = math.prod(t.shape[:-2]) * t.shape[-1]
        return 4 * (rows + cols)
    return 4 * t.numel


def _in_place(ctx: StepContext) -> tuple[float, str]:
    return 0, "in place"


def _adam_temps(ctx: StepContext) -> tuple[float, str]:
    if ctx.impl == "foreach":
        return ctx.total * ctx.state_elem, (
            "foreach AdamW: _foreach_sqrt(exp_avg_sq) of every parameter"
        )
    if ctx.impl == "for-loop":
        # torch.optim.adam._single_tensor_adam: (exp_avg_sq.sqrt() / bias_correction2_sqrt)
        return 2 * ctx.largest * ctx.state_elem, (
            "per-parameter AdamW: sqrt(exp_avg_sq) and its division by the bias "
            "correction, one parameter at a time"
        )
    return 0, "fused AdamW: no temporaries"


def _adafactor_temps(ctx: StepContext) -> tuple[float, str]:
    # transformers' Adafactor.step: update = grad**2 + eps (two fp32 tensors at once); 16-bit
    # parameters are first copied to fp32 (grad.float(), p.float()) for the whole step
    if ctx.grad_bytes < 4:
        return 4 * 4 * ctx.largest, "Adafactor: fp32 copies of grad and weight, grad^2, + eps"
    return 2 * 4 * ctx.largest, "Adafactor: grad^2 and grad^2 + eps of one parameter"


def _lion_temps(ctx: StepContext) -> tuple[float, str]:
    return ctx.largest * ctx.state_elem, "Lion: one update tensor at a time"


def _adan_temps(ctx: StepContext) -> tuple[float, str]:
    if ctx.impl == "foreach":
        # adan.py _multi_tensor_adan: denom = torch._foreach_sqrt(exp_avg_sqs), every parameter's
        return ctx.total * ctx.state_elem, (
            "foreach Adan: _foreach_sqrt(exp_avg_sq) of every parameter"
        )
    # adan.py _single_tensor_adan: denom = (exp_avg_sq.sqrt() / bias_correction3_sqrt).add_(eps)
    return 2 * ctx.largest * ctx.state_elem, (
        "per-parameter Adan: sqrt(exp_avg_sq) and its division by the bias correction, one "
        "parameter at a time"
    )


def _sophia_temps(ctx: StepContext) -> tuple[float, str]:
    # sophia.py _single_tensor_sophiag: exp_avg.abs(), rho * bs * hess and its + 1e-15 are alive
    # together (then abs / denominator and clamp, sign(exp_avg) beside the ratio: two at most)
    return 3 * ctx.largest * ctx.state_elem, (
        "SophiaG: |exp_avg|, rho * bs * hessian and its + eps, one parameter at a time"
    )


register(
    OptimizerSpec(
        name="sgd",
        summary="torch.optim.SGD without momentum: no state",
        state=_no_state,
        state_text="no state",
        temporaries=_in_place,
        accesses=Accesses(kernel=3, unfused=3, cpu=3),
        build=_torch_optim("SGD", 1e-3),
        lr=GOYAL,
        export=ExportNames("sgd"),
        impls=TORCH_IMPLS,
    )
)
register(
    OptimizerSpec(
        name="sgd-momentum",
        summary="torch.optim.SGD(momentum=0.9): one momentum buffer",
        state=_one_buffer,
        state_text="1 momentum x {elem} B",
        temporaries=_in_place,
        accesses=Accesses(kernel=5, unfused=8, cpu=8),
        build=_torch_optim("SGD", 1e-3, momentum=0.9),
        lr=GOYAL,
        export=ExportNames("sgd", hf_optim_args="momentum=0.9"),
        impls=TORCH_IMPLS,
    )
)
register(
    OptimizerSpec(
        name="adam",
        summary="torch.optim.Adam: two moments",
        state=_two_moments,
        state_text="2 moments x {elem} B",
        temporaries=_adam_temps,
        accesses=Accesses(kernel=7, unfused=18, cpu=18),
        build=_torch_optim("Adam", 1e-4),
        lr=MALLADI,
        # Decoupled weight decay for AdamW, none for Adam (torch.optim defaults).
        export=ExportNames("adamw_torch", "adamw_torch_fused", deepspeed_type="Adam"),
        impls=TORCH_IMPLS,
        lighter="adamw-8bit",
        fused_first=True,
    )
)
register(
    OptimizerSpec(
        name="adamw",
        summary="torch.optim.AdamW: two moments, decoupled weight decay (the default)",
        state=_two_moments,
        state_text="2 moments x {elem} B",
        temporaries=_adam_temps,
        accesses=Accesses(kernel=7, unfused=20, cpu=20),
        build=_torch_optim("AdamW", 1e-4),
        lr=MALLADI,
        export=ExportNames(
            "adamw_torch", "adamw_torch_fused", weight_decay=0.01, deepspeed_type="AdamW"
        ),
        impls=TORCH_IMPLS,
        lighter="adamw-8bit",
        fused_first=True,
    )
)
register(
    OptimizerSpec(
        name="adamw-8bit",
        summary="bitsandbytes AdamW8bit: two 8-bit moments, blockwise absmax",
        state=_bnb_8bit,
        state_text="2 moments x 1 B + fp32 absmax per 256 (tensors < 4096 elems: 2 x 4 B)",
        temporaries=_in_place,
        accesses=Accesses(kernel=4, unfused=None, cpu=STAND_IN_CPU),
        build=_emulated("EmulatedAdamW8bit", 1e-4),
        lr=MALLADI,
        export=ExportNames("adamw_bnb_8bit"),
        needs_cuda_package="bitsandbytes",
    )
)
register(
    OptimizerSpec(
        name="paged-adamw-8bit",
        summary="bitsandbytes PagedAdamW8bit: 8-bit moments in paged memory",
        state=_bnb_8bit,
        state_text="2 x 1 B + absmax per 256, paged (can spill to CPU under pressure)",
        temporaries=_in_place,
        accesses=Accesses(kernel=4, unfused=None, cpu=STAND_IN_CPU),
        build=_emulated("EmulatedAdamW8bit", 1e-4),
        lr=MALLADI,
        export=ExportNames("paged_adamw_8bit"),
        needs_cuda_package="bitsandbytes",
    )
)
register(
    OptimizerSpec(
        name="adafactor",
        summary="transformers' Adafactor without momentum: factored second moment",
        state=_factored,
        state_text="factored fp32 row + column second moments",
        temporaries=_adafactor_temps,
        accesses=Accesses(kernel=4, unfused=None, cpu=STAND_IN_CPU),
        build=_adafactor,
        lr=UNSOURCED,
        export=ExportNames("adafactor"),
    )
)
register(
    OptimizerSpec(
        name="lion",
        summary="Lion (Chen et al. 2023): one momentum buffer, sign update",
        state=_one_buffer,
        state_text="1 momentum x {elem} B",
        temporaries=_lion_temps,
        accesses=Accesses(kernel=5, unfused=None, cpu=STAND_IN_CPU),
        build=_emulated("Lion", 1e-4),
        lr=UNSOURCED,
        export=ExportNames("lion_32bit"),
    )
)
register(
    OptimizerSpec(
        name="adan",
        summary="Adan (Xie et al. 2022): three moments and the previous gradient",
        state=_adan_state,
        state_text="3 moments + previous gradient x {elem} B",
        temporaries=_adan_temps,
        # ADAN_ACCESSES: the count from sail-sg/Adan adan.py, above
        accesses=Accesses(kernel=ADAN_ACCESSES, unfused=ADAN_ACCESSES, cpu=ADAN_ACCESSES),
        build=_adan,
        lr=LrRule("sqrt", None, unsourced_why="Adan's paper gives no batch-size rule"),
        export=ExportNames(None),
        # sail-sg's default is foreach=True on every device: the last, what auto runs on the CPU
        impls=("for-loop", "foreach"),
    )
)
register(
    OptimizerSpec(
        name="sophia",
        summary="SophiaG (Liu et al. 2023): momentum and a diagonal Hessian estimate, clipped",
        state=_sophia_state,
        state_text="1 momentum + 1 Hessian diagonal x {elem} B",
        temporaries=_sophia_temps,
        # SOPHIA_ACCESSES: the count from Liu et al.'s sophia.py, above
        accesses=Accesses(kernel=SOPHIA_ACCESSES, unfused=None, cpu=SOPHIA_ACCESSES),
        build=_sophia,
        lr=LrRule(
            "sqrt",
            None,
            unsourced_why="Sophia's paper gives none; pass the new tokens per step as step(bs=...)",
        ),
        export=ExportNames(None),
    )
)
