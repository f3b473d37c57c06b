"""The peak of a steady-state step: the largest of three moments (optimizer state allocated).

The start of backward (all activations, the loss's fp32 buffers, and gradients of earlier
micro-steps when accumulating), the end of backward (all gradients; with checkpointing, one
recomputed layer), and ``optimizer.step()`` (gradients plus the optimizer's temporaries).
"""

from __future__ import annotations

from dataclasses import dataclass

from batchfit.memory.device.totals import Device
from batchfit.memory.formulas._params import Params, Shapes
from batchfit.memory.formulas._sharding import Sharded
from batchfit.memory.formulas.activations import Activations
from batchfit.memory.types import Line
from batchfit.optimizers import StepContext, get_optimizer
from batchfit.spec import TrainingSetup


@dataclass(frozen=True)
class Peak:
    """The moment of the peak and each component's bytes then."""

    phase: str
    components: dict[str, int]
    lines: tuple[Line, ...]


def step_temporaries(
    shapes: Shapes, setup: TrainingSetup, state_elem: int, device: Device, grad_bytes: int = 4
) -> tuple[float, str]:
    """Bytes the optimizer's step allocates on top of its state, and why (the most alive at
    once; the optimizer's registered spec says, and the trace checks it against its code)."""
    optimizer = get_optimizer(setup.optimizer)
    impl = optimizer.resolve_impl(setup.optimizer_impl, on_cuda=device == "cuda")
    return optimizer.temporaries(StepContext(shapes, impl, state_elem, grad_bytes))


def peak(
    setup: TrainingSetup,
    params: Params,
    sharded: Sharded,
    acts: Activations,
    *,
    fixed: float,
    num_layers: int,
    device: Device,
    grad_accum_steps: int,
) -> Peak:
    """The largest of the three moments; ``fixed`` is what every moment holds besides."""
    if sharded.step_temps is not None:
        temps, temps_why = sharded.step_temps
    else:
        temps, temps_why = step_temporaries(
            params.trainable_shapes, setup, params.state_elem, device, params.grad_bytes
        )
        if setup.offload != "none":
            temps = 0.0  # the step runs on the CPU
        temps /= sharded.shard
    grads = sharded.grads
    # The first gradients backward produces (output head / last layer): about one layer's worth.
    head_grad = 0.0
    if params.lora_targets is None:
        head_grad = params.trainable * params.grad_bytes / max(num_layers, 1)
    held = grad_accum_steps > 1 or sharded.grads_held
    grads_before = grads if held else min(head_grad, grads)
    phases = {
        "backward": (grads_before, acts.at_backward_start, fixed),
        "backward-top": (grads_before, acts.at_backward_top, fixed),
        "backward-end": (grads, acts.at_backward_end, fixed),
        "optimizer-step": (grads, 0.0, fixed + temps),
    }
    phase = max(phases, key=lambda p: sum(phases[p]))
    g_at, a_at, o_at = phases[phase]
    lines = []
    if temps and phase == "optimizer-step":
        lines.append(Line("other", "optimizer step temporaries", int(temps), temps_why))
    components = {
        "weights": int(sharded.weights),
        "gradients": int(g_at),
        "optimizer_state": int(sharded.states),
        "activations": int(a_at),
        "other": int(o_at),
    }
    return Peak(phase, components, tuple(lines))
