"""The generalisation benchmark's grid: seeded draws of cases, screened, pinned on disk.

``SEED`` was fixed before any result was looked at and is never changed.

Each grid case draws an architecture (a seeded shuffle of ``ARCHS``, cycled, so each appears
3-4 times), a task (masked-lm or classification for the encoders), a precision (fp32 /
amp-bf16 / bf16), an optimizer (adamw / adam / sgd-momentum / adafactor / lion), the method
(full, or LoRA of rank 4-32 on one of three target sets), checkpointing, the loop (trainer /
keep-outputs), then a micro-batch (log-uniform 1..32) and sequence (log-uniform 64..1024,
within the model's positions). A draw is rejected and redrawn (same random stream, so
redraws are deterministic) when its analytic estimate (``--engine analytic --device cpu``)
is outside ``MIN_SCREEN_BYTES``..``MAX_SCREEN_BYTES`` or its predicted CPU time is over
``MAX_STEP_SECONDS``. The time screen matters for bf16: this AVX2 CPU has no bf16 matrix
unit, and bf16 steps run at about 1 GFLOP/s against 45 for fp32, so bf16 cases are small.
The drawn grid is pinned in ``data/generalisation_cases.json`` (the screen's analytic
numbers change with the code; the grid must not): delete the file to redraw.
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import accuracy  # noqa: E402
from accuracy import Case  # noqa: E402

SEED = 20261123  # fixed before any result was looked at; never change it
N_CASES = 45
MAX_SCREEN_BYTES = 5 * 1024**3  # keeps each truth under ~6 GiB RSS on a shared machine
# Below a quarter GiB a 2% error is 5 MiB, the size of the truth's own noise (allocator
# arenas, thread stacks): such draws are redrawn too.
MIN_SCREEN_BYTES = 1024**3 // 4
MAX_STEP_SECONDS = 60.0  # predicted CPU time of the two measured steps
# Measured on this machine (2 AVX2 cores): a 4-layer GPT-2 fp32 step ran ~47 GFLOP/s; bf16
# (autocast or pure) 0.85-2 GFLOP/s (no bf16 matrix unit, aten's bf16 GEMM fallback).
FLOPS_PER_SECOND = {"fp32": 45e9, "amp-bf16": 1.5e9, "bf16": 1.5e9}
DATA = HERE / "data"
CASES_FILE = DATA / "generalisation_cases.json"

PRECISIONS = ("fp32", "amp-bf16", "bf16")
OPTIMIZERS = ("adamw", "adam", "sgd-momentum", "adafactor", "lion")
LOOPS = ("trainer", "keep-outputs")
LORA_RANKS = (4, 8, 16, 32)


@dataclass(frozen=True)
class Arch:
    name: str
    config: str  # a file in configs/
    encoder: bool
    lora_targets: tuple[tuple[str, ...], ...]  # attention subset, all attention, + MLP
    max_seq: int = 1024


def _targets(q: str, k: str, v: str, o: str, *mlp: str) -> tuple[tuple[str, ...], ...]:
    return ((q, v), (q, k, v, o), (q, k, v, o, *mlp))


_LLAMA_LIKE = _targets("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ARCHS = (
    Arch("bert", "gen-bert-small.json", True, _targets("query", "key", "value", "dense"), 512),
    Arch(
        "roberta", "gen-roberta-small.json", True, _targets("query", "key", "value", "dense"), 512
    ),
    Arch(
        "distilbert",
        "gen-distilbert-small.json",
        True,
        _targets("q_lin", "k_lin", "v_lin", "out_lin", "lin1", "lin2"),
        512,
    ),
    Arch(
        "gpt2",
        "gen-gpt2-small.json",
        False,
        (("c_attn",), ("c_attn", "c_proj"), ("c_attn", "c_proj", "c_fc")),
    ),
    Arch(
        "opt",
        "gen-opt-small.json",
        False,
        _targets("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"),
    ),
    Arch("llama-gqa", "gen-llama-gqa-small.json", False, _LLAMA_LIKE),
    Arch("mistral-gqa", "gen-mistral-small.json", False, _LLAMA_LIKE),
    Arch("qwen2-tied", "gen-qwen2-tied-small.json", False, _LLAMA_LIKE),
    Arch("gemma-tied", "gen-gemma-small.json", False, _LLAMA_LIKE),
    Arch(
        "phi-partial-rope",
        "gen-phi-small.json",
        False,
        _targets("q_proj", "k_proj", "v_proj", "dense", "fc1", "fc2"),
    ),
    Arch(
        "pythia-parallel",
        "gen-pythia-small.json",
        False,
        (
            ("query_key_value",),
            ("query_key_value", "dense"),
            ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"),
        ),
    ),
    Arch("t5", "gen-t5-small.json", False, _targets("q", "k", "v", "o", "wi", "wo")),
    Arch(
        "bart",
        "gen-bart-small.json",
        False,
        _targets("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"),
    ),
)


def _log_uniform_int(rng: random.Random, low: int, high: int) -> int:
    return min(high, max(low, round(2 ** rng.uniform(math.log2(low), math.log2(high)))))


def _draw_setup(rng: random.Random, arch: Arch) -> tuple[dict[str, Any], str | None, str]:
    """One draw of the task, setup and loop for ``arch``."""
    task = rng.choice(("masked-lm", "classification")) if arch.encoder else None
    setup: dict[str, Any] = {
        "precision": rng.choice(PRECISIONS),
        "optimizer": rng.choice(OPTIMIZERS),
    }
    if rng.random() < 0.4:
        rank = rng.choice(LORA_RANKS)
        targets = rng.choice(arch.lora_targets)
        setup.update(
            method="lora", lora_rank=rank, lora_alpha=2.0 * rank, lora_targets=list(targets)
        )
    if rng.random() < 0.3:
        setup["grad_ckpt"] = True
    return setup, task, rng.choice(LOOPS)


def _label(arch: Arch, setup: dict[str, Any], task: str | None, loop: str) -> str:
    parts = [arch.name]
    if task is not None:
        parts.append("cls" if task == "classification" else "mlm")
    parts += [setup["precision"], setup["optimizer"]]
    if setup.get("method") == "lora":
        parts.append(f"lora r{setup['lora_rank']} {','.join(setup['lora_targets'])}")
    if setup.get("grad_ckpt"):
        parts.append("ckpt")
    parts.append(loop)
    return " ".join(parts)


def draw_grid() -> list[Case]:
    """The grid: ``N_CASES`` screened draws from ``random.Random(SEED)`` (deterministic)."""
    rng = random.Random(SEED)
    order = list(ARCHS)
    rng.shuffle(order)
    cases = []
    for i in range(N_CASES):
        arch = order[i % len(order)]
        case = None
        while case is None:
            setup, task, loop = _draw_setup(rng, arch)
            for _ in range(50):  # sizes for this setup; a setup that fits none is redrawn
                micro = _log_uniform_int(rng, 1, 32)
                seq = _log_uniform_int(rng, 64, arch.max_seq)
                label = f"g{i:02d} {_label(arch, setup, task, loop)}"
                candidate = Case(label, f"configs/{arch.config}", micro, seq, setup, task, loop)
                if _passes_screen(candidate):
                    case = candidate
                    break
        cases.append(case)
        print(f"drew {case.name} {case.micro}x{case.seq}", file=sys.stderr, flush=True)
    return cases


def shape(case: Case) -> tuple[int, int, int, int]:
    """Parameters, layers, hidden size and vocabulary of ``case``'s model, built on meta."""
    key = (case.model, case.task)
    if key not in _SHAPES:
        import torch
        import transformers

        raw = json.loads((HERE / case.model).read_text())
        cfg = transformers.AutoConfig.for_model(**raw)
        auto = {
            None: transformers.AutoModelForCausalLM,
            "causal-lm": transformers.AutoModelForCausalLM,
            "seq2seq": transformers.AutoModelForSeq2SeqLM,
            "masked-lm": transformers.AutoModelForMaskedLM,
            "classification": transformers.AutoModelForSequenceClassification,
        }[case.task]
        if raw.get("is_encoder_decoder"):
            auto = transformers.AutoModelForSeq2SeqLM
        with torch.device("meta"):
            net = auto.from_config(cfg)  # type: ignore[no-untyped-call]
        params = sum(p.numel() for p in net.parameters())
        layers = sum(
            int(raw.get(k, 0))
            for k in (
                "num_hidden_layers",
                "n_layer",
                "n_layers",
                "num_layers",
                "num_decoder_layers",
                "encoder_layers",
                "decoder_layers",
            )
        )
        hidden = next(int(raw[k]) for k in ("hidden_size", "n_embd", "dim", "d_model") if k in raw)
        _SHAPES[key] = (params, layers, hidden, int(raw["vocab_size"]))
    return _SHAPES[key]


