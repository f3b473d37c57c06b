"""Count what a training step allocates: storages by identity, over time, by category.

A ``TorchDispatchMode`` sees every op's outputs; each new storage is numbered and a weakref
finalizer records when it is freed (PyTorch preserves storage PyObjects, so the weakref dies
with the storage). Works the same on fake tensors (a dry run) and on real CPU tensors, which is
how tests check the dry run against a real step.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

from batchfit.memory.device import kernels
from batchfit.memory.trace.result import CATEGORIES, PhasePeak, live_after, moment_peaks

_aten = torch.ops.aten
_DEVICE = torch.ops.prim.device.default
_META = torch.device("meta")
Layer = tuple[int, int]  # (stack, index in the stack)
# phases whose tensors outside a layer belong to a layer's parameters (the optimizer's state
# and temporaries, the priming gradients): they take the layer of the op's inputs
_PER_PARAMETER_PHASES = ("setup", "optimizer-step", "zero-grad")
# matmuls and where their two matrices sit in args (addmm/baddbmm lead with the added input)
_GEMMS = {
    _aten.mm.default: 0,
    _aten.bmm.default: 0,
    _aten.addmm.default: 1,
    _aten.baddbmm.default: 1,
}


# the collective FSDP2 reduce-scatters gradients with: (output, input, op, group, ...)
_REDUCE_SCATTER = torch.ops.c10d._reduce_scatter_base_.default
# the list all-gather: FSDP1 gathers a CPU flat parameter into its chunks with it (torch 2.13
# distributed/fsdp/_flat_param.py:1467-1474 `if sharded_flat_param.is_cpu: ... dist.all_gather`)
_ALL_GATHER_LIST = torch.ops.c10d.allgather_.default


def cpu_bf16_gemm_scratch() -> bool:
    """Whether this CPU's bf16 matmuls take PyTorch's own fallback kernel (no oneDNN bf16, as on
    AVX2-only CPUs), whose ``A.t() @ B`` case sums into an fp32 matrix the size of the output
    (``c_accum`` in aten/src/ATen/native/BlasKernel.cpp) and frees it when the op returns."""
    return not bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _fp32_scratch(func: Any, args: Any, out: Any) -> int:
    """Bytes of the fallback kernel's fp32 accumulator for this op, or 0: bf16 operands, the
    first matrix transposed (column-major) and the second row-major, as in every weight
    gradient ``grad.t() @ x``; bmm runs its batch one matrix at a time, so one matrix's worth."""
    first = _GEMMS.get(func)
    if first is None or not isinstance(out, torch.Tensor) or out.dtype != torch.bfloat16:
        return 0
    a, b = args[first], args[first + 1]
    if a.dim() < 2 or b.dim() < 2 or a.dtype != torch.bfloat16:
        return 0
    if a.stride(-1) != 1 and a.stride(-2) == 1 and b.stride(-1) == 1:
        return 4 * int(out.shape[-1]) * int(out.shape[-2])
    return 0


@dataclass
class Timeline:
    """Allocation history: sizes by key, labels, phases, and each moment's peak.

    ``phase_peaks`` is keyed ``"phase|moment"``: a phase (forward, backward, ...) is split into
    moments that exist at every depth of a layer stack (which optimizer step and micro-step;
    in backward, which part of the stack is running), so each can be extrapolated on its own.
    """

    sizes: dict[int, int] = field(default_factory=dict)
    labels: dict[int, str] = field(default_factory=dict)
    born_in: dict[int, str] = field(default_factory=dict)
    module_of: dict[int, str] = field(default_factory=dict)
    events: list[tuple[int, int]] = field(default_factory=list)  # (key, +bytes / -bytes)
    # where the moments changed: (event count, the "phase|moment" keys, whether their peak is
    # checked there); each moment's peak is read from the history (``phase_peaks``)
    moment_marks: list[tuple[int, tuple[str, ...], bool]] = field(default_factory=list)
    # where each phase began: (number of events before it, phase); for the timeline picture
    phase_marks: list[tuple[int, str]] = field(default_factory=list)
    # which layer of which stack ran each event ((stack, index); None outside the stacks) and
    # which layer each storage belongs to: what unrolls a shallow trace to the full depth
    # (``unroll``)
    event_layers: list[Layer | None] = field(default_factory=list)
    key_layers: dict[int, Layer] = field(default_factory=dict)
    stack_depths: tuple[int, ...] = ()  # layers in each stack, in forward order

    @property
    def phase_peaks(self) -> dict[str, PhasePeak]:
        """Each moment's largest live total and the event count then (``moment_peaks``)."""
        return moment_peaks(self.events, self.moment_marks)

    def category(self, key: int) -> str:
        label = self.labels.get(key)
        if label:
            return label
        phase = self.born_in.get(key, "")
        if phase in ("forward", "backward", "loss"):
            return "activations"
        return "other"

    def live_at(self, event_index: int) -> set[int]:
        """Keys alive after the first ``event_index`` events (replaying the log)."""
        return live_after(self.events, event_index)

    def components(self, live: Iterable[int]) -> dict[str, int]:
        out = dict.fromkeys(CATEGORIES, 0)
        for key in live:
            out[self.category(key)] += self.sizes[key]
        return out


