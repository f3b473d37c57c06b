"""The combination benchmark's grid: seeded draws over the dimensions the generalisation grid
holds fixed, screened as that grid screens, pinned on disk.

``SEED`` was fixed before any result was looked at and is never changed.

Each case draws an architecture (a seeded shuffle of the generalisation grid's ``ARCHS``,
cycled), a task the architecture allows (``TASKS``), the framework whose conventions the step
follows (``--framework``, or none), the method (full, LoRA, or QLoRA where the truth can run
bitsandbytes' recipe: ``QLORA_FRAMEWORKS``), a precision (QLoRA computes in 16-bit), the loss
for a language-model task (the framework's, or ``full`` / ``chunked:8`` / ``chunked:128t``
chosen explicitly), the loop (the framework's, or chosen explicitly), checkpointing, then a
micro-batch and sequence, screened as ``_generalisation_grid`` screens (analytic memory and
predicted CPU time). The optimizer is AdamW throughout (its implementation the framework's):
the optimizers are the generalisation grid's dimension.

``--loss fused`` is left out: it stands for Liger's fused linear cross-entropy, a Triton kernel
that runs on CUDA only, so no CPU step can give its truth.

A second stream from the same seed splits the cases into ``N_EVALUATION`` evaluation cases,
held out (run and reported, never debugged on), and the debug cases.
"""

from __future__ import annotations

import random
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _generalisation_grid import (  # noqa: E402
    ARCHS,
    DATA,
    LORA_RANKS,
    Arch,
    _log_uniform_int,
    pinned_grid,
    screen_bytes,
    shape,
)
from accuracy import Case  # noqa: E402

SEED = 20261130  # fixed before any result was looked at; never change it
N_CASES = 24
N_EVALUATION = 12
MAX_SCREEN_BYTES = 4 * 1024**3
# The truth's noise is under 1 MiB (the generalisation grid's repeated cases: 0.1-0.6 MiB), so
# 2% of 128 MiB stands above it; a higher floor would leave no 16-bit case here (below).
MIN_SCREEN_BYTES = 128 * 1024**2
MAX_STEP_SECONDS = 90.0  # predicted CPU time of the truth's three steps (24 cases, ~30 min)
SIZE_TRIES = 100
SETUP_TRIES = 10
# Measured on this machine (2 AVX2 cores, shared): a 1024x512 @ 512x4096 matmul ran 35-43
# GFLOP/s in fp32, 0.37 in bf16 (with or without autocast) and 0.5 in fp16: no 16-bit matrix
# unit. 16-bit cases are therefore small, most of them at their smallest size.
FLOPS_PER_SECOND = {"fp32": 35e9, "amp-bf16": 0.4e9, "bf16": 0.4e9}
CASES_FILE = DATA / "combination_cases.json"

FRAMEWORKS: tuple[str | None, ...] = (
    None,
    "hf-trainer",
    "accelerate",
    "lightning",
    "litgpt",
    "torchtune",
)
# QLoRA's truth loads the model through transformers' bitsandbytes quantizer and peft, the
# recipe these frameworks' QLoRA runs take; litgpt quantises with Fabric's plugin on its own
# model classes and torchtune with torchao's NF4 tensors, which the truth does not run.
QLORA_FRAMEWORKS: tuple[str | None, ...] = (None, "hf-trainer", "accelerate", "lightning")
METHODS = ("full", "lora", "qlora")
PRECISIONS = ("fp32", "amp-bf16", "bf16")
LOSSES = ("full", "chunked:8", "chunked:128t")
LOOPS = ("trainer", "keep-outputs")
# classification needs a padding token in the config for a decoder (the pooled last token)
TASKS = {
    "bert": ("masked-lm", "classification"),
    "roberta": ("masked-lm", "classification"),
    "distilbert": ("masked-lm", "classification"),
    "opt": ("causal-lm", "causal-lm", "classification"),
    "gemma-tied": ("causal-lm", "causal-lm", "classification"),
    "t5": ("seq2seq",),
    "bart": ("seq2seq",),
}
LM_TASKS = ("causal-lm", "seq2seq")


def _setup(rng: random.Random, arch: Arch, task: str, method: str) -> dict[str, Any]:
    """One draw of the framework, precision, loss, loop and checkpointing for ``method``."""
    from batchfit.frameworks import with_framework
    from batchfit.spec import TrainingSetup, parse_loss

    framework = rng.choice(QLORA_FRAMEWORKS if method == "qlora" else FRAMEWORKS)
    precision = rng.choice(PRECISIONS[1:] if method == "qlora" else PRECISIONS)
    fields_: dict[str, Any] = {"precision": precision, "optimizer": "adamw", "method": method}
    explicit = set()
    if method != "full":
        rank = rng.choice(LORA_RANKS)
        fields_.update(
            lora_rank=rank, lora_alpha=2.0 * rank, lora_targets=rng.choice(arch.lora_targets)
        )
    loss = rng.choice(LOSSES) if rng.random() < 0.5 else None
    if task not in LM_TASKS:
        loss = "full"  # a chunked head is a language model's (torchtune, litgpt)
    if loss is not None:
        kind, chunks, tokens = parse_loss(loss)
        fields_.update(loss=kind, loss_chunks=chunks, loss_chunk_tokens=tokens)
        explicit.add("loss")
    if rng.random() < 0.3:
        fields_["loop"] = rng.choice(LOOPS)
        explicit.add("loop")
    if rng.random() < 0.3:
        fields_["grad_ckpt"] = True
    setup = TrainingSetup(task=task, **fields_)  # type: ignore[arg-type]
    if framework is not None:
        setup = with_framework(setup, framework, frozenset(explicit))
    default = TrainingSetup()
    return {
        f.name: getattr(setup, f.name)
        for f in fields(setup)
        if f.name != "task" and getattr(setup, f.name) != getattr(default, f.name)
    }