_SHAPES: dict[tuple[str, str | None], tuple[int, int, int, int]] = {}


def predicted_seconds(case: Case) -> float:
    """CPU time of the two measured steps: 6 FLOPs per parameter and token (forward and
    backward, Kaplan et al. 2020) with the LM head counted again, 12 L s^2 h per sequence for
    attention, a third more under checkpointing (a second forward)."""
    params, layers, hidden, vocab = shape(case)
    flops: float = 6 * (params + vocab * hidden) * case.micro * case.seq
    flops += 12 * layers * case.seq**2 * hidden * case.micro
    if case.setup.get("grad_ckpt"):
        flops *= 4 / 3
    return 2 * flops / FLOPS_PER_SECOND[case.setup["precision"]]


def screen_bytes(case: Case) -> int:
    """The analytic estimate; where batchfit cannot read the model yet (BART before
    the config check), weights, gradients and two fp32 states (16 B/param) plus fp32 logits,
    their gradient and softmax (12 B per token and vocabulary entry)."""
    from batchfit.errors import UsageError
    from batchfit.memory.estimate import estimate
    from batchfit.models import resolve_model
    from batchfit.spec import TrainingSetup

    try:
        info = resolve_model(str(HERE / case.model), case.task)
    except UsageError:
        params, _, _, vocab = shape(case)
        return 16 * params + 12 * case.micro * case.seq * vocab
    setup = TrainingSetup(**accuracy.setup_fields(case))
    est = estimate(
        info, setup, micro_batch_size=case.micro, seq_len=case.seq, device="cpu", engine="analytic"
    )
    return est.peak_bytes


