"""Is the planner's choice the fastest exact plan? ``make_plan`` against a brute force.

For each case (model, GPU, GPU count, sequence length, global batch, precision) the planner
runs on the analytic engine, and, independently, every exact candidate is enumerated: every
combination of the exact techniques the ladder's vocabulary holds (checkpointing of every
layer, every 2nd, 3rd or 4th, or none; the lean loss, fused or chunked as the ladder would pick
for the model; PyTorch's fused AdamW; ZeRO-1/2/3 or FSDP2, with or without CPU offload of the
optimizer state or of everything) times every micro-batch that divides the per-GPU batch and
fits with the planner's headroom. Each candidate is judged by the planner's own functions
(``_Target.fits``: the same estimate and accumulation rule; ``_Target.step_seconds``: the same
step-time model, seconds per optimizer step), so a gap is the planner's *selection*, never a
different model. Gap = chosen / best - 1.

The 30 evaluation cases are drawn with ``random.Random(20261128)`` (fixed before any result
was seen) from catalog decoder LLMs of 0.4-14B parameters plus gpt2 and bert-large-uncased,
ten data-centre GPUs, 1/2/4/8 GPUs, sequence 512-4096 (within a model's learned positions),
a global batch in samples or tokens, and AMP bf16 where the GPU has bf16, else AMP fp16 or
fp32 (drawn). The debug cases are those the planner was developed on (the dial tests,
the golden plans): reported apart.

Runs in seconds (analytic engine); a progress line per case on stderr.

    python benchmarks/plan_choice.py [--no-write] [--cases N]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass, replace
from itertools import pairwise
from pathlib import Path
from typing import Any

from batchfit.errors import UsageError
from batchfit.hardware import GpuSpec, get_gpu
from batchfit.memory.formulas.analytic import resolve_setup
from batchfit.models import ModelInfo, catalog_names, resolve_model
from batchfit.plan import DEFAULT_HEADROOM_BYTES, _Target, make_plan
from batchfit.plan._ladder import OFFLOAD_MARGIN, PARTIAL_CKPT_EVERY, TIME_TOLERANCE, lean_loss
from batchfit.spec import TrainingSetup

HERE = Path(__file__).resolve().parent
DATA = HERE / "data" / "plan_choice.json"
SEED = 20261128
NUM_CASES = 30
# a gap the summary counts as a miss: under the time model's own tolerance for ties (5%)
MISS = 0.02
SHOWN = 0.001  # a factor of a gap this small is rounding between equal-time options

GPUS = (
    "t4",
    "v100-16gb",
    "v100-32gb",
    "a10g",
    "l4",
    "l40s",
    "a100-40gb",
    "a100-80gb",
    "h100-80gb",
    "h200",
)
OTHER_MODELS = ("gpt2", "bert-large-uncased")
GPU_COUNTS = (1, 2, 4, 8)
SEQ_LENS = (512, 1024, 2048, 4096)
SAMPLES_PER_GPU = (4, 6, 8, 12, 16, 24, 32, 48, 64)
TOKENS = (2**18, 3 * 2**18, 2**19, 2**20, 2**21)

# where the ladder's techniques put the state: (sharding, offload); "none" is DDP on several
# GPUs. DeepSpeed offloads the optimizer under any ZeRO stage and parameters under ZeRO-3;
# FSDP2's CPUOffloadPolicy moves everything (it has no optimizer-only offload)
PLACEMENTS = (
    ("none", "none"),
    ("zero1", "none"),
    ("zero2", "none"),
    ("zero3", "none"),
    ("fsdp", "none"),
    ("zero1", "optimizer"),
    ("zero2", "optimizer"),
    ("zero3", "optimizer"),
    ("zero3", "optimizer+params"),
    ("fsdp", "optimizer+params"),
)
CKPT_EVERY = (0, 1, *PARTIAL_CKPT_EVERY)  # 0: none, 1: every layer
_DEEPSPEED = ("zero1", "zero2", "zero3")


@dataclass(frozen=True)
class Case:
    """One planning question: what ``batchfit plan`` is asked."""

    name: str
    model: str
    gpu: str
    num_gpus: int
    seq_len: int
    precision: str
    global_batch: int | None = None
    global_batch_tokens: int | None = None
    optimizer: str = "adamw"
    headroom_bytes: int = DEFAULT_HEADROOM_BYTES

    def setup(self) -> TrainingSetup:
        return TrainingSetup(
            precision=self.precision,  # type: ignore[arg-type]
            optimizer=self.optimizer,  # type: ignore[arg-type]
            num_gpus=self.num_gpus,
        )

    @property
    def target_label(self) -> str:
        if self.global_batch_tokens is not None:
            return f"{self.global_batch_tokens:,} tok"
        return f"{self.global_batch} smp"


DEBUG_CASES = (
    # tests/plan/test_checkpoint_offload_choice.py: the dial (1 GPU), the offload margin
    # (2 GPUs), and 8
    Case("debug-llama8b-1xh100", "llama-3.1-8b", "h100-80gb", 1, 2048, "auto",
         global_batch_tokens=1048576),
    Case("debug-llama8b-2xh100", "llama-3.1-8b", "h100-80gb", 2, 2048, "auto",
         global_batch_tokens=1048576),
    Case("debug-llama8b-8xh100", "llama-3.1-8b", "h100-80gb", 8, 2048, "auto",
         global_batch_tokens=1048576),
    Case("debug-mistral7b-v100-fp32", "mistral-7b", "v100-32gb", 1, 2048, "fp32",
         global_batch=16, optimizer="adam"),
    # tests/plan/test_plan_estimate_agree.py (headroom 100 MiB there)
    Case("debug-llama2-7b-t4", "llama-2-7b", "t4", 1, 512, "auto", global_batch=40,
         headroom_bytes=100 * 2**20),
    # tests/plan/test_plan_golden.py
    Case("debug-gpt2-t4", "gpt2", "t4", 1, 512, "auto", global_batch=32),
    Case("debug-llama8b-a100-40", "llama-3.1-8b", "a100-40gb", 1, 4096, "auto",
         global_batch_tokens=1048576),
    Case("debug-llama8b-8xa100-80", "llama-3.1-8b", "a100-80gb", 8, 4096, "auto",
         global_batch_tokens=4 * 1048576),
    Case("debug-gpt2-4xa100-40", "gpt2", "a100-40gb", 4, 1024, "auto", global_batch=64),
)  # fmt: skip


def model_pool() -> list[str]:
    """Catalog decoder LLMs of 0.4-14B parameters (dense), and a couple of others."""
    names = []
    for name in sorted(catalog_names()):
        m = resolve_model(name)
        dense = m.arch.num_experts <= 1
        if m.task == "causal-lm" and dense and 0.4e9 <= m.total_params <= 14e9:
            names.append(name)
    return [*names, *OTHER_MODELS]


def draw_cases(count: int = NUM_CASES, seed: int = SEED) -> list[Case]:
    """The evaluation cases, drawn in order from ``random.Random(seed)``."""
    rng = random.Random(seed)
    models = model_pool()
    cases = []
    for k in range(count):
        name = rng.choice(models)
        gpu = get_gpu(rng.choice(GPUS))
        n = rng.choice(GPU_COUNTS)
        limit = resolve_model(name).arch.max_positions
        seq = rng.choice([s for s in SEQ_LENS if limit is None or s <= limit])
        precision = "amp-bf16" if gpu.bf16 else rng.choice(("amp-fp16", "fp32"))
        if rng.random() < 0.5:
            batch: dict[str, Any] = {"global_batch_tokens": rng.choice(TOKENS)}
        else:
            batch = {"global_batch": n * rng.choice(SAMPLES_PER_GPU)}
        cases.append(Case(f"eval-{k + 1:02d}", name, gpu.name, n, seq, precision, **batch))
    return cases


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _key(setup: TrainingSetup) -> tuple[Any, ...]:
    """What makes two resolved setups the same plan, as far as techniques go."""
    s = setup
    sharding = "none" if s.sharding == "ddp" else s.sharding
    impl = "fused" if s.optimizer_impl == "fused" and sharding not in _DEEPSPEED else "default"
    every = (s.grad_ckpt_every or 1) if s.grad_ckpt else 0
    return (every, s.loss, impl, sharding, s.offload, s.precision, s.optimizer, s.method)


def label(setup: TrainingSetup) -> str:
    """The techniques of a resolved setup, short: ``ckpt/2 + fused-loss + zero3``."""
    every, loss, impl, sharding, offload = _key(setup)[:5]
    parts = []
    if every:
        parts.append("ckpt" if every == 1 else f"ckpt/{every}")
    if loss != "full":
        parts.append(f"{loss}-loss")
    if impl == "fused":
        parts.append("fused-adamw")
    if sharding != "none":
        parts.append(sharding)
    if offload != "none":
        parts.append(f"offload-{offload}")
    return " + ".join(parts) or "-"


def candidate_setups(model: ModelInfo, gpu: GpuSpec, base: TrainingSetup) -> list[TrainingSetup]:
    """Every exact combination of the ladder's techniques on ``base``, resolved, deduplicated."""
    lean = lean_loss(model, base)
    losses = [base.loss] + ([lean(base).loss] if lean is not None else [])
    adam = base.optimizer in ("adam", "adamw")
    out: dict[tuple[Any, ...], TrainingSetup] = {}
    layers = model.arch.num_layers
    for every in CKPT_EVERY:
        if every > 1 and layers // every < 1:
            continue
        for loss in losses:
            for sharding, offload in PLACEMENTS:
                impls = ["auto", "fused"] if adam and sharding not in _DEEPSPEED else ["auto"]
                for impl in impls:
                    s = replace(
                        base,
                        grad_ckpt=every > 0,
                        grad_ckpt_every=every if every > 1 else None,
                        loss=loss,  # type: ignore[arg-type]
                        optimizer_impl=impl,  # type: ignore[arg-type]
                        sharding=sharding,  # type: ignore[arg-type]
                        offload=offload,  # type: ignore[arg-type]
                    )
                    try:
                        r = resolve_setup(model, s, "cuda", gpu)
                    except UsageError:
                        continue
                    out.setdefault(_key(r), r)
    return list(out.values())


