"""A step of one micro-step read from a step of two: the cut history vs the dry run itself.

Where a plan's micro-batch is the whole per-GPU batch, the step has one micro-step
(accumulation 1), while the search traced its sizes with two (later micro-steps hold the
gradients: every count from 2 up is alike). ``batchfit.memory.trace.sized.one_micro_step``
reads the step of one from the histories of the step of two at that size (traced, or read
between two traced sizes): the later micro-step's forward and backward left out. This checks
it on cases drawn at random (``SEED``, fixed before any case was run) from the same models,
methods, checkpointing, optimizers, GPUs and sequence lengths as the interpolation benchmark:
sizes 2 and a drawn one traced with two micro-steps, a drawn target read with one, then the
target traced with one; every moment's components, the peak and the allocator's reserve
compared. Fake tensors on the CPU, CUDA emulated.

    python benchmarks/one_micro_step.py [--cases N] [--no-write]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _report import write_section  # noqa: E402
from interpolation import (  # noqa: E402
    GPUS,
    MODELS,
    SEQS,
    Case,
    _add,
    case_row,
    drawn_case,
    model_and_method,
)

SEED = 20261202
SIBLING_SEED = 20261203  # the optimizer siblings' own draw
VARIANTS = [("adamw", "fused"), ("adamw-8bit", "auto"), ("sgd", "auto"), ("adafactor", "auto")]


def draw(n: int) -> list[Case]:
    """``n`` cases from ``SEED`` (large models only with LoRA or QLoRA, as the interpolation
    benchmark draws them)."""
    rng = random.Random(SEED)
    cases = []
    while len(cases) < n:
        model, method = model_and_method(rng)
        case = drawn_case(rng, model, method, (2, rng.randint(3, 40)), 0)
        cases.append(replace(case, target=rng.randint(2, 128)))
    return cases


def _timed(model: Any, setup: Any, case: Case, micro: int, accum: int, histories: bool) -> Any:
    """The dry run of ``setup`` at ``micro`` (traced, or read where ``histories`` allows),
    and its seconds."""
    from batchfit.hardware import get_gpu
    from batchfit.memory.trace import estimate, sized
    from batchfit.workload import Workload

    work = Workload(micro, case.seq, "cuda", get_gpu(case.gpu), grad_accum_steps=accum)
    token = sized.enabled.set(histories)
    start = time.perf_counter()
    try:
        result, _ = estimate.traced_result(model, setup, work, full_depth=False)
    finally:
        sized.enabled.reset(token)
    return result, time.perf_counter() - start


def _compare(
    case: Case,
    optimizers: tuple[tuple[str, str], ...],
    traced: tuple[tuple[int, int], ...],
    accums: tuple[int, int],
) -> dict[str, Any]:
    """Trace the case's setup with each of ``optimizers`` (name, implementation) at the
    ``traced`` (setup index, size) pairs with ``accums[0]`` micro-steps, histories kept; then
    read the last setup at the target with ``accums[1]`` and trace it: the two compared."""
    from batchfit import _cache
    from batchfit.hardware import get_gpu
    from batchfit.memory.formulas.analytic import resolve_setup
    from batchfit.memory.trace import sized
    from batchfit.models import resolve_model
    from batchfit.spec import TrainingSetup

    model, gpu = resolve_model(case.model), get_gpu(case.gpu)
    if case.seq > (model.arch.max_positions or case.seq):
        return {"skipped": f"{case.seq} tokens: the model has {model.arch.max_positions} positions"}
    setups = [
        TrainingSetup(
            method=case.method,  # type: ignore[arg-type]
            grad_ckpt=case.grad_ckpt,
            optimizer=name,  # type: ignore[arg-type]
            optimizer_impl=impl,  # type: ignore[arg-type]
        )
        for name, impl in optimizers
    ]
    try:
        resolved = [resolve_setup(model, setup, "cuda", gpu) for setup in setups]
    except Exception as e:  # a setup this GPU cannot run (QLoRA without bf16 where required)
        return {"skipped": f"{type(e).__name__}: {e}"}
    sized.forget()
    with _cache.disabled():
        for index, size in traced:
            _timed(model, resolved[index], case, size, accums[0], True)
        guess, guess_s = _timed(model, resolved[-1], case, case.target, accums[1], True)
        truth, truth_s = _timed(model, resolved[-1], case, case.target, accums[1], False)
    return {
        "interpolated": guess.seconds == 0.0,
        "moments_equal": guess.phases == truth.phases,
        "peak": (guess.peak.total, truth.peak.total),
        "reserved": (guess.reserved_bytes, truth.reserved_bytes),
        "seconds": (guess_s, truth_s),
    }


def run(case: Case) -> dict[str, Any]:
    """Sizes 2 and the drawn one traced with two micro-steps, the target read with one."""
    traced = tuple((0, size) for size in case.bases)
    return _compare(case, ((case.optimizer, "auto"),), traced, (2, 1))


def run_sibling(case: Case) -> dict[str, Any]:
    """AdamW traced at the two sizes, the case's optimizer at size 2, then read at the
    target (two micro-steps throughout)."""
    optimizer = case.optimizer.removesuffix("-fused")
    impl = "fused" if case.optimizer.endswith("-fused") else "auto"
    traced = ((0, case.bases[0]), (0, case.bases[1]), (1, 2))
    return _compare(case, (("adamw", "auto"), (optimizer, impl)), traced, (2, 2))


def draw_siblings(n: int) -> list[Case]:
    """``n`` cases from ``SIBLING_SEED``: a setup (AdamW) traced at sizes 2 and a drawn one,
    its sibling with another optimizer (``Case.optimizer``, fused AdamW as "adamw-fused")
    traced at size 2 and read at a drawn target."""
    rng = random.Random(SIBLING_SEED)
    cases = []
    while len(cases) < n:
        model = rng.choice(MODELS)
        big = model in ("mistral-7b", "llama-3.1-8b")
        optimizer, impl = rng.choice(VARIANTS)
        cases.append(
            Case(
                model=model,
                gpu=rng.choice(GPUS),
                method=rng.choice(["lora", "qlora"] if big else ["full", "full", "lora", "qlora"]),
                grad_ckpt=rng.random() < 0.5,
                optimizer=f"{optimizer}-fused" if impl == "fused" else optimizer,
                seq=224 if model.startswith("vit") else rng.choice(SEQS),
                bases=(2, rng.randint(3, 40)),
                target=rng.randint(3, 128),
            )
        )
    return cases


def _table(
    tag: str, cases: list[Case], run_one: Any, traced: str, size: str
) -> tuple[list[str], list[int]]:
    rows = [
        f"| case | {traced} | {size} | from histories | moments "
        "| peak MiB (histories / traced) | reserved MiB (histories / traced) "
        "| s histories / traced |",
        "|---|---|---:|---|---|---:|---:|---:|",
    ]
    count = [0, 0, 0]  # cases, answered without a dry run, equal
    for i, case in enumerate(cases, 1):
        r = run_one(case)
        print(case.label(), r, flush=True)
        row, answered, same = case_row(f"{tag}{i:02d}", case, r)
        rows.append(row)
        if answered is not None:
            count = _add(count, answered, same)
    return rows, count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=16)
    ap.add_argument("--siblings", type=int, default=16, help="optimizer-sibling cases")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("BATCHFIT_NO_CACHE", "1")
    one, (n, a, e) = _table(
        "o", draw(args.cases), run, "sizes traced (two micro-steps)", "size (one)"
    )
    siblings, (sn, sa, se) = _table(
        "s", draw_siblings(args.siblings), run_sibling, "AdamW sizes traced", "size"
    )
    text = "\n".join(
        [
            *one,
            "",
            f"One micro-step: {a} of {n} cases answered from the histories of two (the others "
            f"were traced); of those, equal to the dry run in every moment, peak and reserve: "
            f"{e} of {a}.",
            "",
            f"Optimizer siblings (`random.Random({SIBLING_SEED})`): the setup with AdamW traced "
            "at the two sizes shown, the setup with the case's optimizer traced at size 2 only, "
            "its target read from that size moved along AdamW's line, then traced.",
            "",
            *siblings,
            "",
            f"Optimizer siblings: {sa} of {sn} cases answered from the histories; of those, "
            f"equal to the dry run: {se} of {sa}.",
        ]
    )
    print(text)
    if not args.no_write:
        held = (
            f"every case (`random.Random({SEED})`, the siblings `random.Random({SIBLING_SEED})`, "
            "each drawn before any was run); the code was debugged on a 4-layer GPT-2 of 64 "
            "features, vit-base, bert-base classification and gpt2 with checkpointing, none "
            "of them at the drawn sizes."
        )
        write_section("one_micro_step", text, held_out=held)


if __name__ == "__main__":
    main()
