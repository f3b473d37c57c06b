"""Where a traced step is: the moment (for each moment's peak) and the layer (for unrolling).

``Moments`` hooks the model's layer stacks so that every moment of the step exists at every
depth (``result.PhaseResult``) and tells the tracker which layer is running; ``tag_layers``
tells it which layer each parameter belongs to.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from batchfit.memory.trace.tracker import AllocationTracker, Layer


def _first_grad_tensor(value: Any) -> torch.Tensor | None:
    for item in tree_flatten(value)[0]:
        if isinstance(item, torch.Tensor) and item.requires_grad:
            return item
    return None


class Moments:
    """Names the moment a traced step is at, so that every moment exists at every depth.

    The optimizer step is one moment per step; forward and backward are moments per step and
    per first / later micro-step (later ones hold the gradients of earlier ones). Backward is
    split where the gradient reaches a stack's top layer, its bottom layer and what lies below
    it: the peak of backward is at its start (all activations held) or its end (all gradients
    held), and which one depends on the micro-batch, so the two are extrapolated over depth
    apart. Forward is split the same way, where it enters a stack's bottom, middle and top
    layers and leaves the last stack (``head``: final norm, output head, loss): its peak is
    early (the root's gathered parameters under FSDP, the embeddings) or late (all
    activations), and one moment for the whole of forward mixes the two across depths
    (Llama-3.1-8B, FSDP2 on 8 ranks, micro-batch 1: the early peak at 3 layers and the late
    one at 4 extrapolated to 76 GiB of activations at 32 layers, more than micro-batch 4).
    """

    def __init__(self, tracker: AllocationTracker, stacks: tuple[tuple[torch.nn.Module, ...], ...]):
        self.tracker = tracker
        self.step = 1
        self.micro = 0
        self.handles: list[Any] = []
        # where forward starts: below the first stack (the embeddings); a model without a
        # stack is one forward moment
        self.forward_start = "0below" if stacks else ""
        for k, stack in enumerate(stacks):
            for i, layer in enumerate(stack):
                names = []
                if i == len(stack) - 1:
                    names.append(f"{k}top")
                if i == 0:
                    names.append(f"{k}bottom")
                names = names or [f"{k}middle"]
                self.handles.append(
                    layer.register_forward_pre_hook(self._in_forward(*names, layer=(k, i)))
                )
                self.handles.append(layer.register_forward_hook(self._on_output(names, (k, i))))
            # after a stack's top layer: below the next stack, or the head after the last
            after = f"{k + 1}below" if k + 1 < len(stacks) else "head"
            self.handles.append(stack[-1].register_forward_hook(self._in_forward(after)))
            self.handles.append(
                stack[0].register_forward_pre_hook(self._on_input(f"{k}below"), with_kwargs=True)
            )
        # The top layer's work ends where the next module outside the stacks starts: what the
        # model's loop does after a layer returns (dropping the previous hidden states) is that
        # layer's, the top's as any other's.
        self.inside = {id(m) for stack in stacks for layer in stack for m in layer.modules()}
        self.handles.append(torch.nn.modules.module.register_module_forward_pre_hook(self._leave))

    @property
    def base(self) -> str:
        return f"s{self.step}m{1 if self.micro <= 1 else 2}"

    def _at(self, *names: str, layer: Layer | None = None) -> Callable[[torch.Tensor], None]:
        """A gradient hook: backward reaches ``names`` (and ``layer`` runs, or none)."""

        def hook(_grad: torch.Tensor) -> None:
            self.tracker.set_moments(*(f"{self.base}.{n}" for n in names))
            self.tracker.layer = layer

        return hook

    def _in_forward(self, *names: str, layer: Layer | None = None) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            # not while backward recomputes a checkpointed layer: that is backward's moment
            if self.tracker.phase == "forward":
                self.tracker.set_moments(*(f"{self.base}.{n}" for n in names))
                if layer is not None:
                    self.tracker.layer = layer

        return hook

    def _leave(self, module: torch.nn.Module, *_: Any) -> None:
        if self.tracker.phase == "forward" and id(module) not in self.inside:
            self.tracker.layer = None

    def _on_output(self, names: list[str], layer: Layer) -> Callable[..., None]:
        def hook(_module: torch.nn.Module, _args: Any, output: Any) -> None:
            tensor = _first_grad_tensor(output)
            if tensor is not None and self.tracker.phase == "forward":
                tensor.register_hook(self._at(*names, layer=layer))  # type: ignore[no-untyped-call, unused-ignore]

        return hook

    def _on_input(self, name: str) -> Callable[..., None]:
        def hook(_module: torch.nn.Module, args: Any, kwargs: Any) -> None:
            tensor = _first_grad_tensor((args, kwargs.get("hidden_states")))
            if tensor is not None and self.tracker.phase == "forward":
                tensor.register_hook(self._at(name))  # type: ignore[no-untyped-call, unused-ignore]

        return hook

    def enter(self, phase: str) -> None:
        self.tracker.layer = None
        if phase == "forward":
            self.micro += 1
            start = f".{self.forward_start}" if self.forward_start else ""
            self.tracker.set_phase(phase, f"{self.base}{start}")
        elif phase == "backward":
            self.tracker.set_phase(phase, f"{self.base}.head")
        else:
            self.tracker.set_phase(phase, f"s{self.step}")
        if phase == "zero-grad":
            self.step += 1
            self.micro = 0


def tag_layers(tracker: AllocationTracker, stacks: tuple[tuple[torch.nn.Module, ...], ...]) -> None:
    """Tell the tracker which layer each parameter and buffer belongs to."""
    tracker.timeline.stack_depths = tuple(len(stack) for stack in stacks)
    for k, stack in enumerate(stacks):
        for i, layer in enumerate(stack):
            for tensor in (*layer.parameters(), *layer.buffers()):
                key = tracker.track(tensor)
                if key is not None:
                    tracker.timeline.key_layers[key] = (k, i)