def _passes_screen(case: Case) -> bool:
    if predicted_seconds(case) > MAX_STEP_SECONDS:
        return False
    return MIN_SCREEN_BYTES <= screen_bytes(case) <= MAX_SCREEN_BYTES


def pinned_grid(
    cases_file: Path, seed: int, n_cases: int, draw: Callable[[], list[Case]]
) -> list[Case]:
    """A grid drawn once by ``draw``, pinned in ``cases_file``, then read back from it (model
    paths made absolute); a file drawn with another seed or size is refused."""
    if cases_file.exists():
        pinned = json.loads(cases_file.read_text())
        if pinned["seed"] != seed or len(pinned["cases"]) != n_cases:
            raise SystemExit(f"{cases_file} was drawn with another seed or size: delete it")
        cases = [Case(**c) for c in pinned["cases"]]
    else:
        cases = draw()
        write_json(cases_file, {"seed": seed, "cases": [asdict(c) for c in cases]})
    return [Case(**{**asdict(c), "model": str(HERE / c.model)}) for c in cases]


def grid() -> list[Case]:
    """The pinned grid (drawn once, then read back from ``CASES_FILE``)."""
    return pinned_grid(CASES_FILE, SEED, N_CASES, draw_grid)


def write_json(path: Path, data: Any) -> None:
    """Write to a temporary name and rename: an interrupted run never leaves half a file."""
    path.parent.mkdir(exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True, allow_nan=False) + "\n")
    os.replace(tmp, path)
