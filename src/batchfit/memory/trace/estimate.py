"""The trace engine's estimate: dry runs (or their cached results), extrapolated over depth.

Torch-free until a dry run must actually run (``hf``): a result found in the cache is
turned into a ``MemoryEstimate`` without importing torch or transformers.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

from batchfit import _cache
from batchfit._units import BYTES_IN_MIB
from batchfit.errors import UsageError
from batchfit.memory.device.advice import advice
from batchfit.memory.device.allocator import simulate
from batchfit.memory.device.totals import (
    DeviceTotals,
    StepMemory,
    assemble,
    device_totals,
    gpu_extras,
)
from batchfit.memory.formulas import analytic
from batchfit.memory.trace import _worker, alike, sized
from batchfit.memory.trace.fsdp import is_fsdp
from batchfit.memory.trace.notes import setup_notes
from batchfit.memory.trace.result import (
    TraceResult,
    extrapolate,
    result_from_json,
    result_to_json,
)
from batchfit.memory.trace.stacks import cuttable_vision
from batchfit.memory.trace.unroll import unroll
from batchfit.memory.types import Line, MemoryEstimate
from batchfit.models import ModelInfo, make_config
from batchfit.spec import TrainingSetup
from batchfit.workload import Workload

CACHE_NAMESPACE = "trace"

# Called before each dry run with what it traces and how many dry runs that is (two where a
# pair runs side by side); the CLI shows it as progress on a terminal.
on_dry_run: Callable[[str, int], None] | None = None


def _announce(
    model: ModelInfo,
    setup: TrainingSetup,
    micro: int,
    seq: int,
    depth: int | None,
    beside: int | None = None,
) -> None:
    """Name the dry run at ``depth`` (and the one at ``beside``, traced alongside)."""
    if on_dry_run is not None:
        both = f"{beside} and {depth}" if beside else f"{depth}"
        layers = f"{both} of {model.arch.num_layers} layers" if depth else "all layers"
        size = f"{seq}x{seq} px images" if model.task == "image-classification" else f"{seq} tokens"
        # a plan's options read apart, last: a narrow terminal cuts them, not the sizes
        apart = f": {setup.traits}" if setup.traits else ""
        on_dry_run(f"{model.name}, {micro} x {size}, {layers}{apart}", 2 if beside else 1)


# Depths traced for a homogeneous stack, then extrapolated per layer; stacks whose layers
# alternate are traced at one and two periods of their pattern, so types pair up (Gemma 2:
# sliding-window / global, period 2; Gemma 3: five sliding-window layers then a global one).
DEPTHS = (1, 2)
# Model types whose config.json may omit ``layer_types``: transformers derives the pattern
# (Gemma 2/3 sliding_window_pattern; ModernBERT global_attn_every_n_layers, its local layers
# each keeping a sequence-squared attention bias on CUDA).
PATTERNED_TYPES = ("gemma2", "gemma3_text", "modernbert")


def layer_period(layer_types: list[Any]) -> int:
    """The shortest period the per-layer types repeat with (1: all alike)."""
    n = len(layer_types)
    for period in range(1, n + 1):
        if all(layer_types[i] == layer_types[i % period] for i in range(n)):
            return period
    return n


def trace_depths(model: ModelInfo, setup: TrainingSetup | None = None) -> tuple[int, int]:
    """The two depths to trace ``model`` at before extrapolating.

    FSDP gathers one layer ahead of the one running (prefetch) and reshards behind it: a
    1-layer stack has nothing to prefetch, and in a 2-layer stack the bottom layer's backward
    overlaps the root's reshard (its gathered parameters count at one moment and not at the
    other: Llama-3.1-8B at micro-batch 1 traced at 2 and 3 layers put 14.6 GiB of "other" at
    32), and it has no middle layer, whose backward is a moment of its own; from three layers
    on, each moment's gathered and reduce-scatter bytes are the same at every depth (checked
    at 3 and 4 layers). FSDP is traced at three and four periods.
    """
    layer_types = model.config.get("layer_types")
    if not isinstance(layer_types, list) and model.arch.model_type in PATTERNED_TYPES:
        # transformers derives the pattern from the config
        layer_types = getattr(make_config(model.config, model.task), "layer_types", None)
    period = layer_period(layer_types) if isinstance(layer_types, list) and layer_types else 1
    if setup is not None and setup.grad_ckpt_every:  # a checkpointed layer in each period
        period = math.lcm(period, setup.grad_ckpt_every)
    if setup is not None and is_fsdp(setup):
        return (3 * period, 4 * period)
    if model.arch.family == "vision":
        # a 1-layer ViT's last layer is also its first: under LoRA its forward's end holds
        # 9 MiB less per 32 images than a middle layer adds (vit-base, 222 / 361 / 491 / 621
        # MiB of activations at 1 / 2 / 3 / 4 layers), 5% over at 12 from the line
        # through 1 and 2; from 2 layers on each layer adds the same
        return (2 * period, 3 * period)
    return DEPTHS if period == 1 else (period, 2 * period)


def unsupported(model: ModelInfo, setup: TrainingSetup) -> str | None:
    """Why the trace cannot model this setup yet (then the analytic engine answers)."""
    if setup.precision == "fp16":
        return (
            "--precision fp16 is DeepSpeed's fp16 (fp16 weights, an fp32 master copy in its "
            "optimizer wrapper); --precision amp-fp16 (autocast, a GradScaler) is traced"
        )
    traced = ("none", "ddp", "fsdp")  # FSDP2: one rank under a fake process group
    if setup.sharding not in traced or setup.offload != "none":
        named = [f"--sharding {setup.sharding}"] if setup.sharding not in traced else []
        named += [f"--offload {setup.offload}"] if setup.offload != "none" else []
        return " with ".join(named)
    return None


@dataclass(frozen=True)
class _Sizes:
    """What a dry run is traced at besides the model and the setup (``trace_once``'s keywords,
    and part of the cache key: its field names stay, so cached dry runs keep answering)."""

    micro: int
    seq: int
    device: Literal["cpu", "cuda"]
    workspace: int
    grad_accum_steps: int


def traced_result(
    model: ModelInfo, setup: TrainingSetup, workload: Workload, *, full_depth: bool
) -> tuple[TraceResult, list[str]]:
    """The step's moments at the model's depth, from the cache or from dry runs.

    What a dry run depends on is the key: the model's config and task, the resolved setup,
    the sizes, the device and, on CUDA, the cuBLAS workspace (the GPU's only other input).
    """
    device = workload.device
    workspace = gpu_extras(workload.gpu, setup).workspace if device == "cuda" else 0
    depth = model.arch.num_layers
    low, high = trace_depths(model, setup)
    # an image model is cut only where its history unrolls; elsewhere it is traced whole,
    # as its reserve would be
    unrolls = _unrolls(setup, (low, high))
    whole = _traced_whole(model) or (model.arch.family == "vision" and not unrolls)
    extrapolated = not (full_depth or depth <= high or whole)
    notes = [f"traced {low} and {high} layers, extrapolated to {depth}"] if extrapolated else []
    notes += setup_notes(model, setup, device)
    if not is_fsdp(setup):
        # one process without DDP (its buckets are added after): the dry run on 2 or 8 GPUs
        # is the one on 1, and one record serves every count
        setup = replace(setup, num_gpus=1, sharding="none")
    # what only the planner reads (may it change the loss, the method; compile's speed) changes
    # no dry run: a plan's setup and the one its `estimate` line names share their dry runs
    setup = replace(setup, keep_loss=False, keep_method=False, compile=False)
    sizes = _Sizes(
        micro=workload.micro_batch_size,
        seq=workload.seq_len,
        device=device,
        workspace=workspace,
        # memory is the same for any count from 2 up: later micro-steps hold the gradients
        # of earlier ones, so 2 traces every count (and one record serves them all)
        grad_accum_steps=min(workload.grad_accum_steps, 2),
    )
    key = {
        # the config and the task build the model, whatever names it (a config file's path, a
        # catalog name): the same config.json under another path reads the same dry runs. A
        # torchvision model is built from its name.
        "model": model.name if model.arch.model_type == "torchvision" else "",
        "config": model.config,
        "task": model.task,
        "setup": asdict(setup),
        **asdict(sizes),
        "full_depth": full_depth,
    }
    depths = (low, high) if extrapolated else None
    interpolating = sized.enabled.get()
    # an interpolated result is cached apart: ``estimate`` reads traced ones only
    keys = [key, *([{**key, "sized": "interpolated"}] if interpolating else [])]
    for k in keys:
        record = _cache.load(CACHE_NAMESPACE, k)
        if record is not None:
            try:
                return result_from_json(record), notes
            except (KeyError, TypeError, ValueError, AttributeError):
                pass  # a record of another shape: trace again and overwrite it
    setup_key, between = "", False  # the histories' key: read or kept only while interpolating
    micro, space = sizes.micro, sizes.workspace
    if interpolating:
        line = sized.line_of(model, setup, sizes.seq, micro)  # the sizes it shares a line with
        every_size = {**key, "micro": None, "workspace": None, "line": line}
        setup_key = _key(every_size)
        between = line is not None
    runs = interpolating and _read_runs(every_size, setup, micro, space, between)
    result = _combine(model, setup, sizes, depths, runs) if runs else None
    if result is not None:
        _cache.store(CACHE_NAMESPACE, keys[-1], result_to_json(result))
        return result, notes
    runs = _dry_runs(model, setup, sizes, depths)
    if interpolating:  # kept only where they may be read
        sized.remember(setup_key, micro, space, runs, family=_family(every_size))
    result = _combine(model, setup, sizes, depths, runs)
    if result is None:  # an image model whose history does not unroll: traced whole
        runs = _dry_runs(model, setup, sizes, None)
        result = _combine(model, setup, sizes, None, runs)
    assert result is not None  # a whole dry run needs no unroll
    _cache.store(CACHE_NAMESPACE, key, result_to_json(result))
    return result, notes


def _key(every_size: dict[str, Any]) -> str:
    return json.dumps(every_size, sort_keys=True, default=str)


def _family(every_size: dict[str, Any]) -> str:
    """The histories' key of the setup without its optimizer (``alike.from_sibling``)."""
    setup = {**every_size["setup"], "optimizer": None, "optimizer_impl": None}
    return _key({**every_size, "setup": setup})


def _read_runs(
    every_size: dict[str, Any], setup: TrainingSetup, micro: int, space: int, between: bool
) -> tuple[TraceResult, ...] | None:
    """The dry runs at ``micro`` read from histories of this process: of this setup at other
    sizes (``sized``), of its sibling with another optimizer, or of the step of two
    micro-steps (``alike``); None where none answers."""
    key = _key(every_size)
    runs = sized.runs_at(key, micro, space, between)
    if runs is None and not is_fsdp(setup):
        runs = alike.from_sibling(key, _family(every_size), micro, space, between)
    if runs is None and every_size["grad_accum_steps"] == 1:  # a step of two, cut
        two = {**every_size, "grad_accum_steps": 2}
        traced = sized.kept(_key(two), space).get(micro)
        runs = alike.one_micro_step(traced or _read_runs(two, setup, micro, space, between))
    return runs


def _traced_whole(model: ModelInfo) -> bool:
    """Whether ``model``'s stacks are traced at their full depth, not extrapolated."""
    # An encoder-decoder's two stacks are cut to one traced depth; stacks of unequal depth
    # (a 12-layer encoder, a 2-layer decoder) do not extrapolate along one line: trace them whole.
    unequal = model.arch.family == "encoder-decoder" and (
        model.arch.num_decoder_layers != model.arch.num_layers
    )
    # image models are traced whole: stages of other widths (ConvNeXt, Swin) do not lie on
    # one line through two depths, and they are small enough to trace in a second
    return unequal or (model.arch.family == "vision" and not cuttable_vision(model))


def _dry_runs(
    model: ModelInfo, setup: TrainingSetup, sizes: _Sizes, depths: tuple[int, int] | None
) -> tuple[TraceResult, ...]:
    """One dry run of the whole model (``depths`` None), or two at ``depths``, side by side
    where a second process helps (``_worker``); none of them replays the allocator
    (``_combine`` does)."""
    # started before torch is imported here, so that the helper's import runs alongside
    helper = _worker.helper() if depths else None
    kw: dict[str, Any] = {**asdict(sizes), "reserve": False}
    if depths is None:
        _announce(model, setup, sizes.micro, sizes.seq, None)
        return (_worker.trace_here(model, setup, depth=None, **kw),)
    low, high = depths
    if helper is None or not helper.submit((model, setup, {**kw, "depth": low})):
        runs = []
        for depth in depths:
            _announce(model, setup, sizes.micro, sizes.seq, depth)
            runs.append(_worker.trace_here(model, setup, depth=depth, **kw))
        return tuple(runs)
    _announce(model, setup, sizes.micro, sizes.seq, high, low)
    start = time.monotonic()
    deep = _worker.trace_here(model, setup, depth=high, **kw)
    # the shallower dry run takes less than the deeper one: a helper that has not answered
    # long after is stuck, and this process traces it
    shallow = helper.result(timeout=60 + 10 * (time.monotonic() - start))
    if not isinstance(shallow, TraceResult):  # the helper failed it: here, as it would
        shallow = _worker.trace_here(model, setup, depth=low, **kw)
    return shallow, deep


def _combine(
    model: ModelInfo,
    setup: TrainingSetup,
    sizes: _Sizes,
    depths: tuple[int, int] | None,
    runs: tuple[TraceResult, ...],
) -> TraceResult | None:
    """The result at the model's depth from ``runs`` (traced or interpolated): the whole run,
    or the two at ``depths`` extrapolated; on CUDA with the allocator's replay. None where an
    image model's history does not unroll (it is traced whole instead)."""
    expandable = setup.expandable_segments
    if depths is None:
        (result,) = runs
        if sizes.device == "cuda":
            reserved = simulate(result.events, expandable_segments=expandable).reserved_bytes
            result = replace(result, reserved_bytes=reserved)
        return result
    low, high = depths
    shallow, deep = runs
    result = extrapolate(shallow, deep, low, high, model.arch.num_layers)
    if sizes.device == "cuda":
        replayed = _reserve(model, setup, (shallow, deep), depths, result)
        if replayed is None:
            return None
        result = replace(result, reserved_bytes=replayed)
    return result


def _unrolls(setup: TrainingSetup, depths: tuple[int, int]) -> bool:
    """Whether a dry run at ``depths`` can be unrolled to the full depth: a period of one
    layer, and not FSDP1, whose flat parameters the unroll does not fit yet."""
    return depths[1] - depths[0] == 1 and not (is_fsdp(setup) and setup.fsdp_version == 1)


def _reserve(
    model: ModelInfo,
    setup: TrainingSetup,
    traced: tuple[TraceResult, TraceResult],
    depths: tuple[int, int],
    at: TraceResult,
) -> int | None:
    """What the caching allocator reserves at the model's depth: the deeper dry run's history
    unrolled to the full depth and replayed (``unroll``). Where it does not unroll (stacks of
    alternating layer types, a trace off the per-layer pattern), the larger of the two dry
    runs' reserves beyond their peaks is carried over to the extrapolated peak ``at``: that
    overhead is not a line in the depth (GPT-2 with checkpointing, 8 x 256 on a T4: 12.6% low
    against the whole model's simulation). None for an image model that does not unroll
    (BEiT: 3.6-4.6% low carried over): its caller traces it whole."""
    expandable = setup.expandable_segments
    shallow, deep = traced
    if shallow.layers and deep.layers and _unrolls(setup, depths):
        # the stacks cut to the traced depth are those whose depth differs between the two
        # dry runs; a model whose stacks were not found (none cut) is not unrolled
        below, above = shallow.layers.stack_depths, deep.layers.stack_depths
        if len(below) == len(above) and below != above:
            full = tuple(
                model.arch.num_layers if a != b else b for a, b in zip(below, above, strict=True)
            )
            events = unroll(deep.events, deep.layers, full)
            if events is not None:
                return simulate(events, expandable_segments=expandable).reserved_bytes
    if model.arch.family == "vision":
        return None
    over = max(
        simulate(r.events, expandable_segments=expandable).reserved_bytes - r.peak.total
        for r in traced
    )
    return at.peak.total + max(0, over)


def estimate_trace(
    model: ModelInfo, setup: TrainingSetup, workload: Workload, *, full_depth: bool = False
) -> MemoryEstimate:
    """A MemoryEstimate from dry runs; falls back to the analytic engine where it must."""
    device, gpu = workload.device, workload.gpu
    resolved = analytic.resolve_setup(model, setup, device, gpu)
    vision = model.arch.family == "vision"  # the formulas model token models only
    formulas = None
    if not vision:
        formulas = analytic.estimate_analytic(model, setup, workload)
    if resolved.grad_ckpt and not model.supports_grad_ckpt:
        raise UsageError(
            f"--grad-ckpt: transformers cannot checkpoint {model.name}'s layers "
            f"({model.arch.model_type} models do not support activation checkpointing)"
        )
    why_not = unsupported(model, resolved)
    if resolved.is_lora:  # bad targets are the user's error, before any trace
        model.lora_params(resolved.lora_rank, resolved.lora_targets)
    if why_not is None:
        try:
            traced = _estimate_traced(model, resolved, workload, full_depth=full_depth)
        except UsageError:
            raise
        except Exception as e:
            # lazy: torch and transformers (~2 s), only when no cached result answers
            from batchfit.memory.trace.hf import is_trace_limit

            if not is_trace_limit(e):
                raise
            first_line = (str(e).splitlines() or [""])[0][:160]
            why_not = f"the dry run failed ({type(e).__name__}: {first_line})"
        else:
            # The formulas' checks of the setup (bf16 support, kernels) apply to the trace too.
            checks = (
                formulas.warnings if formulas else (*model.warnings, *advice(resolved, device, gpu))
            )
            return replace(traced, warnings=tuple(dict.fromkeys(checks)))
    if formulas is None:
        raise UsageError(
            f"{model.name} is an image model, which only the trace engine models, and the "
            f"trace cannot run this setup yet: {why_not}"
        )
    return replace(
        formulas,
        warnings=(
            f"the trace engine cannot run this setup yet: {why_not}; the analytic engine answered",
            *formulas.warnings,
        ),
    )


def _estimate_traced(
    model: ModelInfo, resolved: TrainingSetup, workload: Workload, *, full_depth: bool
) -> MemoryEstimate:
    device, gpu = workload.device, workload.gpu
    result, notes = traced_result(model, resolved, workload, full_depth=full_depth)
    components = dict(result.peak.components)
    buckets = _ddp_buckets(result, resolved)
    components["other"] += buckets
    peak_bytes = sum(components.values())
    reserved = max(result.reserved_bytes + buckets, peak_bytes)
    totals = device_totals(peak_bytes, reserved, device, gpu, resolved)
    trainable = _trainable(model, resolved)
    step = StepMemory(
        components=components,
        peak_phase=result.peak.phase,
        activation_peak_bytes=max(p.components["activations"] for p in result.phases),
        total_params=model.total_params + (trainable if resolved.is_lora else 0),
        trainable_params=trainable,
        lines=_trace_lines(components, result.peak.phase, totals, device, buckets),
        warnings=tuple(model.warnings),
        extras={
            "top_modules": list(result.top_modules),
            "moments": {p.key: p.total for p in result.phases},
            "trace_seconds": result.seconds,
            "from_histories": sized.from_histories(result),
            "peak_moment": result.peak.describe(),
            "notes": notes,
            # each sample's FLOPs in a micro-step (forward; backward with recompute), then the
            # bytes the other operators move (forward; backward), counted in the dry run: what
            # times a step the formulas cannot (image models)
            "flops_per_sample": list(result.flops),
        },
    )
    return assemble(
        step,
        totals,
        model=model.name,
        engine="trace",
        setup=resolved,
        workload=workload,
    )


def _ddp_buckets(result: TraceResult, setup: TrainingSetup) -> int:
    """DDP's gradient buckets: with ``gradient_as_bucket_view=False`` (its default) the
    reducer holds a flat copy of every trainable gradient, allocated during the first backward
    and rebuilt in the second; from the third step on it lives through the whole step
    (measured on 2 gloo ranks: GPT-2's 475 MiB of buckets held at the start of backward).
    The dry run runs one process without DDP: the buckets are added to every moment."""
    if setup.sharding != "ddp" or setup.num_gpus < 2:
        return 0
    return max(p.components["gradients"] for p in result.phases)


def _trace_lines(
    components: dict[str, int], phase: str, totals: DeviceTotals, device: str, buckets: int
) -> tuple[Line, ...]:
    """The accounting of a traced step: components at the peak, then the device's totals."""
    traced = {**components, "other": components["other"] - buckets}
    lines = [
        Line(c, f"at the peak ({phase})", v, "counted in a dry run of the real step")
        for c, v in traced.items()
    ]
    others: list[tuple[str, int, str]] = []
    if buckets:
        flat = "a flat copy of the gradients (gradient_as_bucket_view=False)"
        others.append(("DDP gradient buckets", buckets, flat))
    if device == "cuda":
        simulated = "caching allocator simulation (segments, rounding, splits)"
        context = f"{totals.context // BYTES_IN_MIB} MiB"
        others += [
            ("allocator: reserved beyond allocated", totals.reserved - totals.peak, simulated),
            ("CUDA context (outside the allocator)", totals.context, context),
        ]
    lines += [Line("other", part, value, how) for part, value, how in others]
    return tuple(lines)


def _trainable(model: ModelInfo, setup: TrainingSetup) -> int:
    if setup.is_lora:
        return model.lora_params(setup.lora_rank, setup.lora_targets)
    return model.total_params