@dataclass(frozen=True)
class Option:
    """A setup at a micro-batch, timed: one row of a comparison."""

    micro_batch_size: int
    grad_accum_steps: int
    techniques: str
    step_seconds: float
    # ZeRO/FSDP on a single GPU without offload: shards nothing, and the ladder never offers it
    one_gpu_sharding: bool = False

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


Found = tuple[float, int, TrainingSetup]  # seconds per optimizer step, micro-batch, setup


def _nominal(setup: TrainingSetup) -> bool:
    return setup.num_gpus == 1 and setup.sharding not in ("none", "ddp") and setup.offload == "none"


def _option(found: Found, per_gpu: int) -> Option:
    seconds, micro, setup = found
    return Option(micro, per_gpu // micro, label(setup), seconds, _nominal(setup))


def _tried(plan: Any, model: ModelInfo, gpu: GpuSpec) -> set[tuple[Any, ...]]:
    """Setups the planner's rules saw: its alternatives (every rung of the ladder), its
    choice, and where the choice checkpoints, the dial's every-K settings on that rung
    (``_fewer_layers``)."""
    keys = set()
    for s in [a.setup for a in plan.alternatives]:
        try:
            keys.add(_key(resolve_setup(model, s, "cuda", gpu)))
        except UsageError:
            continue
    chosen = resolve_setup(model, plan.setup, "cuda", gpu)
    keys.add(_key(chosen))
    if chosen.grad_ckpt:
        for every in (None, *PARTIAL_CKPT_EVERY):
            keys.add(_key(replace(chosen, grad_ckpt_every=every)))
    return keys


def _fastest(found: list[Found], like: TrainingSetup) -> Found:
    """The fastest; among equal times the larger micro-batch, then the setup nearest ``like``
    (the loss kind costs no time: a tie is reported in the chosen plan's terms)."""
    near = _key(like)

    def order(f: Found) -> tuple[float, int, int]:
        differ = sum(a != b for a, b in zip(_key(f[2]), near, strict=True))
        return (f[0], -f[1], differ)

    best = min(found, key=order)
    ties = [f for f in found if f[0] <= best[0] * (1 + 1e-12)]
    return min(ties, key=lambda f: order((best[0], *f[1:])))


def _needs_code(model: ModelInfo, base: TrainingSetup, setup: TrainingSetup) -> bool:
    """Whether ``setup`` holds a technique the planner offers but never chooses: a lean loss
    or every K-th layer's checkpointing that the framework's config cannot switch on."""
    lean = lean_loss(model, base)
    if lean is not None and lean.needs and setup.loss == lean(base).loss != base.loss:
        return True
    return bool(setup.grad_ckpt_every) and not base.conventions.selects_ckpt_layers


def _policy_best(found: list[Found], like: TrainingSetup) -> Found | None:
    """The best by the planner's stated preferences: no ZeRO/FSDP on one GPU without offload
    (not in its vocabulary), and CPU offload only where it beats the best option without it by
    more than ``OFFLOAD_MARGIN`` (or nothing fits without it)."""
    usable = [f for f in found if not _nominal(f[2])]
    if not usable:
        return None
    plain = [f for f in usable if f[2].offload == "none"]
    off = [f for f in usable if f[2].offload != "none"]
    if not plain:
        return _fastest(off, like)
    best_plain = _fastest(plain, like)
    if off:
        best_off = _fastest(off, like)
        if best_off[0] * (1 + OFFLOAD_MARGIN) < best_plain[0]:
            return best_off
    return best_plain


def _selection_rule(
    case: Case, chosen: Found, tried_best: Found, per_gpu: int, plain_fits: bool
) -> str:
    """Why the planner left ``tried_best``, an option its own ladder holds, for ``chosen``."""
    c, t = chosen[2], tried_best[2]
    gap = chosen[0] / tried_best[0] - 1
    cited = f"{label(t)} at {tried_best[1]} x {per_gpu // tried_best[1]}, {tried_best[0]:.3g} s"
    if (
        _key(c)[3:5] == _key(t)[3:5]
        and t.grad_ckpt
        and c.grad_ckpt
        and _key(t)[1:3] == _key(c)[1:3]
    ):
        if per_gpu // tried_best[1] > max(64, per_gpu // chosen[1]):
            return (
                f"MAX_QUIET_ACCUM: a K whose micro-batch needs over 64 micro-steps wins only "
                f"when over {TIME_TOLERANCE:.0%} faster ({cited})"
            )
        if gap <= TIME_TOLERANCE + 1e-9:
            return (
                f"TIME_TOLERANCE in the checkpointing dial: within {TIME_TOLERANCE:.0%} the "
                f"larger micro-batch, then fewer checkpointed layers ({cited})"
            )
        return f"the checkpointing dial (_fewer_layers) stopped before {cited}"
    if (
        gap <= TIME_TOLERANCE + 1e-9
        and t.offload == "optimizer+params"
        and c.offload not in ("none", "optimizer+params")
    ):
        return (
            f"TIME_TOLERANCE: within {TIME_TOLERANCE:.0%} the tie-break keeps the parameters "
            f"on the GPU ({cited} offloads them)"
        )
    if not plain_fits or (c.offload != "none" and t.offload != "none"):
        return f"nothing fits without offload: the fastest offload rung was not {cited}"
    if t.offload != "none" and c.offload == "none":
        return (
            f"OFFLOAD_MARGIN: offload is predicted faster by under {OFFLOAD_MARGIN:.0%} ({cited})"
        )
    if gap <= TIME_TOLERANCE + 1e-9:
        return (
            f"TIME_TOLERANCE: within {TIME_TOLERANCE:.0%} the tie-break takes the parameters "
            f"on the GPU, the larger micro-batch, no recompute, fewer techniques, less traffic "
            f"({cited})"
        )
    return f"other ({cited})"


def _vocabulary(case: Case, best: TrainingSetup, chosen: TrainingSetup) -> str:
    """What makes ``best`` a combination the ladder never builds."""
    every, loss, impl, sharding, offload = _key(best)[:5]
    reasons = []
    if _nominal(best):
        reasons.append(f"{sharding} on one GPU without offload (the ladder shards on several)")
    if impl == "fused" and (every or loss != "full" or sharding != "none"):
        reasons.append("fused AdamW with other techniques (the ladder tries it alone)")
    if offload != "none" and not every:
        reasons.append(
            "offload without checkpointing (the ladder's rungs are cumulative: its offload "
            "rungs keep checkpointing on)"
        )
    elif not every and sharding != "none" and case.num_gpus == 1:
        reasons.append("sharding without checkpointing on one GPU")
    if every > 1 and _key(best)[3:5] != _key(chosen)[3:5]:
        rest = label(replace(best, grad_ckpt=False, grad_ckpt_every=None)) or "DDP"
        reasons.append(
            f"every-{every} checkpointing on {rest} "
            "(_fewer_layers varies K only on the rung chosen with full checkpointing)"
        )
    if (sharding, offload) in (("zero1", "optimizer"), ("zero3", "optimizer")):
        reasons.append(
            f"{sharding} + optimizer offload (the ladder offloads the optimizer under ZeRO-2)"
        )
    if every and loss == "full" and chosen.loss != "full":
        reasons.append("checkpointing without the lean loss (the ladder keeps it on)")
    return "; ".join(reasons) or "a combination not on the ladder"


def evaluate(case: Case) -> dict[str, Any]:
    """The planner's choice and the brute force's best for ``case``, with the gap."""
    model = resolve_model(case.model)
    gpu = get_gpu(case.gpu)
    setup = case.setup()
    plan = make_plan(
        model,
        gpu,
        setup,
        seq_len=case.seq_len,
        global_batch=case.global_batch,
        global_batch_tokens=case.global_batch_tokens,
        headroom_bytes=case.headroom_bytes,
        engine="analytic",
    )
    per_gpu = plan.global_batch_size // case.num_gpus
    target = _Target(model, gpu, case.seq_len, per_gpu, case.headroom_bytes, "analytic")
    # every fitting (setup, micro): the same fit rule and time model as the planner's
    found: list[Found] = []
    setups = candidate_setups(model, gpu, setup)
    for s in setups:
        for micro in divisors(per_gpu):
            if target.fits(s, micro)[0]:
                found.append((target.step_seconds(s, micro), micro, s))
    exact = all(t.kind == "exact" for t in plan.techniques) and plan.max_micro_batch > 0
    chosen_setup = resolve_setup(model, plan.setup, "cuda", gpu)
    micro = plan.micro_batch_size
    chosen: Found = (target.step_seconds(plan.setup, micro), micro, chosen_setup)
    row: dict[str, Any] = {
        "case": asdict(case),
        "per_gpu_batch": per_gpu,
        "chosen": _option(chosen, per_gpu).to_json(),
        "chosen_technique_names": [t.name for t in plan.techniques],
        "chosen_exact": exact,
        "plan_step_seconds": plan.step_seconds,
        "candidate_setups": len(setups),
        "fitting_candidates": len(found),
        "chosen_in_candidates": any(
            m == micro and _key(s) == _key(chosen_setup) for _, m, s in found
        ),
    }
    if not found:
        row.update(best=None, gap=None, differs=None, why="no exact candidate fits")
        return row
    best = _fastest(found, chosen_setup)
    tried = _tried(plan, model, gpu)
    in_ladder = [f for f in found if _key(f[2]) in tried]
    tried_best = _fastest(in_ladder, chosen_setup) if in_ladder else None
    # an option that needs code the framework's config cannot switch on (a lean loss or
    # every K-th layer's checkpointing under a loop that cannot select layers) is offered,
    # never chosen: the planner's policy, like offload's margin
    switchable = [f for f in found if not _needs_code(model, setup, f[2])]
    policy = _policy_best(switchable, chosen_setup)
    # the same policy over what the ladder holds: chosen -> this is the planner's selection,
    # this -> ``policy`` what the ladder never builds, ``policy`` -> ``best`` the policy itself
    ladder_policy = _policy_best([f for f in in_ladder if f in switchable], chosen_setup)
    ratio = (lambda f: chosen[0] / f[0] - 1) if exact else (lambda f: None)
    row.update(
        best=_option(best, per_gpu).to_json(),
        gap=ratio(best),
        differs=(best[1], _key(best[2])) != (micro, _key(chosen_setup)),
        best_in_ladder=_option(tried_best, per_gpu).to_json() if tried_best else None,
        gap_in_ladder=ratio(tried_best) if tried_best else None,
        best_by_policy=_option(policy, per_gpu).to_json() if policy else None,
        gap_by_policy=ratio(policy) if policy else None,
        best_in_ladder_by_policy=_option(ladder_policy, per_gpu).to_json()
        if ladder_policy
        else None,
    )
    # three factors: (1 + gap) = selection x never tried x policy
    steps = [chosen, ladder_policy, policy, best]
    parts = [
        None if not exact or x is None or y is None else x[0] / y[0] - 1 for x, y in pairwise(steps)
    ]
    row["gap_parts"] = dict(zip(("selection", "never_tried", "policy"), parts, strict=True))
    why = []
    if not exact:
        why.append("the plan changes training (the ladder found nothing exact that fits)")
    elif row["gap"] > MISS:
        plain_fits = any(f[2].offload == "none" and not _nominal(f[2]) for f in found)
        sel, voc, pol = parts
        if ladder_policy is not None and sel is not None and sel > SHOWN:
            rule = _selection_rule(case, chosen, ladder_policy, per_gpu, plain_fits)
            why.append(f"selection {_pct(sel)}: {rule}")
        if policy is not None and voc is not None and voc > SHOWN:
            why.append(f"never tried {_pct(voc)}: " + _vocabulary(case, policy[2], chosen_setup))
        if policy is not None and pol is not None and pol > SHOWN:
            kind = (
                "code the framework's config cannot switch on (offered, never chosen)"
                if _needs_code(model, setup, best[2])
                else "ZeRO/FSDP on one GPU without offload, outside the ladder's vocabulary"
                if _nominal(best[2])
                else f"offload, faster by under {OFFLOAD_MARGIN:.0%} than the best without it "
                "(OFFLOAD_MARGIN)"
            )
            why.append(f"policy {_pct(pol)}: {label(best[2])} is {kind}")
    row["why"] = " | ".join(why)
    return row


def _fmt_option(o: dict[str, Any] | None) -> str:
    if o is None:
        return "- | - | -"
    nominal = " (1 GPU)" if o["one_gpu_sharding"] else ""
    return (
        f"{o['micro_batch_size']} x {o['grad_accum_steps']} | {o['techniques']}{nominal} | "
        f"{o['step_seconds']:.3g}"
    )


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.1f}%"


