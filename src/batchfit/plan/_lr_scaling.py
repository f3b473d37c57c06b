"""Learning-rate scaling: an LR tuned at one global batch, moved to another.

The rate follows the batch (linear for SGD, square root for the Adam family), stops growing at
the critical batch when one is known, and for Adam the other hyperparameters that keep the same
training dynamics (Malladi et al. 2022: β1, β2, ε) are offered beside it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from batchfit.errors import UsageError
from batchfit.optimizers import get_optimizer

DEFAULT_BETAS = (0.9, 0.999)  # torch.optim.Adam / AdamW defaults (bitsandbytes' and HF's too)
DEFAULT_EPS = 1e-8  # torch.optim.Adam / AdamW default

# Beyond this factor either way, a scaled LR is a guess far from where it was tuned (and a
# unit mix-up, samples for tokens, gives factors of a sequence length).
LR_FACTOR_WARN = 8.0


def scale_learning_rate(
    base_lr: float, base_batch: float, global_batch: float, optimizer: str
) -> tuple[float, str]:
    """Scale a learning rate tuned at ``base_batch`` to ``global_batch``.

    The optimizer's registered ``LrRule`` says which: linear for SGD (Goyal et al. 2017), the
    square root for the Adam family (Malladi et al. 2022); both hold only below the critical
    batch size. An optimizer with no published rule gets the square root, and the returned
    text says it is a guess.

    Example:
        >>> scale_learning_rate(1e-4, 256, 1024, "adamw")[0]
        0.0002
        >>> scale_learning_rate(0.1, 256, 1024, "sgd")[0]
        0.4
        >>> scale_learning_rate(1e-4, 256, 1024, "lion")[1].startswith("no published")
        True
    """
    for flag, value in (("--base-lr", base_lr), ("--base-batch", base_batch)):
        # `not value > 0` also refuses NaN, which compares false with everything
        if not (math.isfinite(value) and value > 0):
            raise UsageError(f"{flag} must be a finite positive number, got {value}")
    ratio = global_batch / base_batch
    if not math.isfinite(base_lr * ratio):  # 1e308 x 4 overflows to inf
        raise UsageError(
            f"--base-lr {base_lr:g} scaled to {_count(global_batch)} samples overflows: "
            "give a real rate"
        )
    rule = get_optimizer(optimizer).lr  # its registered rule and source
    if rule.scaling == "linear":
        return base_lr * ratio, (
            f"linear scaling for {optimizer} ({rule.source}): "
            f"{base_lr:g} x {_count(global_batch)}/{_count(base_batch)}"
        )
    sqrt_text = f"{base_lr:g} x sqrt({_count(global_batch)}/{_count(base_batch)})"
    if rule.source is None:
        return base_lr * math.sqrt(ratio), (
            f"no published batch-size rule for {optimizer} ({rule.unsourced_why}): "
            f"Adam's square-root rule as a first guess, tune it: {sqrt_text}"
        )
    return base_lr * math.sqrt(ratio), (
        f"square-root scaling for {optimizer} ({rule.source}): {sqrt_text}"
    )


@dataclass(frozen=True)
class AdamAdjustment:
    """Adam's β1, β2 and ε that go with a batch ``factor`` times larger (Malladi et al. 2022).

    ``betas`` is None where the rule cannot be followed: ``factor x (1 - β) >= 1`` would make a
    β zero or negative (the stochastic differential equation behind the rule no longer
    approximates the run there).
    """

    factor: float
    base_betas: tuple[float, float]
    base_eps: float
    betas: tuple[float, float] | None
    eps: float | None

    @property
    def applicable(self) -> bool:
        return self.betas is not None

    def text(self) -> str:
        """One line for the human output."""
        k = _count(self.factor)
        if self.betas is None:
            b1, b2 = self.base_betas
            worst = max(1 - b1, 1 - b2)
            return (
                f"Malladi et al. 2022 would also rescale 1-β1, 1-β2 by {k}x, but "
                f"{k} x {worst:.3g} >= 1: their rule does not apply this far (β would be <= 0); "
                "keep betas and eps, and tune near the new batch"
            )
        assert self.eps is not None  # set together with betas
        return (
            f"offered with it (Malladi et al. 2022: 1-β1, 1-β2 x {k}, ε / sqrt({k})): "
            f"betas=({self.betas[0]:.6g}, {self.betas[1]:.6g}), eps={self.eps:.3g} "
            f"(from ({self.base_betas[0]:g}, {self.base_betas[1]:g}), {self.base_eps:g})"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "factor": self.factor,
            "base_betas": list(self.base_betas),
            "base_eps": self.base_eps,
            "betas": None if self.betas is None else list(self.betas),
            "eps": self.eps,
            "applicable": self.applicable,
        }


def adam_adjustment(
    factor: float,
    base_betas: tuple[float, float] = DEFAULT_BETAS,
    base_eps: float = DEFAULT_EPS,
) -> AdamAdjustment:
    """Adam's β1, β2, ε for a batch ``factor`` (κ) times the base batch (Malladi et al. 2022).

    The square-root scaling rule ("On the SDEs and Scaling Rules for Adaptive Gradient
    Algorithms", NeurIPS 2022) moves η to sqrt(κ)·η and, to keep the same SDE, 1-β1 to
    κ(1-β1), 1-β2 to κ(1-β2) and ε to ε/sqrt(κ).

    Example:
        >>> a = adam_adjustment(4.0)
        >>> a.betas, a.eps
        ((0.6, 0.996), 5e-09)
        >>> adam_adjustment(16.0).betas is None  # 16 x (1 - 0.9) >= 1
        True
    """
    check_betas(base_betas, base_eps)
    if not (math.isfinite(factor) and factor > 0):
        raise UsageError(f"the batch factor must be a finite positive number, got {factor}")
    b1, b2 = base_betas
    betas = (
        round(1 - factor * (1 - b1), 12),  # Malladi et al. 2022: 1-β1 -> κ(1-β1)
        round(1 - factor * (1 - b2), 12),  # Malladi et al. 2022: 1-β2 -> κ(1-β2)
    )
    # κ(1-β) >= 1; rounded, since 10 x (1 - 0.9) is 0.9999999999999998 in floating point
    if min(betas) <= 0:
        return AdamAdjustment(factor, base_betas, base_eps, None, None)
    eps = _tidy(base_eps / math.sqrt(factor))  # Malladi et al. 2022: ε -> ε/sqrt(κ)
    return AdamAdjustment(factor, base_betas, base_eps, betas, eps)


def check_betas(betas: tuple[float, float], eps: float) -> None:
    """Refuse betas outside [0, 1) and a non-positive ε (one line, exit 2)."""
    if len(betas) != 2 or not all(math.isfinite(b) and 0 <= b < 1 for b in betas):
        raise UsageError(
            f"--base-betas must be two numbers in [0, 1) such as 0.9,0.999, got "
            f"{','.join(f'{b:g}' for b in betas)}"
        )
    if not (math.isfinite(eps) and eps > 0):
        raise UsageError(f"--base-eps must be a finite positive number such as 1e-8, got {eps}")


def parse_betas(text: str) -> tuple[float, float]:
    """``"0.9,0.95"`` as a checked pair (``--base-betas``).

    Example:
        >>> parse_betas("0.9, 0.95")
        (0.9, 0.95)
    """
    parts = [p.strip() for p in text.split(",")]
    try:
        values = tuple(float(p) for p in parts)
    except ValueError:
        raise UsageError(f"--base-betas {text!r}: give two numbers, e.g. 0.9,0.999") from None
    if len(values) != 2:
        raise UsageError(f"--base-betas {text!r}: give two numbers, e.g. 0.9,0.999")
    pair = (values[0], values[1])
    check_betas(pair, DEFAULT_EPS)
    return pair


@dataclass(frozen=True)
class LrScaling:
    """How the LR followed the batch: the rule, the cap, and Adam's other settings.

    Batches are in ``unit`` (the target's: samples or tokens); ``factor`` is the global batch
    over the base batch, ``applied_factor`` the one the LR follows (both batches capped at
    the critical batch when one is known).
    """

    learning_rate: float
    rule: str
    unit: str
    base_batch: float
    global_batch: int
    factor: float
    applied_factor: float
    critical_batch: float | None
    adam: AdamAdjustment | None
    notes: tuple[str, ...] = ()

    @property
    def capped(self) -> bool:
        return self.applied_factor != self.factor

    def lines(self) -> list[str]:
        """The lines under the plan's learning rate in the human output."""
        return [*self.notes, *([self.adam.text()] if self.adam is not None else [])]

    def to_json(self) -> dict[str, Any]:
        return {
            "unit": self.unit,
            "base_batch": self.base_batch,
            "factor": self.factor,
            "applied_factor": self.applied_factor,
            "critical_batch": self.critical_batch,
            "capped": self.capped,
            "adam": None if self.adam is None else self.adam.to_json(),
            "notes": list(self.notes),
        }


def follow_batch(
    base_lr: float | None,
    base: tuple[float, str] | None,
    target: tuple[int, str],
    seq_len: int | None,
    optimizer: str,
    *,
    base_betas: tuple[float, float] = DEFAULT_BETAS,
    base_eps: float = DEFAULT_EPS,
    critical: tuple[float, str] | None = None,
) -> tuple[LrScaling | None, list[str]]:
    """The LR for the ``target`` batch, and the plan's warnings about it.

    ``base``, ``target`` and ``critical`` are (batch, unit) with unit "samples" or "tokens"; a
    batch in the other unit than the target's is converted at ``seq_len``. Beyond the
    critical batch (McCandlish et al. 2018: B_crit, which the noise scale B_simple that
    ``Accumulator(noise_scale=True)`` measures estimates) a larger batch buys few steps, so
    the LR is the one for the critical batch.

    Example:
        >>> s, _ = follow_batch(1e-4, (256, "samples"), (1024, "samples"), 512, "adamw")
        >>> s.learning_rate, s.adam.betas
        (0.0002, (0.6, 0.996))
        >>> s, _ = follow_batch(1e-4, (256, "samples"), (1024, "samples"), 512, "adamw",
        ...                     critical=(512, "samples"))
        >>> round(s.learning_rate, 8), s.capped
        (0.00014142, True)
    """
    lr_options(base_lr, base_betas, base_eps, *_split(critical))
    target_batch, unit = target
    crit, crit_note, warnings = _critical(critical, target, seq_len)
    if base_lr is None or base is None:
        return None, warnings
    base_text = "--base-batch" if base[1] == "samples" else "--base-batch-tokens"
    base_batch, base_note = _in_unit(base, unit, seq_len, base_text, "base batch")
    scale_learning_rate(base_lr, base_batch, target_batch, optimizer)  # refuses a bad base
    factor = target_batch / base_batch
    eff_base, eff_target, notes = _capped(base_batch, target, crit, crit_note)
    lr, rule = scale_learning_rate(base_lr, eff_base, eff_target, optimizer)
    applied = eff_target / eff_base
    if factor > LR_FACTOR_WARN or factor < 1 / LR_FACTOR_WARN:
        warnings.insert(
            0,
            f"the global batch is {factor:.3g}x the base batch ({_count(base_batch)} -> "
            f"{target_batch:,} {unit}): the LR moves from {base_lr:g} to {lr:.3g}, far from "
            "where it was tuned; check the base batch's unit (--base-batch is samples, "
            "--base-batch-tokens tokens) and tune the LR near the new batch",
        )
    adam = None
    if get_optimizer(optimizer).lr.adam_betas and applied != 1:
        adam = adam_adjustment(applied, base_betas, base_eps)
    return (
        LrScaling(
            learning_rate=lr,
            rule=rule + base_note,
            unit=unit,
            base_batch=base_batch,
            global_batch=target_batch,
            factor=factor,
            applied_factor=applied,
            critical_batch=crit,
            adam=adam,
            notes=tuple(notes),
        ),
        warnings,
    )


def _critical(
    critical: tuple[float, str] | None, target: tuple[int, str], seq_len: int | None
) -> tuple[float | None, str, list[str]]:
    """The critical batch in the target's unit, how it was converted, and a warning when the
    target is past it (McCandlish et al. 2018)."""
    if critical is None:
        return None, "", []
    target_batch, unit = target
    flag = "--critical-batch" if critical[1] == "samples" else "--critical-batch-tokens"
    crit, crit_note = _in_unit(critical, unit, seq_len, flag, "critical batch")
    if target_batch <= crit:
        return crit, crit_note, []
    return (
        crit,
        crit_note,
        [
            f"the global batch ({target_batch:,} {unit}) is past the critical batch "
            f"({_count(crit)} {unit}{crit_note}): beyond it a larger batch barely cuts the "
            "steps to a loss and costs more compute (McCandlish et al. 2018)"
        ],
    )


def _capped(
    base_batch: float, target: tuple[int, str], crit: float | None, crit_note: str
) -> tuple[float, float, list[str]]:
    """The base and target batches the LR follows (both capped at the critical batch when
    one is known), and the note that says so where the cap applied."""
    target_batch, unit = target
    if crit is None:
        return base_batch, float(target_batch), []
    eff_base, eff_target = min(base_batch, crit), min(float(target_batch), crit)
    if eff_target == target_batch and eff_base == base_batch:
        return eff_base, eff_target, []
    return (
        eff_base,
        eff_target,
        [
            f"capped at the critical batch ({_count(crit)} {unit}{crit_note}): the LR "
            "stops growing there (the rule holds only below it) and follows "
            f"{_count(eff_base)} -> {_count(eff_target)} {unit}, not "
            f"{_count(base_batch)} -> {target_batch:,}"
        ],
    )


def lr_options(
    base_lr: float | None,
    base_betas: tuple[float, float],
    base_eps: float,
    critical_batch: float | None,
    critical_batch_tokens: float | None,
) -> tuple[float, str] | None:
    """Check the LR options before any estimate runs; the critical batch as (size, unit).

    Example:
        >>> lr_options(3e-4, (0.9, 0.95), 1e-8, None, 2_000_000)
        (2000000, 'tokens')
    """
    if base_lr is None and (base_betas, base_eps) != (DEFAULT_BETAS, DEFAULT_EPS):
        raise UsageError("--base-betas and --base-eps go with --base-lr and its base batch")
    check_betas(base_betas, base_eps)
    if critical_batch is not None and critical_batch_tokens is not None:
        raise UsageError("give --critical-batch (samples) or --critical-batch-tokens, not both")
    for flag, value in (
        ("--critical-batch", critical_batch),
        ("--critical-batch-tokens", critical_batch_tokens),
    ):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise UsageError(f"{flag} must be a positive number, got {value}")
    if critical_batch is not None:
        return critical_batch, "samples"
    if critical_batch_tokens is not None:
        return critical_batch_tokens, "tokens"
    return None


def lr_json(scaling: LrScaling | None) -> dict[str, Any]:
    """The plan JSON's ``lr_scaling`` key (None without a base LR)."""
    return {"lr_scaling": None if scaling is None else scaling.to_json()}


def _split(critical: tuple[float, str] | None) -> tuple[float | None, float | None]:
    if critical is None:
        return None, None
    return (critical[0], None) if critical[1] == "samples" else (None, critical[0])


def _in_unit(
    batch: tuple[float, str], unit: str, seq_len: int | None, flag: str, what: str
) -> tuple[float, str]:
    """``batch`` in ``unit``, and a note saying how it was converted ("" when it was not)."""
    size, its_unit = batch
    if its_unit == unit:
        return float(size), ""
    if not seq_len:
        raise UsageError(
            f"{flag} in {its_unit} against a target in {unit} needs --seq-len to convert one "
            "into the other"
        )
    converted = size * seq_len if unit == "tokens" else size / seq_len
    return converted, (
        f" (the {what} of {_count(size)} {its_unit} taken as {_count(converted)} {unit} at "
        f"{seq_len} tokens a sample: the base recipe's sequence length is assumed)"
        if what == "base batch"
        else f": {_count(size)} {its_unit} at {seq_len} tokens a sample"
    )


def _tidy(value: float) -> float:
    """Twelve significant digits: no 7.071067811865475e-09 in JSON for 1e-8 / sqrt(2)."""
    return float(f"{value:.12g}")


def _count(batch: float) -> str:
    """A batch as written: whole numbers in full, a fraction to four digits."""
    return f"{batch:.0f}" if float(batch).is_integer() else f"{batch:.4g}"
