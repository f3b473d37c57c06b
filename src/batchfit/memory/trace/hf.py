"""Trace a Hugging Face model built from its config: setup applied, fake inputs, extrapolation."""

from __future__ import annotations

import collections
import contextlib
import copy
import functools
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal, cast

import torch
from torch._subclasses import fake_tensor

from batchfit.memory.device.allocator import simulate
from batchfit.memory.device.kernels import cuda_autocast_policy, emulation
from batchfit.memory.device.totals import CUBLAS_HANDLES
from batchfit.memory.formulas.activations import EAGER_ONLY_TYPES
from batchfit.memory.trace import dry_run as trace
from batchfit.memory.trace._lm_loss import Fp32Outputs, HeadLoss
from batchfit.memory.trace._nf4 import mark_lora_wrapped, quantize_linears, upcast_unquantised
from batchfit.memory.trace.dry_run import layer_stacks
from batchfit.memory.trace.fsdp import fake_world, is_fsdp, shard
from batchfit.memory.trace.stacks import cuttable_vision
from batchfit.memory.trace.tracker import cpu_bf16_gemm_scratch
from batchfit.models import LAYER_KEYS, ModelInfo, auto_class, build_torchvision, make_config
from batchfit.optimizers import make_optimizer
from batchfit.spec import TrainingSetup

# What a dry run cannot do, as opposed to a bug: FakeTensor's operators without a fake kernel
# and its data-dependent outputs (``.item()``, ``nonzero``), operators without a meta kernel
# (NotImplementedError from the dispatcher), and transformers' refusals of a config, an attention
# implementation or checkpointing (ValueError, modeling_utils.py). Anything else is raised.
TRACE_LIMITS: tuple[type[Exception], ...] = (
    fake_tensor.UnsupportedOperatorException,
    fake_tensor.UnsupportedFakeTensorException,
    fake_tensor.DynamicOutputShapeException,
    fake_tensor.DataDependentOutputException,
    NotImplementedError,
    ValueError,
)


_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def is_trace_limit(exc: BaseException) -> bool:
    """Whether ``exc`` says the dry run cannot model this step (not a bug to raise)."""
    if isinstance(exc, TRACE_LIMITS):
        return True
    # A model whose __init__ reads a value (``.item()``) while it is built on the meta device:
    # aten raises a plain RuntimeError, "Tensor.item() cannot be called on meta tensors".
    return isinstance(exc, RuntimeError) and "on meta tensors" in str(exc)


def _config(model: ModelInfo, depth: int | None, image_size: int | None = None) -> Any:
    cfg = make_config(model.config, model.task)
    if model.arch.family == "vision" and image_size is not None:
        # fine-tuning at another resolution: ViT-style models size their position table
        # from image_size (interpolated from the checkpoint's); CLIP keeps it per tower
        for part in (cfg, getattr(cfg, "vision_config", None)):
            if part is not None and hasattr(part, "image_size"):
                part.image_size = image_size
    if depth is not None and (model.arch.family != "vision" or cuttable_vision(model)):
        if model.arch.family == "encoder-decoder":
            # Both stacks, under the config's own names: T5 num_layers / num_decoder_layers,
            # BART encoder_layers / decoder_layers.
            for key in LAYER_KEYS & model.config.keys():
                setattr(cfg, key, depth)
        else:
            cfg.num_hidden_layers = depth
        layer_types = getattr(cfg, "layer_types", None)
        if isinstance(layer_types, list):
            cfg.layer_types = layer_types[:depth]
    return cfg


def _attn_impl(model: ModelInfo, attention: str) -> str:
    """The implementation the traced model is built with for a resolved ``attention``.

    The probe hands over ``TrainingSetup.resolved``'s attention, where ``auto`` is already
    ``sdpa``: a model class without SDPA is built eager, as transformers would choose.
    """
    if attention in ("sdpa", "flash") and model.supports_sdpa:
        # On fake CPU tensors SDPA takes the CPU flash kernel, which keeps what CUDA's flash
        # kernel keeps: the output and an fp32 log-sum-exp per head.
        if model.arch.model_type in EAGER_ONLY_TYPES:
            return "eager"
        return "sdpa"
    return "eager"