class AllocationTracker(TorchDispatchMode):  # type: ignore[no-untyped-call, unused-ignore]
    """Dispatch mode that tracks live storage bytes and records a :class:`Timeline`.

    Things a real step does that its tensors alone do not show are modelled here:

    - ``gemm_scratch``: on a CPU whose bf16 matmuls take the fallback kernel
      (:func:`cpu_bf16_gemm_scratch`), each ``A.t() @ B`` holds an fp32 output-sized
      accumulator for the op's duration (recorded as a transient, born and freed in the op).
    - ``gloo_scratch``: CPU ranks (gloo) reduce-scatter through a copy of the whole input,
      and run a list all-gather (FSDP1's) through one flat tensor of the whole output.
    - Gradient accumulation in place: when one tensor gets several gradients (a tied
      embedding), autograd's input buffer sums them with ``add_`` if it holds the only
      reference to a plain (non-view) buffer (``can_accumulate_inplace`` in
      torch/csrc/autograd/input_buffer.cpp), with ``add`` otherwise. Under a dispatch mode the
      engine always calls ``add``; the output is tracked after the next op starts, when it is
      known whether the first buffer died with the add (in place: no extra bytes) or not.
    """

    def __init__(self, gemm_scratch: bool = False, gloo_scratch: bool = False) -> None:
        super().__init__()  # type: ignore[no-untyped-call, unused-ignore]
        self.gemm_scratch = gemm_scratch
        self.gloo_scratch = gloo_scratch
        self._pending: torch.Tensor | None = None  # an accumulating add's output, not yet tracked
        self.timeline = Timeline()
        self.phase = "setup"
        self.moments: tuple[str, ...] = ("",)
        self._mark(checked=False)
        self.module = ""
        self.layer: Layer | None = None  # the layer running (set by the dry run's hooks)
        self._hint: Layer | None = None  # the layer of the output being tracked, from inputs
        self._next_key = 0
        self._key_of: dict[int, int] = {}  # id(storage) -> key, while alive
        self._live: set[int] = set()
        self._live_bytes = 0
        self._finalizers: dict[int, Any] = {}
        self.peak_total = 0
        # FLOPs of the matmuls, convolutions and attention each phase ran (torch's own FLOP
        # formulas, from the shapes), and how many micro-steps' forwards began
        self.flops = {"forward": 0.0, "backward": 0.0}
        # bytes the other operators read and write (their tensors' sizes): their time is the
        # memory traffic
        self.traffic = {"forward": 0.0, "backward": 0.0}
        self.forwards = 0

    # --- registration ------------------------------------------------------------------------
    def track(self, tensor: torch.Tensor, label: str | None = None) -> int | None:
        """Register a tensor's storage (once); returns its key.

        A wrapper subclass (FSDP2's DTensor parameters and gradients) reports a storage the
        size of the whole tensor that holds nothing: its inner (local) tensors are tracked.
        """
        if is_traceable_wrapper_subclass(tensor):
            inner_names, _ = tensor.__tensor_flatten__()
            inner = [getattr(tensor, name) for name in inner_names]
            keys = [self.track(t, label) for t in inner if isinstance(t, torch.Tensor)]
            return next((k for k in keys if k is not None), None)
        try:
            storage = tensor.untyped_storage()
        except (NotImplementedError, RuntimeError):  # sparse / nested: not modelled
            return None
        return self._track_storage(storage, label)

    def _track_storage(self, storage: torch.UntypedStorage, label: str | None) -> int | None:
        sid = id(storage)
        key = self._key_of.get(sid)
        if key is None:
            key = self._next_key
            self._next_key += 1
            nbytes = int(storage.nbytes())
            self._key_of[sid] = key
            self.timeline.sizes[key] = nbytes
            self.timeline.born_in[key] = self.phase
            if self.module:
                self.timeline.module_of[key] = self.module
            self._live.add(key)
            self._live_bytes += nbytes
            self._record(key, nbytes)
            self._finalizers[key] = weakref.finalize(storage, self._free, sid, key)
            self._note_peak()
        if label is not None:
            self.timeline.labels[key] = label
        return key

    def label(self, tensor: torch.Tensor, label: str) -> None:
        self.track(tensor, label)

    def _resized(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """A storage resized in place: FSDP2 frees an unsharded parameter's memory with
        ``storage.resize_(0)`` and brings it back with ``resize_(size)`` (``free_storage`` /
        ``alloc_storage`` in torch/distributed/fsdp/_fully_shard/_fsdp_param.py), so the
        storage object outlives its bytes. The old bytes end; the new ones are a new key."""
        sid = id(storage)
        key = self._key_of.get(sid)
        label = None
        if key is not None:
            # a resized storage is FSDP's (gathered parameters, first made by torch.empty):
            # labels are read when the result is made, so this one counts from its birth
            label = self.timeline.labels.setdefault(key, "other")
            finalizer = self._finalizers.get(key)
            if finalizer is not None:
                finalizer.detach()
            self._free(sid, key)
        if nbytes > 0:  # only FSDP2's unsharded parameters are resized in a training step
            self._track_storage(storage, label)

    def __enter__(self) -> Any:
        original = torch.UntypedStorage.resize_
        tracker = self

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            out = original(storage, size)
            tracker._resized(storage, int(size))
            return out

        # ``UntypedStorage.resize_`` never reaches a dispatch mode (PyTorch's MemTracker,
        # torch/distributed/_tools/mem_tracker.py, patches it for the same reason)
        self._restore_resize = original
        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign, assignment]
        kernels.FLOP_SINKS.append(self._count_flops)  # the emulated attention kernels'
        return super().__enter__()  # type: ignore[no-untyped-call, unused-ignore]

    def _free(self, sid: int, key: int) -> None:
        if key not in self._live:
            return
        self._live.discard(key)
        self._key_of.pop(sid, None)
        self._finalizers.pop(key, None)
        self._live_bytes -= self.timeline.sizes[key]
        self._record(key, -self.timeline.sizes[key])

    def _record(self, key: int, delta: int) -> None:
        self.timeline.events.append((key, delta))
        self.timeline.event_layers.append(self.layer)
        if delta > 0:
            layer = self.layer or self._hint
            if layer is not None:
                self.timeline.key_layers[key] = layer

    def layer_of(self, tensor: torch.Tensor) -> Layer | None:
        """The layer ``tensor``'s storage belongs to, if it is tracked and has one (a wrapper
        subclass's, FSDP2's DTensor: its local tensor's)."""
        if is_traceable_wrapper_subclass(tensor):
            inner_names, _ = tensor.__tensor_flatten__()
            inner = (getattr(tensor, name) for name in inner_names)
            layers = (self.layer_of(t) for t in inner if isinstance(t, torch.Tensor))
            return next((layer for layer in layers if layer is not None), None)
        try:
            key = self._key_of.get(id(tensor.untyped_storage()))
        except (NotImplementedError, RuntimeError):
            return None
        return None if key is None else self.timeline.key_layers.get(key)

    def same_layer(self, tensor: torch.Tensor, like: torch.Tensor) -> None:
        """``tensor`` belongs to ``like``'s layer (an optimizer state tensor made from no
        parameter, as Adam's step count)."""
        layer = self.layer_of(like)
        key = self.track(tensor)
        if layer is not None and key is not None:
            self.timeline.key_layers.setdefault(key, layer)

    def _inputs_layers(self, args: Any, outputs: list[torch.Tensor]) -> list[Layer | None] | None:
        """Outside a layer, in a per-parameter phase: the layer of each output, from the op's
        inputs (a list op's outputs pair with its first input list of the same length)."""
        if not outputs:
            return None
        for arg in args:
            if (
                isinstance(arg, (list, tuple))
                and len(arg) == len(outputs) > 1
                and all(isinstance(t, torch.Tensor) for t in arg)
            ):
                return [self.layer_of(t) for t in arg]
        for item in tree_flatten(args)[0]:
            if isinstance(item, torch.Tensor):
                layer = self.layer_of(item)
                if layer is not None:
                    return [layer] * len(outputs)
        return None

    def _note_peak(self) -> None:
        self.peak_total = max(self.peak_total, self._live_bytes)

    def _mark(self, checked: bool) -> None:
        """The moments change here; ``checked``: their peak counts what is alive now."""
        keys = tuple(f"{self.phase}|{moment}" for moment in self.moments)
        self.timeline.moment_marks.append((len(self.timeline.events), keys, checked))

    @property
    def live_bytes(self) -> int:
        return self._live_bytes

    def set_phase(self, phase: str, *moments: str) -> None:
        """Enter ``phase`` at ``moments`` (one moment can stand for several, e.g. the one layer
        of a 1-layer stack is both its top and its bottom)."""
        self.phase = phase
        self.forwards += phase == "forward"
        self._mark(checked=False)
        self._settle()
        self.timeline.phase_marks.append((len(self.timeline.events), phase))
        self.set_moments(*moments)

    def set_moments(self, *moments: str) -> None:
        self._settle()
        self.moments = moments or ("",)
        self._mark(checked=True)
        self._note_peak()

    def transient(self, nbytes: int) -> None:
        """Record ``nbytes`` allocated and freed inside one op (a kernel's own scratch)."""
        key = self._next_key
        self._next_key += 1
        self.timeline.sizes[key] = nbytes
        self.timeline.born_in[key] = self.phase
        self.timeline.labels[key] = "other"
        self._live.add(key)
        self._live_bytes += nbytes
        self._record(key, nbytes)
        self._note_peak()
        self._free(-1, key)

    def _count_flops(self, flops: float) -> None:
        if self.phase in self.flops:
            self.flops[self.phase] += flops

    def __exit__(self, *exc: Any) -> Any:
        if self._count_flops in kernels.FLOP_SINKS:
            kernels.FLOP_SINKS.remove(self._count_flops)
        self._settle()
        torch.UntypedStorage.resize_ = self._restore_resize  # type: ignore[method-assign]
        return super().__exit__(*exc)  # type: ignore[no-untyped-call, unused-ignore]

    def _settle(self) -> None:
        """Track a held-back accumulating add's output (see the class docstring)."""
        if self._pending is not None:
            out, self._pending = self._pending, None
            self.track(out)

    def _accumulating_add(self, func: Any, args: Any, kwargs: dict[str, Any]) -> bool:
        """Whether this op may be autograd's in-place gradient sum (see the class docstring)."""
        if self.phase != "backward" or func is not _aten.add.Tensor or len(args) != 2:
            return False
        first, second = args
        return (
            isinstance(first, torch.Tensor)
            and isinstance(second, torch.Tensor)
            and kwargs.get("alpha", 1) == 1
            and first.shape == second.shape
            and first.dtype == second.dtype
            and first.is_contiguous()
            and not first._is_view()
            and not first.requires_grad
            and id(first.untyped_storage()) in self._key_of
        )

    # --- dispatch ----------------------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self._settle()
        if func is _DEVICE and isinstance(args[0], FakeTensor):
            # a query that allocates nothing, asked of every tensor autograd's engine and the
            # optimizer's grouping touch (two thirds of a dry run's dispatches): answered as
            # FakeTensorMode answers it, without a trip through it
            fake = args[0]
            return _META if fake.fake_mode.in_kernel_invocation else fake.fake_device
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.phase in self.flops:
            flops = _flops(func, args, kwargs, out)
            if flops:
                self._count_flops(flops)
            else:
                self.traffic[self.phase] += _traffic(func, args, out)
        if self._accumulating_add(func, args, kwargs):
            self._pending = out
            return out
        # FSDP2's own ops (torch.ops.fsdp: all-gather and reduce-scatter buffers) hold
        # communication buffers, not activations
        label = "other" if getattr(func, "namespace", "") == "fsdp" else None
        outputs = [item for item in tree_flatten(out)[0] if isinstance(item, torch.Tensor)]
        layers = None
        if self.layer is None and self.phase in _PER_PARAMETER_PHASES:
            layers = self._inputs_layers(args, outputs)
        for i, item in enumerate(outputs):
            self._hint = layers[i] if layers else None
            self.track(item, label)
        self._hint = None
        if self.gloo_scratch and func is _REDUCE_SCATTER:
            # gloo reduce-scatters through a full-size copy of the input, allocated below the
            # dispatcher (measured on 4 CPU ranks: one 216 MiB buffer beside the 216 MiB input)
            self.transient(int(args[1].untyped_storage().nbytes()))
        if self.gloo_scratch and func is _ALL_GATHER_LIST:
            # gloo gathers into one flat tensor of the whole output, then copies it into the
            # chunks (ProcessGroupGloo.cpp AsyncAllgatherWork: `newLikeFlat(outputs[0])`)
            self.transient(sum(int(t.nbytes) for chunks in args[0] for t in chunks))
        if self.gemm_scratch:
            scratch = _fp32_scratch(func, args, out)
            if scratch:
                self.transient(scratch)
        return out


