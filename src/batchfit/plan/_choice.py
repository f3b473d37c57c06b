"""The choice among the ladder's options: the fastest by the time model, within its resolution
the simplest (``_widest``, ``_climb_ladder``), and checkpointing as a dial: every K-th layer,
or none, where that pays (``_fewer_layers``).

``TIME_TOLERANCE`` and ``OFFLOAD_MARGIN`` are read from the package (``batchfit.plan``) each
time a plan is made, so setting them there tunes the choice.
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

from batchfit._units import ordinal
from batchfit.errors import UsageError
from batchfit.models import ModelInfo
from batchfit.plan import _ladder
from batchfit.plan._ladder import (
    GRAD_CKPT,
    OFFLOADS,
    PARTIAL_CKPT_EVERY,
    apply,
    ladder,
    partial_ckpt,
)
from batchfit.plan._target import _Fit, _Target
from batchfit.plan._value import Alternative
from batchfit.spec import TrainingSetup

MAX_QUIET_ACCUM = 64


def _climb(target: _Target, setup: TrainingSetup, wanted: int | None) -> _Fit:
    """The ladder's choice (``_climb_ladder``), checkpointing the fewest layers that pay
    (``_fewer_layers``)."""
    return _fewer_layers(target, _climb_ladder(target, setup, wanted), wanted)


class _Dial(NamedTuple):
    """One checkpointing option of ``_fewer_layers``: how many layers it checkpoints, its time."""

    layers: int  # checkpointed layers
    seconds: float  # one optimizer step by the time model
    micro: int  # the micro-batch it is timed at
    alt: Alternative | None  # None: full checkpointing, the fit as the ladder chose it
    many: bool  # more than MAX_QUIET_ACCUM micro-steps (and more than full checkpointing's)
    name: str


def _fewer_layers(target: _Target, fit: _Fit, wanted: int | None) -> _Fit:
    """``fit`` with full checkpointing replaced by every K-th layer's (K in
    ``PARTIAL_CKPT_EVERY``, only where the run can select layers: ``Preset.selects_ckpt_layers``)
    or by none, where that fits ``wanted`` and the time model predicts it faster (at equal
    times, the fewest checkpointed layers). An option that needs more than
    ``MAX_QUIET_ACCUM`` micro-steps (and more than full checkpointing's) wins only when over
    ``TIME_TOLERANCE`` faster: hundreds of micro-steps at a micro-batch of 1 or 2 are where
    the time model is least tested."""
    if (
        GRAD_CKPT not in fit.techniques
        or fit.max_micro_batch < (wanted or 1)
        or not isinstance(target.model, ModelInfo)
    ):
        return fit
    options, needs_code = _dial_options(target, fit, wanted, target.model.arch.num_layers)
    fit = replace(fit, alternatives=(*fit.alternatives, *needs_code))
    if len(options) == 1:
        return fit
    return _dial_choice(target, fit, options)


def _dial_options(
    target: _Target, fit: _Fit, wanted: int | None, layers: int
) -> tuple[list[_Dial], list[Alternative]]:
    """Full checkpointing (the fallback), then every K-th layer's and none, while they fit
    ``wanted``, each at the largest micro-batch it allows; and, where the framework's config
    cannot select layers (``Preset.selects_ckpt_layers``), the every K-th layer options as
    alternatives that carry the code they need, never chosen."""
    full_micro = target.timed_micro(fit.max_micro_batch, wanted)
    full_accum = target.per_gpu // full_micro
    full_seconds = target.step_seconds(fit.setup, full_micro)
    options = [_Dial(layers, full_seconds, full_micro, None, False, "every layer")]
    needs_code: list[Alternative] = []
    selectable = fit.setup.conventions.selects_ckpt_layers
    everies = [every for every in PARTIAL_CKPT_EVERY if layers // every >= 1]
    for every in (*everies, None):  # None: no checkpointing (offload may have made room)
        if every is None:
            combo = tuple(t for t in fit.techniques if t is not GRAD_CKPT)
            setup = replace(fit.setup, grad_ckpt=False, grad_ckpt_every=None)
        else:
            tech = partial_ckpt(every, layers, selectable=selectable)
            combo = tuple(tech if t is GRAD_CKPT else t for t in fit.techniques)
            setup = tech(fit.setup)
        try:
            alt = target.alternative(combo, setup)
        except UsageError:
            continue
        offered = every is not None and not selectable  # needs code: offered, never chosen
        if alt.max_micro_batch >= (wanted or 1) and not offered:
            alt = target.confirmed(alt)  # the lines' answer is a what-if
        if offered:
            needs_code.append(replace(alt, comm_bytes_per_step=target.comm(alt.setup)))
            if alt.max_micro_batch >= (wanted or 1):
                continue
        if alt.max_micro_batch < (wanted or 1):
            break  # fewer checkpointed layers hold more: a larger K fits less still
        alt = replace(alt, comm_bytes_per_step=target.comm(alt.setup))
        micro = target.timed_micro(alt.max_micro_batch, wanted)
        many = target.per_gpu // micro > max(MAX_QUIET_ACCUM, full_accum)
        seconds = target.step_seconds(alt.setup, micro)
        name = f"every {ordinal(every)} layer" if every else "none"
        options.append(_Dial(layers // every if every else 0, seconds, micro, alt, many, name))
    return options, needs_code


def _dial_choice(target: _Target, fit: _Fit, options: list[_Dial]) -> _Fit:
    """The fastest option, as _widest ranks: within the time model's resolution
    (TIME_TOLERANCE) of it, the larger micro-batch, then the fewer checkpointed layers (1 x
    H100, 8B: every 2nd layer at 8 x 64, 154 s, against every layer at 64 x 8, 149 s: every
    layer); an option past MAX_QUIET_ACCUM micro-steps only when over TIME_TOLERANCE faster
    than the rest. A note names every option tried."""
    tolerance = _ladder.TIME_TOLERANCE
    quiet = [o for o in options if not o.many]
    fastest = min(o.seconds for o in quiet)
    near = [o for o in quiet if o.seconds <= fastest * (1 + tolerance)]
    chosen = min(near, key=lambda o: (-o.micro, o.layers))
    longest = min((o for o in options if o.many), key=lambda o: (o.seconds, o.layers), default=None)
    if longest is not None and longest.seconds < fastest * (1 - tolerance):
        chosen = longest
    per_gpu = target.per_gpu
    tried = ", ".join(
        f"{o.name} {o.seconds:.3g} s at {o.micro} x {per_gpu // o.micro}" for o in options
    )
    faster = [o for o in options if o.seconds < chosen.seconds]
    notes = fit.notes
    if chosen.alt is not None or faster:
        why = (
            f"; within {tolerance:.0%} of the fastest the larger micro-batch is taken"
            if faster
            else ""
        )
        notes = (*notes, f"checkpointing tried as a dial: {tried}; taken: {chosen.name}{why}")
    if chosen.alt is None:
        return replace(fit, notes=notes)
    alt = chosen.alt
    return _Fit(alt.setup, alt.techniques, alt.max_micro_batch, (*fit.alternatives, alt), notes)


def _climb_ladder(target: _Target, setup: TrainingSetup, wanted: int | None) -> _Fit:
    """Every rung of the ladder as an alternative; then the choice: on several GPUs the widest
    exact sharding option (``_widest``), else the first rung that fits ``wanted`` (or 1)."""
    base_max = target.max_micro(setup)
    model = target.model if isinstance(target.model, ModelInfo) else None  # None: your module
    checkpointing = model is not None and model.supports_grad_ckpt
    alternatives: list[Alternative] = []
    for combo in ladder(setup, target.gpu, model, checkpointing=checkpointing):
        try:
            rung = apply(setup, combo)
            if _cannot_take_more(rung, alternatives, target.per_gpu):
                continue
            alt = target.alternative(combo, rung)
        except UsageError:
            continue  # a rung this model cannot take (no module matches the LoRA targets)
        alternatives.append(replace(alt, comm_bytes_per_step=target.comm(alt.setup)))
    # one GPU: the plain setup is timed against the ladder's exact rungs too (fused AdamW,
    # or offload that lets checkpointing go) where the time model applies
    timed = setup.num_gpus > 1 or isinstance(target.model, ModelInfo)
    if timed and setup.sharding in ("none", "ddp"):
        base = Alternative((), setup, base_max, 0, target.engine, target.comm(setup))
        widest = _widest(target, base, alternatives, wanted)
        if widest is not None:
            return widest
    if base_max > 0 and (wanted is None or wanted <= base_max):
        return _Fit(setup, (), base_max, tuple(alternatives))
    # nothing fits without offload (or the time model does not apply): the fastest exact
    # rung that fits, then those that change training in the ladder's order
    fitting = [
        k
        for k, alt in enumerate(alternatives)
        if alt.max_micro_batch >= (wanted or 1) and not alt.needs
    ]
    exact = [k for k in fitting if all(t.kind == "exact" for t in alternatives[k].techniques)]

    def usable(k: int) -> int:
        return target.timed_micro(alternatives[k].max_micro_batch, wanted)

    seconds = {k: target.step_seconds(alternatives[k].setup, usable(k)) for k in exact}
    fastest = min(seconds.values(), default=0.0)
    # within the time model's resolution of the fastest, the simpler first (_simpler)
    near = [k for k in exact if seconds[k] <= fastest * (1 + _ladder.TIME_TOLERANCE)]
    near.sort(key=lambda k: (*_simpler(alternatives[k], usable(k), setup.num_gpus), k))
    rest = sorted(set(exact) - set(near), key=lambda k: (seconds[k], k))
    for k in [*near, *rest, *sorted(set(fitting) - set(exact))]:
        alt = alternatives[k] = target.confirmed(alternatives[k])  # the lines' is a what-if
        if alt.max_micro_batch >= (wanted or 1):
            quickest = min(near, key=lambda j: seconds[j], default=k)
            notes: tuple[str, ...] = ()
            if k in seconds and seconds[k] > seconds[quickest] * (1 + TIE_NOTE_ABOVE):
                notes = (_tie_note(alternatives[quickest], seconds[quickest], alt, seconds[k]),)
            return _Fit(alt.setup, alt.techniques, alt.max_micro_batch, tuple(alternatives), notes)
    return _Fit(setup, (), base_max, tuple(alternatives))


def _cannot_take_more(setup: TrainingSetup, earlier: list[Alternative], per_gpu: int) -> bool:
    """``setup`` is an exact rung that already takes the whole per-GPU batch with another
    optimizer (8-bit AdamW added to checkpointing): it changes training, is never chosen (an
    exact rung fits first), is no faster and cannot take more samples, so it is neither
    searched nor shown (ViT-Base on a T4 at 256: checkpointing takes all 256)."""
    for alt in earlier:
        exact = bool(alt.techniques) and all(t.kind == "exact" for t in alt.techniques)
        if not exact or alt.max_micro_batch < per_gpu or alt.setup.optimizer == setup.optimizer:
            continue
        other = replace(
            setup, optimizer=alt.setup.optimizer, optimizer_impl=alt.setup.optimizer_impl
        )
        if other == alt.setup:
            return True
    return False


# a faster option passed over within TIME_TOLERANCE is named when it is this much faster
TIE_NOTE_ABOVE = 0.02


def _tie_note(faster: Alternative, seconds: float, taken: Alternative, chosen: float) -> str:
    """Why an option predicted faster, within ``TIME_TOLERANCE``, was not taken."""

    def names(alt: Alternative) -> str:
        return " + ".join(t.name for t in alt.techniques) or "the setup as given"

    tolerance = _ladder.TIME_TOLERANCE
    return (
        f"{names(faster)} is predicted at {seconds:.3g} s/step against {chosen:.3g} s/step "
        f"for {names(taken)}: within {tolerance:.0%} (the time model's resolution) the "
        "simpler is taken: the parameters on the GPU, no recompute and the larger micro-batch "
        "(on several GPUs the larger micro-batch first), fewer techniques"
    )


def _simpler(alt: Alternative, micro: int, num_gpus: int) -> tuple[int, int, int, int]:
    """The order among options within ``TIME_TOLERANCE`` of the fastest, simplest first.

    Parameters left on the GPU first: offloaded, every micro-step waits on PCIe, the time
    model's least tested assumption (hidden behind compute). Then, on several GPUs, the larger
    micro-batch (fewer micro-steps, fewer collectives) before no recompute; on one GPU, where
    a micro-batch buys only what the time model already counts, no recompute first (BERT on a
    T4: plain 64 x 4, not checkpointing at 256 for the same time). Then the fewest techniques
    (plain DDP beats ZeRO-1 + a chunked loss by simplicity when both take the same time)."""
    size, recompute = -micro, int(alt.setup.grad_ckpt)
    first, second = (recompute, size) if num_gpus == 1 else (size, recompute)
    return (int(alt.setup.offload == "optimizer+params"), first, second, len(alt.techniques))


def _offloads(alt: Alternative) -> bool:
    return any(t.name in OFFLOADS for t in alt.techniques)


def _widest(
    target: _Target, base: Alternative, alternatives: list[Alternative], wanted: int | None
) -> _Fit | None:
    """The exact option (as asked, or with the ladder's fused AdamW, lean loss and
    checkpointing, and on several GPUs ZeRO-1/2/3 or FSDP2) that finishes an optimizer step
    soonest by the time model (``batchfit.speed``: compute at the largest micro-batch the
    per-GPU batch allows,
    recompute under checkpointing, the communication compute does not hide); where the time
    model does not apply, the largest micro-batch, then no recompute, then the fewest
    techniques, then the least communication (``speed/_comm.py``). Offload (a CPU step)
    competes, but wins only when predicted ``OFFLOAD_MARGIN`` faster than the best option
    without it (a faster one not chosen gets a note); rungs that change training only when
    none of these fits (None then)."""
    options = [base, *alternatives]
    eligible = {
        i
        for i, a in enumerate(options)
        if all(t.kind == "exact" for t in a.techniques) and not a.needs
    }

    def usable(i: int) -> int:
        return target.timed_micro(options[i].max_micro_batch, wanted)

    def tiebreak(i: int) -> tuple[int, ...]:
        # _simpler's order, then the least sent (the time model already counts what each
        # sends; at equal time the one that sends less)
        alt = options[i]
        return (*_simpler(alt, usable(i), options[0].setup.num_gpus), alt.comm_bytes_per_step, i)

    tolerance, margin = _ladder.TIME_TOLERANCE, _ladder.OFFLOAD_MARGIN
    checked: set[int] = {0}  # the base's size is searched and confirmed already
    while eligible:
        fitting = [i for i in eligible if options[i].max_micro_batch >= (wanted or 1)]
        plain = [i for i in fitting if not _offloads(options[i])]
        if not plain:
            return None
        seconds = {i: target.step_seconds(options[i].setup, usable(i)) for i in fitting}
        fastest = min(seconds[i] for i in plain)
        offloaded = [i for i in fitting if _offloads(options[i])]
        quickest = min(offloaded, key=lambda i: seconds[i]) if offloaded else None
        notes: tuple[str, ...] = ()
        pool, passed_over = plain, None
        if quickest is not None and seconds[quickest] > 0:
            if seconds[quickest] * (1 + margin) < fastest:
                pool, fastest = fitting, seconds[quickest]
            elif seconds[quickest] < fastest:
                passed_over = quickest
        # within the time model's resolution of the fastest, the simpler option
        near = [i for i in pool if seconds[i] <= fastest * (1 + tolerance)]
        best = min(near, key=tiebreak)
        if passed_over is not None:  # against the choice's own time, as the plan shows it
            names = " + ".join(t.name for t in options[passed_over].techniques)
            notes = (
                f"{names} is predicted at {seconds[passed_over]:.3g} s/step against "
                f"{seconds[best]:.3g} s/step for the plan's choice, but not chosen: CPU "
                f"offload wins only when predicted over {margin:.0%} faster (its CPU Adam "
                "time depends on the host CPU, which batchfit does not know)",
            )
        q = min(near, key=lambda i: seconds[i])
        if seconds[best] > seconds[q] * (1 + TIE_NOTE_ABOVE):
            notes = (*notes, _tie_note(options[q], seconds[q], options[best], seconds[best]))
        if best in checked:
            alt = options[best]
            shown = tuple(options[1:])
            return _Fit(alt.setup, alt.techniques, alt.max_micro_batch, shown, notes)
        options[best] = target.confirmed(options[best])  # the lines' answer is a what-if
        checked.add(best)
    return None