def materialize_fake(net: torch.nn.Module) -> torch.nn.Module:
    """Swap a meta-device model's tensors for fake CPU ones (call under a FakeTensorMode).

    Building on meta and converting after keeps peft and ``module.to()`` on plain meta
    tensors (fake parameters cannot be converted in place); tied weights stay tied.
    """
    new_of: dict[int, torch.Tensor] = {}

    def fake_like(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in new_of:
            new_of[id(t)] = torch.empty(t.shape, dtype=t.dtype)
        return new_of[id(t)]

    for module in net.modules():
        for name, param in list(module._parameters.items()):
            if param is not None:
                if id(param) not in new_of:
                    new_of[id(param)] = torch.nn.Parameter(
                        torch.empty(param.shape, dtype=param.dtype),
                        requires_grad=param.requires_grad,
                    )
                module._parameters[name] = new_of[id(param)]  # type: ignore[assignment]
        for name, buf in list(module._buffers.items()):
            if buf is not None:
                module._buffers[name] = fake_like(buf)
        for name, value in list(vars(module).items()):
            if isinstance(value, torch.Tensor) and value.device.type == "meta":
                setattr(module, name, fake_like(value))
    return net


def _build(
    model: ModelInfo,
    setup: TrainingSetup,
    depth: int | None,
    cuda_policy: bool = False,
    image_size: int | None = None,
) -> torch.nn.Module:
    torchvision = model.arch.model_type == "torchvision"
    cfg = None if torchvision else _config(model, depth, image_size)
    if cfg is not None:
        cfg._attn_implementation = _attn_impl(model, setup.attention)
    auto = auto_class(model.task)
    # Build in the storage dtype (fake parameters cannot be converted by module.to()):
    # pure 16-bit stores 16-bit weights; LoRA stores its frozen base in 16-bit unless fp32.
    dtype = torch.float32
    if setup.precision in ("bf16", "amp-bf16") and (setup.precision == "bf16" or setup.is_lora):
        dtype = torch.bfloat16
    elif setup.precision in ("fp16", "amp-fp16") and (setup.precision == "fp16" or setup.is_lora):
        dtype = torch.float16
    if setup.is_lora and setup.frozen_dtype != "auto":
        dtype = _DTYPES[setup.frozen_dtype]
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        if torchvision:
            net = build_torchvision(model.config)
        else:
            try:
                net = auto.from_config(cfg, dtype=dtype)
            except TypeError:  # transformers < 4.56 names it torch_dtype
                net = auto.from_config(cfg, torch_dtype=dtype)
    finally:
        torch.set_default_dtype(previous)
    if setup.method == "qlora":
        _quantize(net, setup)
    if setup.grad_ckpt:
        ckpt_kwargs: dict[str, Any] = {"use_reentrant": False}
        if cuda_policy:
            # Torch-function modes are not active while backward recomputes a checkpointed
            # layer: re-enter CUDA's autocast policy there, or the recompute disagrees.

            ckpt_kwargs["context_fn"] = lambda: (contextlib.nullcontext(), cuda_autocast_policy())
        enable = getattr(net, "activation_checkpointing_enable", None)  # transformers >= 5
        if enable is not None:
            enable(activation_checkpointing_kwargs=ckpt_kwargs)
        else:  # the older name, deprecated since
            net.gradient_checkpointing_enable(gradient_checkpointing_kwargs=ckpt_kwargs)
        if setup.grad_ckpt_every:
            checkpoint_every(net, setup.grad_ckpt_every)
    if setup.is_lora:
        # lazy: peft (~1 s) only for LoRA setups
        from peft import LoraConfig, get_peft_model

        targets = list(model.lora_target_names(setup.lora_targets))
        net = get_peft_model(
            net,
            LoraConfig(
                r=setup.lora_rank,
                lora_alpha=setup.lora_alpha,  # type: ignore[arg-type]
                lora_dropout=setup.lora_dropout,
                target_modules=targets,
            ),
        )
        if setup.lora_dtype != "fp32":  # peft upcast them (autocast_adapter_dtype); litgpt does not
            for name, param in net.named_parameters():
                if param.requires_grad and "lora_" in name:
                    param.data = param.data.to(_DTYPES[setup.lora_dtype])
        if setup.method == "qlora":
            mark_lora_wrapped(net)
        if setup.grad_ckpt:
            # peft registered transformers' own hook already (it breaks on tuple outputs)
            base: Any = net.get_base_model()
            if getattr(base, "_require_grads_hook", None) is not None:
                base.disable_input_require_grads()
            _inputs_require_grads(base)
    net.train()
    return cast(torch.nn.Module, net)


def _quantize(net: torch.nn.Module, setup: TrainingSetup) -> None:
    """QLoRA's base as the framework loads it: 4-bit linears, then the recipe's fp32 cast."""
    compute = torch.float16 if setup.precision in ("fp16", "amp-fp16") else torch.bfloat16
    # (the fused loss reads the head's weight itself: it keeps the head 16-bit)
    with_head = setup.conventions.quantizes_head and setup.loss != "fused"
    # FSDP flattens floating-point parameters only: the FSDP-QLoRA recipes store the codes
    # in the 16-bit dtype (bnb_4bit_quant_storage; transformers' update_fsdp_plugin_peft)
    storage = compute if is_fsdp(setup) else torch.uint8
    quantize_linears(net, compute, with_head=with_head, storage=storage)
    if setup.kbit_upcast:
        upcast_unquantised(net)


def checkpoint_every(net: torch.nn.Module, every: int) -> None:
    """Keep checkpointing on layers ``every - 1``, ``2 * every - 1``, ... of each layer stack
    only (torchtitan's count; transformers' own ``every_n_layers`` starts at layer 0), by the
    per-layer flag transformers' checkpointed layers read."""
    for stack in layer_stacks(net):
        for i, layer in enumerate(stack):
            if hasattr(layer, "gradient_checkpointing"):
                setattr(layer, "gradient_checkpointing", i % every == every - 1)  # noqa: B010


def _inputs_require_grads(net: torch.nn.Module) -> None:
    """peft's ``enable_input_require_grads`` for any input layer: checkpointed layers of a
    frozen base need an input that requires grad. transformers' own hook calls
    ``requires_grad_`` on the embeddings' output, which Swin's patch embeddings return as a
    tuple (embeddings, dimensions): take its first tensor."""

    def hook(_module: torch.nn.Module, _inputs: Any, output: Any) -> None:
        first = output[0] if isinstance(output, (tuple, list)) else output
        if isinstance(first, torch.Tensor) and first.is_floating_point():
            first.requires_grad_(True)

    embeddings = net.get_input_embeddings()  # type: ignore[operator]
    embeddings.register_forward_hook(hook)


def batch_fn(
    model: ModelInfo, micro: int, seq: int, pixel_dtype: torch.dtype = torch.float32
) -> Callable[[], dict[str, Any]]:
    """A factory of random batches of ``micro`` sequences of ``seq`` tokens, with labels; for
    an image model, ``micro`` images of ``seq`` x ``seq`` pixels (in ``pixel_dtype``)."""
    vocab = model.arch.vocab_size
    if model.task == "image-classification":
        shape = (micro, model.arch.num_channels, seq, seq)
        cfg = model.config
        labels = int(cfg.get("num_labels") or len(cfg.get("id2label") or ()) or 2)
        return lambda: {
            "pixel_values": torch.randn(shape, dtype=pixel_dtype),
            "labels": torch.randint(0, labels, (micro,)),
        }

    def make() -> dict[str, Any]:
        ids = torch.randint(0, vocab, (micro, seq))
        if model.task == "classification":
            return {"input_ids": ids, "labels": torch.randint(0, 2, (micro,))}
        return {"input_ids": ids, "labels": torch.randint(0, vocab, (micro, seq))}

    return make


@dataclass
class StepParts:
    """Everything one training step needs; built under fake mode for a trace, real otherwise."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    make_batch: Callable[[], dict[str, Any]]
    autocast_dtype: torch.dtype | None

    @staticmethod
    def loss_of(out: Any, _batch: dict[str, Any]) -> torch.Tensor:
        loss: torch.Tensor = out.loss
        return loss


def step_parts(
    model: ModelInfo,
    setup: TrainingSetup,
    *,
    micro: int,
    seq: int,
    emulate_cuda: bool,
    depth: int | None = None,
    built: torch.nn.Module | None = None,
    prepare: Callable[[torch.nn.Module], torch.nn.Module] | None = None,
) -> StepParts:
    """Model (setup applied), optimizer, batch factory and autocast dtype for one step.

    ``prepare`` wraps the finished model (the loss wrapper included) before the optimizer
    takes its parameters: FSDP2's ``fully_shard`` (:mod:`batchfit.memory.trace.fsdp`).
    """
    vision = model.arch.family == "vision"
    net = (
        built
        if built is not None
        else _build(model, setup, depth, image_size=seq if vision else None)
    )
    if setup.loss != "full" and model.task != "classification":
        net = HeadLoss(
            net,
            loss=setup.loss,
            chunks=setup.loss_chunks,
            chunk_tokens=setup.loss_chunk_tokens,
            shift=model.task == "causal-lm",
            keep_logits=setup.loop == "keep-outputs",
            fp32_logits=setup.outputs_fp32,
        )
    elif setup.outputs_fp32:
        net = Fp32Outputs(net)
    if prepare is not None:
        net = prepare(net)
    params = [p for p in net.parameters() if p.requires_grad]
    opt = make_optimizer(setup.optimizer, params, setup.optimizer_impl, emulate_cuda)
    autocast = {"amp-bf16": torch.bfloat16, "amp-fp16": torch.float16}.get(setup.precision)
    # a pure 16-bit model takes 16-bit images (the user casts them, as the weights)
    pixels = _DTYPES.get(setup.precision, torch.float32)
    return StepParts(net, opt, batch_fn(model, micro, seq, pixels), autocast)


_BUILT: collections.OrderedDict[str, torch.nn.Module] = collections.OrderedDict()
_BUILT_KEEP = 8  # meta models are a few KB of Python objects each
# setup fields the step reads and the build does not: setups that differ only in them (the
# optimizer rungs, a lean loss) share one built model
_NOT_BUILT = frozenset(
    {
        "optimizer",
        "optimizer_impl",
        "offload",
        "loop",
        "loss_chunks",
        "loss_chunk_tokens",
        "expandable_segments",
    }
)


def _meta_build(
    model: ModelInfo,
    setup: TrainingSetup,
    depth: int | None,
    cuda_policy: bool,
    image_size: int | None = None,
) -> torch.nn.Module:
    """A fresh copy of the model built on the meta device.

    Building from the config (and wrapping with peft) costs tenths of a second; a plan traces
    the same model at several sizes, so a built model is kept and deep-copied (milliseconds).
    """
    built = {k: v for k, v in asdict(setup).items() if k not in _NOT_BUILT}
    if setup.method != "qlora":  # QLoRA's fused loss keeps the head 16-bit
        built.pop("loss")
    key = json.dumps(
        [model.name, model.config, model.task, built, depth, cuda_policy, image_size],
        sort_keys=True,
        default=str,
    )
    if key not in _BUILT:
        with torch.device("meta"):
            _BUILT[key] = _build(model, setup, depth, cuda_policy, image_size)
        while len(_BUILT) > _BUILT_KEEP:
            _BUILT.popitem(last=False)
    _BUILT.move_to_end(key)
    return copy.deepcopy(_BUILT[key])


@contextlib.contextmanager
def _moe_grouped_fallback(model: ModelInfo) -> Any:
    """MoE experts (transformers 5's default ``grouped_mm`` implementation) traced on fake
    tensors: every routed token-expert pair is one row of a grouped matmul, so the memory
    follows the routed total, never the routing. torch's meta kernel for ``grouped_mm``
    demands bf16 (a CUDA rule) where the CPU kernel takes any dtype: the dry run takes
    transformers' own fallback op, whose fake kernel allocates the same (S, out) output."""
    if not model.arch.num_experts:
        yield
        return
    try:
        # lazy: transformers' integrations, only for MoE models
        from transformers.integrations import moe
    except ImportError:  # transformers < 5: eager experts (data-dependent; the trace refuses)
        yield
        return
    original = moe._can_use_grouped_mm
    moe._can_use_grouped_mm = lambda *args, **kwargs: False
    try:
        yield
    finally:
        moe._can_use_grouped_mm = original


def trace_once(
    model: ModelInfo,
    setup: TrainingSetup,
    *,
    micro: int,
    seq: int,
    device: Literal["cpu", "cuda"],
    workspace: int,
    depth: int | None,
    grad_accum_steps: int,
    whole_first_step: bool = False,
    reserve: bool = True,
) -> trace.TraceResult:
    """One dry run at ``depth`` layers (None = the real depth); on CUDA the cuBLAS
    ``workspace`` bytes are allocated first, as the first matmul does. Under FSDP
    (:func:`batchfit.memory.trace.fsdp.is_fsdp`) it is rank 0 of ``setup.num_gpus``.

    On CUDA the allocator replays a whole first step then the measured one; the first is
    rebuilt from the measured step and the optimizer's priming step (the same allocations at
    half the cost), unless ``whole_first_step`` runs it, as the timeline picture, which draws
    every step it shows, needs. ``reserve=False`` leaves the replay to the caller (the result's
    ``reserved_bytes`` stays 0): a shallow dry run's is replayed unrolled to the full depth."""
    emulate_cuda = device == "cuda"
    with contextlib.ExitStack() as world:
        prepare = None
        if is_fsdp(setup):
            mesh = world.enter_context(fake_world(setup.num_gpus))
            prepare = functools.partial(shard, setup=setup, mesh=mesh)
        run = functools.partial(
            _run,
            model,
            setup,
            micro=micro,
            seq=seq,
            depth=depth,
            grad_accum_steps=grad_accum_steps,
            workspace=workspace if emulate_cuda else None,
            prepare=prepare,
        )
        try:
            result = run(whole_first_step=whole_first_step)
        except trace.FirstStepNotReplayable:  # gradients kept across steps: run it whole
            result = run(whole_first_step=True)
    if emulate_cuda and reserve:
        reserved = simulate(result.events, expandable_segments=setup.expandable_segments)
        result = replace(result, reserved_bytes=reserved.reserved_bytes)
    return result


def _run(
    model: ModelInfo,
    setup: TrainingSetup,
    *,
    micro: int,
    seq: int,
    depth: int | None,
    grad_accum_steps: int,
    workspace: int | None,
    prepare: Callable[[torch.nn.Module], torch.nn.Module] | None,
    whole_first_step: bool,
) -> trace.TraceResult:
    """Build, fake the tensors, run the steps under the tracker; ``workspace`` is None for a
    CPU step, the cuBLAS workspace bytes for an emulated CUDA one."""
    emulate_cuda = workspace is not None
    keep: list[torch.Tensor] = []

    def cuda_workspaces(tracker: Any) -> None:
        if workspace is not None:
            for _ in range(CUBLAS_HANDLES):
                keep.append(torch.empty(workspace // CUBLAS_HANDLES, dtype=torch.uint8))
                tracker.label(keep[-1], "other")

    with trace.quiet(), _moe_grouped_fallback(model):
        vision = model.arch.family == "vision"
        net = _meta_build(model, setup, depth, emulate_cuda, seq if vision else None)
        with trace.fake_mode(), emulation(emulate_cuda):
            parts = step_parts(
                model,
                setup,
                micro=micro,
                seq=seq,
                emulate_cuda=emulate_cuda,
                built=materialize_fake(net),
                prepare=prepare,
            )
            return trace.run_steps(
                parts.model,
                parts.optimizer,
                parts.make_batch,
                parts.loss_of,
                autocast_dtype=parts.autocast_dtype,
                grad_accum_steps=grad_accum_steps,
                extra_other=cuda_workspaces,
                loop=setup.loop,
                gemm_scratch=not emulate_cuda and cpu_bf16_gemm_scratch(),
                gloo_scratch=not emulate_cuda and is_fsdp(setup),
                # CUDA: the allocator's reserve follows a whole first step, run or rebuilt
                prime=not (emulate_cuda and whole_first_step),
                replay_first_step=emulate_cuda and not whole_first_step,
                samples=micro,
            )
