"""Sizes from histories: a dry run interpolated from two traced sizes vs the dry run itself.

`batchfit gpus` sizes each GPU's row from the allocation histories of two traced micro-batch
sizes of the row's setup (``batchfit.memory.trace.sized``), where they line up event for
event, instead of a dry run at the row's size. This checks that claim on cases drawn at random
(``SEED``, fixed before any case was run): catalog models, methods, checkpointing, optimizers,
GPUs (and so precisions and cuBLAS workspaces), sequence lengths and three sizes per case (two
bases, as `gpus` traces 2 and the first row's size, and a target), then, from a seed of their
own, language models with torchtune's chunked loss (a fixed count of chunks or of tokens per
chunk, under a loop that keeps every chunk's logits or not): histories are read only where
the chunks are equal at every size. Each case: the dry runs at
both bases, the target interpolated, then the target traced; every moment's components, the
peak and the allocator's reserve compared. Fake tensors on the CPU, CUDA emulated.

    python benchmarks/interpolation.py [--cases N] [--chunked N] [--no-write]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _report import write_section  # noqa: E402

SEED = 20261129
CHUNKED_SEED = 20261130  # the chunked-loss cases' own draw
FUSED_SEED = 20261201  # the fused-loss cases' own draw
MIB = 2**20
MODELS = [
    "gpt2",
    "gpt2-medium",
    "bert-base-uncased",
    "roberta-base",
    "qwen2.5-0.5b",
    "llama-3.2-1b",
    "smollm2-360m",
    "vit-base-patch16-224",
    "t5-small",
    "mistral-7b",
    "llama-3.1-8b",
    "gemma-2-2b",
]
GPUS = ["t4", "v100-16gb", "a10g", "l4", "a100-40gb", "a100-80gb", "rtx-4090", "h100-80gb"]
OPTIMIZERS = ["adamw", "adamw-8bit", "sgd", "adafactor"]
SEQS = [128, 256, 512, 1024]
SMALL_LMS = ["gpt2", "gpt2-medium", "qwen2.5-0.5b", "llama-3.2-1b", "smollm2-360m", "gemma-2-2b"]


@dataclass(frozen=True)
class Case:
    model: str
    gpu: str
    method: str
    grad_ckpt: bool
    optimizer: str
    seq: int
    bases: tuple[int, int]
    target: int
    loop: str = "trainer"
    chunk_tokens: int | None = None  # chunked loss: tokens per chunk (None: 8 chunks)
    loss: str = "full"

    @property
    def chunked(self) -> bool:
        return self.loss != "full"

    def label(self) -> str:
        ckpt = ", ckpt" if self.grad_ckpt else ""
        loss = ""
        if self.loss == "chunked":
            cut = f"{self.chunk_tokens} tokens" if self.chunk_tokens else "8"
            loss = f", chunked loss ({cut} per chunk, {self.loop})"
        elif self.loss == "fused":
            loss = ", fused loss"
        return (
            f"{self.model} {self.method}{ckpt} {self.optimizer}{loss} on {self.gpu}, seq {self.seq}"
        )


def draw(n: int) -> list[Case]:
    """``n`` cases from ``SEED``; large models only with LoRA or QLoRA (a full fine-tune of
    7-8B fits no catalog GPU at any size, and a row that fits nothing sizes nothing)."""
    rng = random.Random(SEED)
    cases = []
    while len(cases) < n:
        model, method = model_and_method(rng)
        first = rng.randint(3, 40)
        target = rng.choice([m for m in range(3, 129) if m != first])
        cases.append(drawn_case(rng, model, method, (2, first), target))
    return cases


def model_and_method(rng: random.Random) -> tuple[str, str]:
    """A model and a method drawn from ``rng``: LoRA or QLoRA for the 7-8B ones."""
    model = rng.choice(MODELS)
    big = model in ("mistral-7b", "llama-3.1-8b")
    return model, rng.choice(["lora", "qlora"] if big else ["full", "full", "lora", "qlora"])


def drawn_case(
    rng: random.Random, model: str, method: str, bases: tuple[int, int], target: int
) -> Case:
    """A case of ``model``: its GPU, checkpointing, optimizer and sequence drawn from ``rng``
    in that order."""
    return Case(
        model=model,
        gpu=rng.choice(GPUS),
        method=method,
        grad_ckpt=rng.random() < 0.5,
        optimizer=rng.choice(OPTIMIZERS),
        seq=224 if model.startswith("vit") else rng.choice(SEQS),
        bases=bases,
        target=target,
    )


def draw_chunked(n: int) -> list[Case]:
    """``n`` cases of language models up to 2B with the chunked loss, from ``CHUNKED_SEED``;
    among them sequences 8 chunks do not divide (those must be traced)."""
    rng = random.Random(CHUNKED_SEED)
    cases = []
    for _ in range(n):
        first = rng.randint(3, 40)
        cases.append(
            Case(
                model=rng.choice(SMALL_LMS),
                gpu=rng.choice(GPUS),
                method=rng.choice(["full", "lora"]),
                grad_ckpt=rng.random() < 0.5,
                optimizer=rng.choice(OPTIMIZERS),
                seq=rng.choice([*SEQS, 300, 500]),
                bases=(2, first),
                target=rng.choice([m for m in range(3, 65) if m != first]),
                loop=rng.choice(["trainer", "keep-outputs"]),
                chunk_tokens=rng.choice([None, None, 128]),
                loss="chunked",
            )
        )
    return cases


def draw_fused(n: int) -> list[Case]:
    """``n`` cases of language models with Liger's fused loss, from ``FUSED_SEED``: a target
    size, then two bases among the sizes up to 64 whose tokens make chunks of the target's
    row count (where two exist; else any two), as a search brackets its answer."""
    from batchfit.memory.trace import sized
    from batchfit.models import resolve_model
    from batchfit.spec import TrainingSetup

    rng = random.Random(FUSED_SEED)
    cases = []
    for _ in range(n):
        model, seq = rng.choice(SMALL_LMS), rng.choice(SEQS)
        target, info = rng.randint(3, 64), resolve_model(model)

        def line(m: int, info: Any = info, s: int = seq) -> str | None:
            return sized.line_of(info, TrainingSetup(loss="fused"), s, m)

        alike = [m for m in range(2, 65) if m != target and line(m) == line(target) is not None]
        pool = alike if len(alike) >= 2 else [m for m in range(2, 65) if m != target]
        low, high = sorted(rng.sample(pool, 2))
        cases.append(
            Case(
                model=model,
                gpu=rng.choice(GPUS),
                method=rng.choice(["full", "lora"]),
                grad_ckpt=rng.random() < 0.5,
                optimizer=rng.choice(OPTIMIZERS),
                seq=seq,
                bases=(low, high),
                target=target,
                loss="fused",
            )
        )
    return cases


def run(case: Case) -> dict[str, Any]:
    from batchfit import _cache
    from batchfit.hardware import get_gpu
    from batchfit.memory.device.totals import gpu_extras
    from batchfit.memory.formulas.analytic import resolve_setup
    from batchfit.memory.trace import estimate, sized
    from batchfit.models import resolve_model
    from batchfit.spec import TrainingSetup
    from batchfit.workload import Workload

    model, gpu = resolve_model(case.model), get_gpu(case.gpu)
    setup = TrainingSetup(method=case.method, grad_ckpt=case.grad_ckpt, optimizer=case.optimizer)
    if case.chunked:
        setup = replace(setup, loss=case.loss, loop=case.loop, loss_chunk_tokens=case.chunk_tokens)
    try:
        resolved = resolve_setup(model, setup, "cuda", gpu)
    except Exception as e:  # a setup this GPU cannot run (QLoRA without bf16 where required)
        return {"skipped": f"{type(e).__name__}: {e}"}

    def at(micro: int, on: Any = gpu) -> tuple[Any, float]:
        work = Workload(micro, case.seq, "cuda", on, grad_accum_steps=1)
        start = time.perf_counter()
        result, _ = estimate.traced_result(model, resolved, work, full_depth=False)
        return result, time.perf_counter() - start

    def guessed(micro: int, on: Any = gpu) -> tuple[Any, float]:
        token = sized.enabled.set(True)
        try:
            return at(micro, on)
        finally:
            sized.enabled.reset(token)

    def compared(guess: Any, truth: Any, seconds: tuple[float, float]) -> dict[str, Any]:
        return {
            "interpolated": guess.seconds == 0.0,
            "moments_equal": guess.phases == truth.phases,
            "peak": (guess.peak.total, truth.peak.total),
            "reserved": (guess.reserved_bytes, truth.reserved_bytes),
            "seconds": seconds,
        }

    lines = {sized.line_of(model, resolved, case.seq, m) for m in (*case.bases, case.target)}
    readable = len(lines) == 1 and None not in lines
    sized.forget()
    with _cache.disabled():
        for base in case.bases:  # traced (two sizes), their histories kept
            guessed(base)
        guess, guess_s = guessed(case.target)
        truth, truth_s = at(case.target)
        out = {**compared(guess, truth, (guess_s, truth_s)), "readable": readable}
        # the same sizes on a GPU of the other cuBLAS workspace that runs the same kernels
        space = gpu_extras(gpu, resolved).workspace
        other = get_gpu(
            "h100-80gb"
            if space != gpu_extras(get_gpu("h100-80gb"), resolved).workspace
            else "a100-80gb"
        )
        # (the chunked-loss cases check sizes only)
        if not case.chunked and resolve_setup(model, setup, "cuda", other) == resolved:
            guess, guess_s = guessed(case.target, other)
            truth, truth_s = at(case.target, other)
            out["workspace"] = {"gpu": other.name, **compared(guess, truth, (guess_s, truth_s))}
    return out


def _row(label: str, r: dict[str, Any]) -> tuple[str, bool, bool]:
    """A table row, whether the size was answered without a dry run, and whether equal."""
    (gp, tp), (gr, tr), (gs, ts) = r["peak"], r["reserved"], r["seconds"]
    same = bool(r["moments_equal"]) and gp == tp and gr == tr
    row = (
        f"| {label} | {'yes' if r['interpolated'] else 'no: traced'} | "
        f"{'equal' if r['moments_equal'] else 'DIFFER'} | {gp / MIB:,.1f} / {tp / MIB:,.1f} | "
        f"{gr / MIB:,.1f} / {tr / MIB:,.1f} | {gs:.2f} / {ts:.2f} |"
    )
    return row, bool(r["interpolated"]), same


def case_row(tag: str, case: Case, r: dict[str, Any]) -> tuple[str, bool | None, bool]:
    """``_row`` for a drawn case (its sizes named), or a skipped one's row (answered None)."""
    if "skipped" in r:
        return f"| {tag} {case.label()} | - | - | skipped: {r['skipped']} |||||", None, False
    sizes = f"{case.bases[0]}, {case.bases[1]} | {case.target}"
    return _row(f"{tag} {case.label()} | {sizes}", r)


