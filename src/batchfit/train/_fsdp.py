"""What the runtime needs from FSDP2 (``torch.distributed.fsdp.fully_shard``, torch >= 2.6).

Public FSDP2 calls where they exist (``set_requires_gradient_sync``, ``set_reshard_after_*``,
``unshard``, ``reset_iter_state``). Four things have no public call and read FSDP2's private
state, checked against torch 2.13 (``torch/distributed/fsdp/_fully_shard/``): saving the flags
to put them back, dropping the unsharded gradients of an abandoned global batch, running
the reduce-scatter of gradients accumulated without sync outside a backward pass (the root's
``_root_post_backward_final_callback``, which FSDP2 itself runs after every backward), and
finding the unsharded parameters whose gradient hooks see each micro-step's local gradient
(the noise scale).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


def _fsdp_module_type() -> type | None:
    """FSDP2's module class (torch >= 2.6; batchfit allows torch 2.4), where FSDP2 is loaded:
    ``fully_shard`` made every FSDP2 module, so until it is imported no model is one, and
    importing it (DTensor, sympy) costs every process about a second."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return getattr(fsdp, "FSDPModule", None) if fsdp is not None else None


def root_of(model: torch.nn.Module) -> Any | None:
    """``model`` when ``fully_shard`` was applied to it (an ``FSDPModule``), else None."""
    module_type = _fsdp_module_type()
    if module_type is None or not isinstance(model, module_type):
        return None
    return model


def modules_of(root: Any) -> list[Any]:
    """Every FSDP2 module under ``root`` (itself included), in ``modules()`` order."""
    module_type = _fsdp_module_type()
    assert module_type is not None  # a root exists only when the class does
    return [m for m in root.modules() if isinstance(m, module_type)]


def group_of(root: Any) -> dist.ProcessGroup | None:
    """The process group the parameters are sharded over (1-D mesh); None: the default group.

    HSDP's 2-D mesh spans every rank of its replicate and shard dimensions, which is the
    default group when the job is data-parallel only.
    """
    for p in root.parameters():
        mesh = getattr(p, "device_mesh", None)
        if mesh is not None and mesh.ndim == 1:
            group: dist.ProcessGroup = mesh.get_group()
            return group
        break
    return None


def set_sync(root: Any, sync: bool) -> None:
    """Sync (reduce-scatter) and reshard in this backward, or accumulate unsharded.

    FSDP2's own recipe for accumulation (``set_reshard_after_backward``'s docstring): without
    sync, keep the parameters unsharded after backward so the next forward needs no
    all-gather.
    """
    root.set_requires_gradient_sync(sync)
    root.set_reshard_after_backward(sync)


@dataclass(frozen=True)
class _GroupFlags:
    reduce_grads: bool
    all_reduce_grads: bool
    reshard_after_backward: bool
    post_forward_mesh_info: Any


@dataclass(frozen=True)
class Flags:
    """The sync and reshard settings of every FSDP2 parameter group under a root."""

    groups: list[tuple[Any, _GroupFlags]]
    auto_reshard: list[tuple[Any, bool]]

    @classmethod
    def capture(cls, root: Any) -> Flags:
        groups, auto = [], []
        for module in modules_of(root):
            state = module._get_fsdp_state()
            auto.append((state, state._auto_reshard_after_forward))
            for group in state._fsdp_param_groups:
                flags = _GroupFlags(
                    group.reduce_grads,
                    group.all_reduce_grads,
                    group.reshard_after_backward,
                    group.post_forward_mesh_info,
                )
                groups.append((group, flags))
        return cls(groups, auto)

    def restore(self) -> None:
        for state, auto in self.auto_reshard:
            state._auto_reshard_after_forward = auto
        for group, flags in self.groups:
            group.reduce_grads = flags.reduce_grads
            group.all_reduce_grads = flags.all_reduce_grads
            group.reshard_after_backward = flags.reshard_after_backward
            group.post_forward_mesh_info = flags.post_forward_mesh_info


@contextlib.contextmanager
def restoring_flags(root: Any) -> Iterator[None]:
    """Put every FSDP2 module's sync and reshard flags back as the block ends."""
    flags = Flags.capture(root)
    try:
        yield
    finally:
        flags.restore()


def hold_unsharded(root: Any) -> None:
    """All-gather every module's parameters now and keep them, with gradients unsynced.

    After this no forward or backward runs a collective until :func:`reduce_gradients`: no
    all-gather (parameters stay unsharded through forward and backward) and no
    reduce-scatter (gradients accumulate unsharded). Memory: the unsharded parameters and
    gradients, as under DDP, instead of one block's at a time.
    """
    root._get_fsdp_state()._lazy_init()  # what the first forward would do: find the root
    modules = modules_of(root)
    for module in modules:
        module.set_requires_gradient_sync(False, recurse=False)
        module.set_reshard_after_backward(False, recurse=False)
        module.set_reshard_after_forward(False, recurse=False)
    for module in modules:
        module.unshard()


def reduce_gradients(root: Any) -> None:
    """Reduce-scatter the unsharded gradients (averaged over the ranks, as FSDP2 does) and
    reshard: what the last backward of an accumulation would have done.

    Every rank calls it, in the same order of modules, as in a backward pass.
    """
    for module in modules_of(root):
        module.set_requires_gradient_sync(True, recurse=False)
        module.set_reshard_after_backward(True, recurse=False)
    root.set_is_last_backward(True)
    # After a backward every parameter group is IDLE; the callback runs post_backward on each
    # group not in POST_BACKWARD (reduce-scatter, reshard) and then finalizes.
    root._get_fsdp_state()._root_post_backward_final_callback()


def abandon(root: Any) -> None:
    """Drop a global batch half done: its unsharded gradients, FSDP2's in-flight state, and
    reshard. No collective runs, so one rank may call it alone.
    """
    for module in modules_of(root):
        for group in module._get_fsdp_state()._fsdp_param_groups:
            for fsdp_param in group.fsdp_params:
                unsharded = getattr(fsdp_param, "_unsharded_param", None)
                if unsharded is not None:
                    unsharded.grad = None
                fsdp_param.unsharded_accumulated_grad = None
    state = root._get_fsdp_state()
    if state._is_root is None:
        return  # never ran forward: nothing in flight
    reset = getattr(root, "reset_iter_state", None)
    if reset is not None:
        reset()
    else:  # torch < 2.13: reshard each module; no collective was left in flight by us
        for module in modules_of(root):
            module.reshard()


def unsharded_params(module: Any) -> list[tuple[torch.nn.Parameter, torch.nn.Parameter | None]]:
    """(sharded, unsharded) for each parameter FSDP2 manages directly in ``module``.

    The unsharded parameter is the one forward and backward use (its ``.grad`` collects a
    micro-step's local gradient before the reduce-scatter); None before the first all-gather
    creates it. FSDP2 keeps that object from then on (``FSDPParam.init_unsharded_param``).
    """
    pairs: list[tuple[torch.nn.Parameter, torch.nn.Parameter | None]] = []
    for group in module._get_fsdp_state()._fsdp_param_groups:
        for fsdp_param in group.fsdp_params:
            pairs.append((fsdp_param.sharded_param, getattr(fsdp_param, "_unsharded_param", None)))
    return pairs