def _traffic(func: Any, args: Any, out: Any) -> float:
    """Bytes an operator without FLOPs reads and writes: its tensor inputs' and outputs' sizes
    (a broadcast input at most its storage; tensors in lists included, as the optimizer's
    foreach operators take them); none for a view, or an allocation that is not written
    (``empty``)."""
    if getattr(func, "is_view", False) or _is_empty(func):
        return 0.0
    total = 0
    for item in (*args, *(out if isinstance(out, (tuple, list)) else (out,))):
        for t in item if isinstance(item, (tuple, list)) else (item,):
            if isinstance(t, torch.Tensor):
                total += min(t.numel() * t.element_size(), t.untyped_storage().nbytes())
    return float(total)


def _is_empty(func: Any) -> bool:
    name = getattr(getattr(func, "overloadpacket", None), "__name__", "")
    return name.startswith("empty") or name in ("detach", "alias", "lift_fresh", "_unsafe_view")


def _flops(func: Any, args: Any, kwargs: dict[str, Any], out: Any) -> float:
    """The FLOPs of one operator call by torch's FLOP formulas (``torch.utils.flop_counter``:
    matrix multiplies, convolutions and their backward, attention kernels); 0 for the rest,
    whose time is their memory traffic."""
    packet = getattr(func, "overloadpacket", None)
    counter = _flop_formulas().get(packet)
    if counter is None:
        return 0.0
    try:
        if packet is _aten.convolution_backward:
            return _conv_backward_flops(*args)
        return float(counter(*args, **kwargs, out_val=out))
    except Exception:  # a formula that does not know this call's arguments counts nothing
        return 0.0


def _conv_backward_flops(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    _bias: Any,
    _stride: Any,
    _padding: Any,
    _dilation: Any,
    transposed: bool,
    _output_padding: Any,
    _groups: int,
    output_mask: Any,
) -> float:
    """A convolution's backward: the input's gradient and the weight's each cost its forward.
    (torch's own formula counts the weight's gradient as if every input channel met every
    output channel: a depthwise convolution's, ConvNeXt's 7x7, came out channels-fold.)"""
    from torch.utils.flop_counter import conv_flop_count

    forward = conv_flop_count(
        list(x.shape), list(weight.shape), list(grad_out.shape), transposed=transposed
    )
    return float(forward * (bool(output_mask[0]) + bool(output_mask[1])))


_FORMULAS: list[dict[Any, Any]] = []


def _flop_formulas() -> dict[Any, Any]:
    if not _FORMULAS:
        from torch.utils.flop_counter import flop_registry  # lazy: imports sympy helpers

        _FORMULAS.append(flop_registry)
    return _FORMULAS[0]