def _add(counts: list[int], answered: bool, same: bool) -> list[int]:
    return [counts[0] + 1, counts[1] + answered, counts[2] + (answered and same)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=24)
    ap.add_argument("--chunked", type=int, default=10, help="chunked-loss cases")
    ap.add_argument("--fused", type=int, default=10, help="fused-loss cases")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("BATCHFIT_NO_CACHE", "1")
    header = (
        " | from histories | moments | peak MiB (histories / traced) "
        "| reserved MiB (histories / traced) | s histories / traced |"
    )
    sizes = ["| case | sizes traced | size" + header, "|---|---|---:|---|---|---:|---:|---:|"]
    spaces = ["| case | traced on | sized on" + header, "|---|---|---|---|---|---:|---:|---:|"]
    chunked = ["| case | sizes traced | size" + header, "|---|---|---:|---|---|---:|---:|---:|"]
    fused = list(chunked)
    # cases, without a dry run, equal
    count = {k: [0, 0, 0] for k in ("sizes", "spaces", "chunked", "fused")}
    readable = {"chunked": 0, "fused": 0}  # cases whose chunks allow reading the target
    groups = (("chunked", "k", draw_chunked(args.chunked)), ("fused", "f", draw_fused(args.fused)))
    for group, tag, cases in groups:
        rows = chunked if group == "chunked" else fused
        for i, case in enumerate(cases, 1):
            r = run(case)
            print(case.label(), r, flush=True)
            if "skipped" in r:
                rows.append(
                    f"| {tag}{i:02d} {case.label()} | - | - | skipped: {r['skipped']} |||||"
                )
                continue
            row, answered, same = _row(
                f"{tag}{i:02d} {case.label()} | {case.bases[0]}, {case.bases[1]} | {case.target}",
                r,
            )
            rows.append(row)
            count[group] = _add(count[group], answered, same)
            readable[group] += r["readable"]
    for i, case in enumerate(draw(args.cases), 1):
        r = run(case)
        print(case.label(), r, flush=True)
        row, answered, same = case_row(f"c{i:02d}", case, r)
        sizes.append(row)
        if answered is None:
            continue
        count["sizes"] = _add(count["sizes"], answered, same)
        if "workspace" in r:
            w = r["workspace"]
            row, answered, same = _row(
                f"c{i:02d} {case.label()} at {case.target} | {case.gpu} | {w['gpu']}", w
            )
            spaces.append(row)
            count["spaces"] = _add(count["spaces"], answered, same)
    (n, a, e), (wn, wa, we) = count["sizes"], count["spaces"]
    (kn, ka, ke), (fn, fa, fe) = count["chunked"], count["fused"]
    lines = [
        *sizes,
        "",
        f"Between sizes: {a} of {n} cases answered from the histories (the others' histories "
        f"did not line up and were traced); of those, equal to the dry run in every moment, "
        f"peak and reserve: {e} of {a}.",
        "",
        "The same cases' target size on a GPU of the other cuBLAS workspace (8.1 MiB per handle "
        "before Hopper, 32 MiB from it) that runs the same kernels: the traced GPU's history "
        "with the workspace allocations resized, against a dry run on that GPU.",
        "",
        *spaces,
        "",
        f"Across workspaces: {wa} of {wn} cases answered from the histories; of those, equal to "
        f"the dry run: {we} of {wa}.",
        "",
        f"Language models with torchtune's chunked loss (`random.Random({CHUNKED_SEED})`): "
        "chunks cut along the sequence (a loop that keeps every chunk's logits) or 8 chunks "
        "over a sequence 8 divides are equal at every size and may be read from the histories; "
        "chunks of 128 tokens, or 8 over a sequence they do not divide, are traced.",
        "",
        *chunked,
        "",
        f"Chunked loss: {ka} of {kn} cases answered from the histories ({readable['chunked']} "
        f"have equal chunks at every size); of those, equal to the dry run: {ke} of {ka}.",
        "",
        f"Language models with Liger's fused loss (`random.Random({FUSED_SEED})`): a size is "
        "read from two others' histories where the tokens of all three make chunks of one row "
        "count, every chunk full, and more chunks than a dry run runs (the middle ones are "
        "skipped); else traced.",
        "",
        *fused,
        "",
        f"Fused loss: {fa} of {fn} cases answered from the histories ({readable['fused']} "
        f"have the three sizes' chunks alike); of those, equal to the dry run: {fe} of {fa}.",
    ]
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        held = (
            f"every case (`random.Random({SEED})`; the chunked-loss cases "
            f"`random.Random({CHUNKED_SEED})`, the fused-loss ones `random.Random({FUSED_SEED})`; "
            "each drawn before any was run); the code was debugged on `gpus bert-base-uncased "
            "--task classification --seq-len 512` and, for the losses, on a 4-layer GPT-2 of 64 "
            "features (the unit tests) only."
        )
        write_section("interpolation", text, held_out=held)


if __name__ == "__main__":
    main()
