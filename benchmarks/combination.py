"""Combination misses: a seeded grid over framework x loop x precision x method (full / LoRA /
QLoRA) x loss x checkpointing x task against real CPU steps.

The generalisation grid draws architectures, optimizers, precisions and LoRA; this grid draws
what it holds fixed: the framework's conventions (``--framework``), the loop, QLoRA, the loss
and the task, over the same scaled-down architectures. Its ``SEED`` (20261130, in
``_combination_grid.py``) was fixed before any result was looked at and is never changed; the
grid is pinned in ``data/combination_cases.json``, and a second stream from the seed marks
half the cases as evaluation cases (held out: run and reported, never debugged on) and half
as debug cases.

Truth: a real CPU step in a fresh process per case (``_truth.py``), QLoRA through bitsandbytes
itself (``_bnb_truth.py``; ``pip install bitsandbytes`` first: 0.50.2 runs on the CPU),
cached in ``data/combination_truth.json`` under a hash of the case. Estimates: the trace and
analytic engines (``device="cpu"``).

    python benchmarks/combination.py [--only SUBSTR] [--no-write] [--fresh] [--truth-only]
                                     [--list] [--cached-only] [--split debug|evaluation]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import generalisation  # noqa: E402
from _combination_grid import (  # noqa: E402
    CASES_FILE,
    MAX_SCREEN_BYTES,
    MAX_STEP_SECONDS,
    MIN_SCREEN_BYTES,
    N_CASES,
    SEED,
    evaluation_names,
    grid,
)
from _generalisation_grid import DATA  # noqa: E402
from _report import write_section  # noqa: E402
from accuracy import Case  # noqa: E402
from generalisation import Row, build_rows, measure, truth_key  # noqa: E402

TRUTH_FILE = DATA / "combination_truth.json"
LIMIT = 0.02  # the trace's target
# bump when _bnb_truth.py's loading changes: cached QLoRA truths are then stale (2: the
# checkpoint's memory map dropped after loading)
QLORA_TRUTH_METHOD = 2
MIB = 2**20

# Each case beyond LIMIT, with its cause as diagnosed (the code path read, not guessed).
CAUSES: dict[str, str] = {
    "c18 t5 seq2seq": (
        "the trace failed until the case was seen (RuntimeError: result type torch.float32 "
        "can't be cast to the desired output type torch.uint8): transformers' bitsandbytes "
        "quantizer leaves a model's `_keep_in_fp32_modules` unquantised "
        "(quantizers/quantizer_bnb_4bit.py:121-122; T5's is `wo`, modeling_t5.py:542) and "
        "batchfit's emulation quantised `wo` too, whose forward casts its input to the "
        "weight's dtype (modeling_t5.py:88-93). Fixed after it was seen (`quantize_linears` "
        "skips them; tests/memory/test_qlora.py), so this case is no longer held out. The "
        "-6.9% left is not diagnosed (one difference not yet checked: the truth loads `wo` "
        "in fp32, the emulation builds it 16-bit and the recipe's cast makes it fp32)"
    ),
    "c19 t5 seq2seq": (
        "memory outside tensor storages. The trace's moment and the real peak agree (the "
        "decoder's embedding backward, where the tied embedding's second vocabulary-sized "
        "gradient meets the first), and so do the tensors: after the second step the live "
        "tensor storages of the real process add up to 141.5 MiB, the trace's weights and "
        "AdamW state to the byte, while its RSS is 155.0 MiB. The 7-14 MiB rest appears "
        "during the full model's first backward (the 1-layer warm-up does not load it) and "
        "stays: process memory of the pure-bf16 CPU kernels, not a tensor the dry run "
        "misses; at 0.24 GiB it is 3%"
    ),
}


# Each case batchfit could not estimate, with its cause (the error and the code path).
NO_ESTIMATE: dict[str, str] = {}


def key_of(case: Case) -> str:
    """``truth_key``, with bitsandbytes' version for a QLoRA case (its layers are the truth)."""
    key = truth_key(case)
    if case.setup.get("method") == "qlora":
        from importlib.metadata import PackageNotFoundError, version

        try:
            key += f"-bnb{version('bitsandbytes')}-{QLORA_TRUTH_METHOD}"
        except PackageNotFoundError:
            key += "-bnb-missing"
    return key