def table(rows: list[dict[str, Any]]) -> str:
    """The markdown table of a list of evaluated cases."""
    head = (
        "| case | model | GPU | n | seq | target | prec | chosen: micro x accum | techniques "
        "| s/step | best: micro x accum | techniques | s/step | gap | gap by policy | differs |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        c = r["case"]
        gap, policy = _pct(r["gap"]), _pct(r.get("gap_by_policy"))
        if not r["chosen_exact"]:
            gap = policy = "n/a"
        differs = {None: "-", True: "yes", False: "no"}[r["differs"]]
        target = (
            f"{c['global_batch_tokens']:,} tok"
            if c["global_batch_tokens"] is not None
            else f"{c['global_batch']} smp"
        )
        prec = c["precision"] + ("/adam" if c["optimizer"] != "adamw" else "")
        lines.append(
            f"| {c['name']} | {c['model']} | {c['gpu']} | {c['num_gpus']} | {c['seq_len']} | "
            f"{target} | {prec} | {_fmt_option(r['chosen'])} | {_fmt_option(r['best'])} | "
            f"{gap} | {policy} | {differs} |"
        )
    return head + "\n".join(lines) + "\n"


def _stats(values: list[float]) -> dict[str, Any]:
    return {
        "median": statistics.median(values) if values else None,
        "worst": max(values) if values else None,
        "over_2pct": sum(1 for v in values if v > MISS),
    }


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Median and worst gap (against the brute force's best, the best the ladder itself
    holds, the best by the planner's stated policy), and the cases over ``MISS``."""
    compared = [r for r in rows if r["gap"] is not None]
    misses = [r for r in compared if r["gap"] > MISS]
    return {
        "cases": len(rows),
        "compared": len(compared),
        "differs": sum(1 for r in compared if r["differs"]),
        "gap": _stats([r["gap"] for r in compared]),
        "gap_selection": _stats(
            [
                r["gap_parts"]["selection"]
                for r in compared
                if r["gap_parts"]["selection"] is not None
            ]
        ),
        "gap_by_policy": _stats(
            [r["gap_by_policy"] for r in compared if r["gap_by_policy"] is not None]
        ),
        "misses": [{"case": r["case"]["name"], "gap": r["gap"], "why": r["why"]} for r in misses],
        "not_exact": [r["case"]["name"] for r in rows if not r["chosen_exact"]],
        "chosen_missing_from_candidates": [
            r["case"]["name"] for r in rows if r["chosen_exact"] and not r["chosen_in_candidates"]
        ],
    }


def _summary_text(title: str, s: dict[str, Any]) -> str:
    def line(name: str, st: dict[str, Any]) -> str:
        return (
            f"{name}: median {_pct(st['median'])}, worst {_pct(st['worst'])}, "
            f"over {MISS:.0%}: {st['over_2pct']}"
        )

    policy = (
        f"gap to the best by the planner's policy (offload only when over {OFFLOAD_MARGIN:.0%} "
        "faster; no ZeRO/FSDP on one GPU without offload)"
    )
    lines = [
        f"**{title}**: {s['compared']} of {s['cases']} compared (exact plans); the choice "
        f"differs from the brute force's best in {s['differs']}.",
        "",
        f"- {line('gap to the brute-force best', s['gap'])}",
        "- "
        + line("selection alone (vs the best the ladder holds, same policy)", s["gap_selection"]),
        "- " + line(policy, s["gap_by_policy"]),
        "",
    ]
    for m in s["misses"]:
        lines.append(f"- {m['case']} ({_pct(m['gap'])}): {m['why']}")
    if s["not_exact"]:
        lines.append(f"- changes training (not compared): {', '.join(s['not_exact'])}")
    if s["chosen_missing_from_candidates"]:
        lines.append(
            f"- chosen plan not among the brute force's candidates: "
            f"{', '.join(s['chosen_missing_from_candidates'])}"
        )
    return "\n".join(lines) + "\n"


HELD_OUT = (
    "none: the 30 evaluation cases were drawn by `random.Random(20261128)` before any result was "
    "seen, but the planner was changed after the first run over them; the 9 debug cases are "
    "those it was developed on."
)


def doc_section(data: dict[str, Any]) -> str:
    """The page's tables for a saved run (``data/plan_choice.json``), without evaluating again."""
    return "\n".join(
        [
            f"#### Evaluation cases (random.Random({data['seed']}))\n",
            table(data["evaluation"]["cases"]),
            _summary_text("Evaluation", data["evaluation"]["summary"]),
            "#### Debug cases (the planner was developed on these)\n",
            table(data["debug"]["cases"]),
            _summary_text("Debug", data["debug"]["summary"]).rstrip("\n"),
        ]
    )


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(data, indent=1, allow_nan=False) + "\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def run(cases: list[Case]) -> list[dict[str, Any]]:
    rows = []
    for k, case in enumerate(cases, 1):
        row = evaluate(case)
        gap = "-" if row["gap"] is None else f"{100 * row['gap']:+.1f}%"
        print(
            f"[{k}/{len(cases)}] {case.name} {case.model} {case.num_gpus}x{case.gpu} "
            f"seq {case.seq_len}: gap {gap} ({row['fitting_candidates']} fitting)",
            file=sys.stderr,
        )
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--no-write", action="store_true", help="do not write the JSON file")
    parser.add_argument("--cases", type=int, default=NUM_CASES, help="evaluation cases to draw")
    args = parser.parse_args()
    evaluation = run(draw_cases(args.cases))
    debug = run(list(DEBUG_CASES))
    ev, db = summary(evaluation), summary(debug)
    print("### Evaluation cases (random.Random(20261128))\n")
    print(table(evaluation))
    print(_summary_text("Evaluation", ev))
    print("### Debug cases (the planner was developed on these)\n")
    print(table(debug))
    print(_summary_text("Debug", db))
    if not args.no_write:
        _write_json(
            DATA,
            {
                "seed": SEED,
                "miss_threshold": MISS,
                "engine": "analytic",
                "evaluation": {"summary": ev, "cases": evaluation},
                "debug": {"summary": db, "cases": debug},
            },
        )


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