def _label(arch: Arch, task: str, setup: dict[str, Any]) -> str:
    from batchfit.spec import TrainingSetup

    s = TrainingSetup(**setup)
    parts = [arch.name, task, setup.get("framework") or "no-framework", s.precision]
    if s.method != "full":
        parts.append(f"{s.method} r{s.lora_rank} {','.join(s.lora_targets or ())}")
    if task in LM_TASKS:
        parts.append(f"loss {s.loss_label}")
    if s.grad_ckpt:
        parts.append("ckpt")
    parts.append(s.loop)
    return " ".join(parts)


def _json_setup(setup: dict[str, Any]) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in setup.items()}


def _sized(rng: random.Random, arch: Arch, task: str, setup: dict[str, Any], i: int) -> Case | None:
    """The case at the first of ``SIZE_TRIES`` drawn sizes that passes the screen, else at the
    smallest size (1 x 64) if that passes; None when neither does."""
    label = f"c{i:02d} {_label(arch, task, setup)}"
    loop = setup.get("loop", "trainer")
    model = f"configs/{arch.config}"
    for _ in range(SIZE_TRIES):
        micro = _log_uniform_int(rng, 1, 32)
        seq = _log_uniform_int(rng, 64, arch.max_seq)
        candidate = Case(label, model, micro, seq, setup, task, loop)
        if _passes_screen(candidate):
            return candidate
    smallest = Case(label, model, 1, 64, setup, task, loop)
    return smallest if _passes_screen(smallest) else None


def draw_grid() -> list[Case]:
    """``N_CASES`` screened draws from ``random.Random(SEED)`` (deterministic)."""
    rng = random.Random(SEED)
    order = list(ARCHS)
    rng.shuffle(order)
    # each method a third of the cases: 16-bit steps are slow here, and a method redrawn
    # whenever its setup fits no size would leave few QLoRA cases
    methods = [METHODS[i % len(METHODS)] for i in range(N_CASES)]
    rng.shuffle(methods)
    cases = []
    for i in range(N_CASES):
        case = None
        tries = 0
        while case is None:
            # an architecture none of SETUP_TRIES setups fits (a 152k vocabulary in bf16)
            # passes the case on to the next one in the order
            if tries % SETUP_TRIES == 0:
                arch = order[(i + tries // SETUP_TRIES) % len(order)]
                # drawn once per architecture, not with each setup: a classification head
                # holds no logits, so its small 16-bit steps fail the floor more often, and a
                # task redrawn with the setup would leave few classification cases
                task = rng.choice(TASKS.get(arch.name, ("causal-lm",)))
            setup = _json_setup(_setup(rng, arch, task, methods[i]))
            case = _sized(rng, arch, task, setup, i)
            tries += 1
        cases.append(case)
        print(f"drew {case.name} {case.micro}x{case.seq}", file=sys.stderr, flush=True)
    return cases


def predicted_seconds(case: Case) -> float:
    """CPU time of the truth's three steps (a 1-layer warm-up, two measured): 6 FLOPs per
    parameter and token, 4 for a frozen base (no weight gradient; Kaplan et al. 2020), the
    parameters' count standing in for the head's (embeddings are gathers), 12 L s^2 h per
    sequence for attention, a third more under checkpointing (a second forward)."""
    params, layers, hidden, vocab = shape(case)
    per_param = 6 if case.setup.get("method", "full") == "full" else 4
    tokens = case.micro * case.seq
    flops: float = per_param * params * tokens + 12 * layers * case.seq**2 * hidden * case.micro
    if case.setup.get("grad_ckpt"):
        flops *= 4 / 3
    warm_up = per_param * (vocab * hidden + (params - vocab * hidden) / max(1, layers)) * tokens
    return (2 * flops + warm_up) / FLOPS_PER_SECOND[case.setup["precision"]]


def _passes_screen(case: Case) -> bool:
    if predicted_seconds(case) > MAX_STEP_SECONDS:
        return False
    return MIN_SCREEN_BYTES <= screen_bytes(case) <= MAX_SCREEN_BYTES


def evaluation_names(cases: list[Case]) -> set[str]:
    """The held-out half: ``N_EVALUATION`` indices drawn by a second ``random.Random(SEED)``."""
    picked = random.Random(SEED).sample(range(len(cases)), N_EVALUATION)
    return {cases[i].name for i in picked}


def grid() -> list[Case]:
    """The pinned grid (drawn once, then read back from ``CASES_FILE``)."""
    return pinned_grid(CASES_FILE, SEED, N_CASES, draw_grid)