def _split_label(name: str) -> tuple[str, str]:
    """``cNN arch task`` and the rest of a case's name (its setup)."""
    parts = name.split(" ")
    return " ".join(parts[:3]), " ".join(parts[3:])


def _table(rows: list[Row]) -> list[str]:
    lines = [
        "| case | setup | micro x seq | real MiB | trace MiB | trace error | analytic error |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        case, setup = _split_label(r.case.name)
        lines.append(
            f"| {case} | {setup} | {r.case.micro} x {r.case.seq} | {r.truth / MIB:.1f} "
            f"| {r.pred['trace'] / MIB:.1f} | {r.err('trace'):+.1%} | {r.err('analytic'):+.1%} |"
        )
    return lines


def _summary(rows: list[Row], title: str) -> list[str]:
    if not rows:
        return [f"**{title}**: no cases measured"]
    out = []
    for name in ("trace", "analytic"):
        errs = [abs(r.err(name)) for r in rows]
        worst = max(rows, key=lambda r: abs(r.err(name)))
        out.append(
            f"{name}: median {statistics.median(errs):.1%}, worst {abs(worst.err(name)):.1%} "
            f"({_split_label(worst.case.name)[0]}), signed mean "
            f"{statistics.fmean(r.err(name) for r in rows):+.1%}"
        )
    return [f"**{title}** ({len(rows)} cases): " + "; ".join(out) + "."]


def _misses(rows: list[Row]) -> list[str]:
    over = [r for r in rows if abs(r.err("trace")) > LIMIT]
    if not over:
        return [f"No case beyond {LIMIT:.0%} (trace)."]
    out = [f"Cases beyond {LIMIT:.0%} (trace), with their causes:", ""]
    for r in over:
        cause = CAUSES.get(_split_label(r.case.name)[0], "not diagnosed yet")
        out.append(f"- {r.case.name} ({r.err('trace'):+.1%}): {cause}")
    return out


def render(
    evaluation: list[Row], debug: list[Row], meta: str, failed: list[tuple[str, float | None]]
) -> str:
    lines = [
        "## Combinations: a seeded grid of framework, loop, method, loss and task",
        "",
        f"{N_CASES} cases drawn by `benchmarks/combination.py` from `random.Random({SEED})` "
        "(the seed fixed before any result was seen; the grid pinned in "
        f"`benchmarks/{CASES_FILE.relative_to(HERE)}`) over the generalisation grid's "
        "architectures: the task the architecture allows (causal-lm, classification, "
        "masked-lm, seq2seq), the framework's conventions (`--framework` hf-trainer, "
        "accelerate, lightning, litgpt, torchtune, or none), the method (full, LoRA, QLoRA; "
        "LoRA rank and targets drawn), the precision (fp32, amp-bf16, bf16; QLoRA 16-bit), the "
        "loss of a language-model task (the framework's, or full, chunked:8 or chunked:128t), "
        "the loop (the framework's, or trainer or keep-outputs), checkpointing, micro-batch "
        f"and sequence; AdamW throughout. Draws over {MAX_SCREEN_BYTES / 2**30:.0f} GiB "
        f"(analytic), under {MIN_SCREEN_BYTES / 2**20:.0f} MiB, or over {MAX_STEP_SECONDS:.0f} s "
        "of predicted CPU time (a 1-layer warm-up and two steps; 16-bit matmuls run at 0.4 "
        "GFLOP/s on this AVX2 CPU, so most 16-bit cases are at 1 x 64-110) redrawn. A second "
        "`random.Random(SEED)` marked 12 cases as evaluation cases before "
        "any was run: they are reported, never debugged on. Truth: a real CPU step in a fresh "
        "process running the case's loop (`_truth.py`, two optimizer steps, peak RSS as in the "
        "accuracy section); the framework's conventions (its loop, loss, adapter and frozen "
        "dtypes, optimizer implementation, fp32 outputs) as batchfit's step builder applies "
        "them, not the framework's own trainer; QLoRA loaded with bitsandbytes itself "
        "(`_bnb_truth.py`: bitsandbytes 0.50.2's CPU backend, transformers' 4-bit quantizer, "
        "peft's kbit preparation where the recipe runs it; the checkpoint's memory map dropped "
        "and the peak mark reset once loaded), not batchfit's emulation of it. Left out: "
        "`--loss fused` (Liger's Triton kernel runs on CUDA only), QLoRA under litgpt "
        "(Fabric's bitsandbytes plugin on litgpt's own model classes) and torchtune "
        "(torchao's NF4 tensors). Errors are "
        f"estimate / truth - 1. {meta}",
        "",
        "**Evaluation cases** (held out):",
        "",
        *_table(evaluation),
        "",
        "**Debug cases**:",
        "",
        *_table(debug),
        "",
        *_summary(evaluation, "Evaluation"),
        "",
        *_summary(debug, "Debug"),
        "",
        *_misses(evaluation + debug),
    ]
    if failed:
        lines += ["", "Cases without an estimate:", ""]
        for name, truth in failed:
            cause = NO_ESTIMATE.get(_split_label(name)[0], "not diagnosed yet")
            real = "no truth" if truth is None else f"real {truth / MIB:.1f} MiB"
            lines.append(f"- {name} ({real}): {cause}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=None, help="substring of a case name")
    parser.add_argument("--split", choices=("debug", "evaluation"), default=None)
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--fresh", action="store_true", help="re-measure cached truths")
    parser.add_argument("--truth-only", action="store_true", help="measure truths, no estimates")
    parser.add_argument("--list", action="store_true", help="print the cases, run nothing")
    parser.add_argument(
        "--cached-only", action="store_true", help="estimate the cases with a cached truth only"
    )
    args = parser.parse_args()
    everything = grid()
    held = evaluation_names(everything)
    cases = [c for c in everything if not args.only or args.only in c.name]
    if args.split:
        cases = [c for c in cases if (c.name in held) == (args.split == "evaluation")]
    if args.list:
        for c in cases:
            split = "evaluation" if c.name in held else "debug"
            print(f"{split:10s} {c.name:100s} {c.micro:3d} x {c.seq:4d}")
        return 0
    start = time.perf_counter()
    truths = measure(cases, {}, args.fresh, args.cached_only, TRUTH_FILE, key_of)
    print(f"truths: {time.perf_counter() - start:.0f} s", flush=True)
    if args.truth_only:
        return 0
    start = time.perf_counter()
    medians = {n: statistics.median(e["bytes"]) for n, e in truths.items()}
    rows = build_rows(cases, medians, {}, with_stats=False)
    estimated = {r.case.name for r in rows}
    failed = [(c.name, medians.get(c.name)) for c in cases if c.name not in estimated]
    truth_seconds = sum(e["seconds"] for e in truths.values())
    meta = generalisation._meta(truth_seconds, time.perf_counter() - start)
    evaluation = [r for r in rows if r.case.name in held]
    debug = [r for r in rows if r.case.name not in held]
    body = render(evaluation, debug, meta, failed)
    print(body)
    if not args.no_write and not args.only and not args.split:
        write_section(
            "combination",
            body,
            held_out=(
                f"the {len(held)} evaluation cases, drawn by `random.Random({SEED})` with the "
                "grid before any result was seen; the code was debugged on the other 12 only."
            ),
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
