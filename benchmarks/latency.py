"""Wall time of whole `batchfit` processes (import time counts), median of repeated runs.

Goals: under 1.0 s for the analytic engine on catalog models; `plan` from the trace
cold < 6 s and warm < 0.5 s, `gpus MODEL` over all catalog GPUs cold < 12 s and warm < 1 s
"cold" runs each get an empty trace cache (BATCHFIT_CACHE_DIR); "warm" runs share
one that a first run filled.

    python benchmarks/latency.py [--repeat 9] [--cold-repeat 3] [--only SUBSTR] [--no-write]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import write_section

CASES = [
    ("python -c pass (interpreter start, for reference)", [sys.executable, "-c", "pass"]),
    (
        "batchfit plan llama-3.1-8b --gpu a100-40gb --global-batch-tokens 1048576 --seq-len 4096 "
        "--engine analytic",
        None,
    ),
    ("batchfit estimate gpt2 --micro-batch 8 --seq-len 1024 --engine analytic --gpu t4", None),
    (
        "batchfit estimate llama-3.1-70b --micro-batch 1 --seq-len 8192 --engine analytic "
        "--gpu h100-80gb --num-gpus 8 --sharding zero3",
        None,
    ),
    ("batchfit gpus llama-3.1-8b --seq-len 4096 --engine analytic (26 GPUs x ladder)", None),
    ("batchfit estimate gpt2 --micro-batch 8 --seq-len 1024 --gpu t4 --no-cache (trace)", None),
    (
        "batchfit estimate llama-3.1-8b --micro-batch 1 --seq-len 4096 --gpu h100-80gb "
        "--no-cache (trace)",
        None,
    ),
    (
        "batchfit estimate llama-3.1-70b --micro-batch 1 --seq-len 4096 --precision bf16 "
        "--gpu h200 --no-cache (trace)",
        None,
    ),
    ("batchfit plan gpt2 --gpu t4 --seq-len 1024 --global-batch 64 (trace, cold)", None),
    ("batchfit plan gpt2 --gpu t4 --seq-len 1024 --global-batch 64 (trace, warm)", None),
    ("batchfit gpus gpt2 --seq-len 1024 (trace, cold)", None),
    ("batchfit gpus gpt2 --seq-len 1024 (trace, warm)", None),
]


# The cold-answer targets: each model's question, and the import it is measured against
# (`python -c "import torch, transformers; from transformers import <its class>"`)
TARGETS = [
    ("gpt2", "GPT2LMHeadModel", "gpt2 --gpu t4 --seq-len 1024 --global-batch 64", "--seq-len 1024"),
    (
        "bert-base-uncased",
        "BertForSequenceClassification",
        "bert-base-uncased --task classification --gpu t4 --seq-len 512 --global-batch 64",
        "--task classification --seq-len 512",
    ),
    (
        "llama-3.1-8b",
        "LlamaForCausalLM",
        "llama-3.1-8b --gpu a100-40gb --global-batch-tokens 1048576 --seq-len 4096",
        "--seq-len 4096",
    ),
    (
        "vit-base-patch16-224",
        "ViTForImageClassification",
        "vit-base-patch16-224 --task image-classification --image-size 224 --gpu t4 "
        "--global-batch 256",
        "--task image-classification --image-size 224",
    ),
]
AUTO = "llama-3.1-8b --gpu h100-80gb --num-gpus auto --max-gpus 8 --global-batch 256 --seq-len 4096"
PLAN_RATIO, GPUS_RATIO, AUTO_RATIO, WARM_S = 2.5, 5.0, 10.0, 0.5


def _timed(cmd: list[str], env: dict[str, str], cold: bool) -> float:
    """Seconds of one whole process; ``cold``: with an empty trace cache of its own."""
    run_env = {**env, "BATCHFIT_CACHE_DIR": tempfile.mkdtemp()} if cold else env
    t0 = time.perf_counter()
    subprocess.run(cmd, capture_output=True, check=True, env=run_env)
    return time.perf_counter() - t0


def targets(repeat: int, env: dict[str, str], only: str | None) -> list[str]:
    """The cold-answer targets, each command and its import timed side by side in turn."""
    py = sys.executable
    lines = [
        "| model | import s | cold `plan` s | plan / import | cold `gpus` s | gpus / import "
        "| warm `plan` s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, cls, plan_args, gpus_args in TARGETS:
        if only and only not in name:
            continue
        imp = [py, "-c", f"import torch, transformers; from transformers import {cls}"]
        plan = [py, "-m", "batchfit", "plan", *plan_args.split(), "--json"]
        gpus = [py, "-m", "batchfit", "gpus", name, *gpus_args.split(), "--json"]
        runs: dict[str, list[float]] = {"import": [], "plan": [], "gpus": []}
        for _ in range(repeat):  # side by side: each round times all three in turn
            runs["import"].append(_timed(imp, env, False))
            runs["plan"].append(_timed(plan, env, True))
            runs["gpus"].append(_timed(gpus, env, True))
        subprocess.run(plan, capture_output=True, check=True, env=env)  # fills the warm cache
        warm = statistics.median(_timed(plan, env, False) for _ in range(5))
        i, p, g = (statistics.median(runs[k]) for k in ("import", "plan", "gpus"))
        lines.append(
            f"| {name} | {i:.1f} | {p:.1f} | {p / i:.1f}x | {g:.1f} | {g / i:.1f}x | {warm:.2f} |"
        )
        print(lines[-1], flush=True)
    if not only or only in AUTO:
        imp = [py, "-c", "import torch, transformers; from transformers import LlamaForCausalLM"]
        auto = [py, "-m", "batchfit", "plan", *AUTO.split(), "--json"]
        i = statistics.median(_timed(imp, env, False) for _ in range(repeat))
        a = statistics.median(_timed(auto, env, True) for _ in range(repeat))
        lines += [
            "",
            f"`plan {AUTO}` cold: {a:.1f} s, {a / i:.1f}x the import ({i:.1f} s); "
            f"target {AUTO_RATIO:g}x.",
        ]
        print(lines[-1], flush=True)
    return lines


def command(label: str) -> list[str]:
    words = label.split(" (")[0].split()  # "(trace, cold)" and the like are notes
    return [sys.executable, "-m", "batchfit", *words[1:], "--json"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--cold-repeat", type=int, default=3)
    parser.add_argument("--only", default=None, help="substring of a command")
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument(
        "--targets", action="store_true", help="the cold-answer targets against the import"
    )
    args = parser.parse_args()
    warm_cache = tempfile.mkdtemp(prefix="batchfit-latency-")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "BATCHFIT_CACHE_DIR": warm_cache}
    env.pop("BATCHFIT_NO_CACHE", None)
    if args.targets:
        table = targets(args.cold_repeat, env, args.only)
        head = [
            "## Cold answers against the import they need",
            "",
            "Whole processes, "
            + (f"medians of {args.cold_repeat} rounds" if args.cold_repeat > 1 else "one round")
            + "; in each round the import, "
            "the cold `plan` and the cold `gpus` (every catalog GPU) run one after another, so "
            "each ratio compares runs made side by side (each cold run has an empty trace cache). "
            'The import is `python -c "import torch, transformers; from transformers import '
            "<the model's class>\"`. Targets: cold `plan` at most "
            f"{PLAN_RATIO:g}x the import, cold `gpus` at most {GPUS_RATIO:g}x, warm `plan` at most "
            f"{WARM_S:g} s. Questions: "
            + "; ".join(f"`plan {p}`" for _, _, p, _ in TARGETS)
            + " (and `gpus MODEL` with the same sample). "
            f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python "
            f"{platform.python_version()}. Produced by `python benchmarks/latency.py --targets`.",
            "",
        ]
        if not args.no_write:
            write_section(
                "latency-targets",
                "\n".join([*head, *table]),
                held_out="not an accuracy set: the four questions are the targets' own, "
                "fixed before any change was timed.",
            )
        return 0
    rows = []
    for label, cmd in CASES:
        if args.only and args.only not in label:
            continue
        cmd = cmd or command(label)
        cold = label.endswith("cold)")
        subprocess.run(cmd, capture_output=True, check=True, env=env)  # warm file and trace caches
        times = []
        for _ in range(args.cold_repeat if cold else args.repeat):
            run_env = {**env, "BATCHFIT_CACHE_DIR": tempfile.mkdtemp()} if cold else env
            t0 = time.perf_counter()
            subprocess.run(cmd, capture_output=True, check=True, env=run_env)
            times.append(time.perf_counter() - t0)
        rows.append((label, statistics.median(times), min(times), max(times)))
        print(f"{statistics.median(times):7.3f} s  {label}", flush=True)
    lines = [
        "## Start-up latency",
        "",
        f"Whole processes, median of {args.repeat} runs after one warm-up ({args.cold_repeat} "
        "for cold runs, each with an empty trace cache); "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}. Goals: under 1.0 s for the analytic engine, "
        "under 5 s for one trace (importing torch and one transformers "
        "model class is most of it), `plan` cold < 6 s / warm < 0.5 s and `gpus MODEL` cold "
        "< 12 s / warm < 1 s. Produced by `python benchmarks/latency.py`.",
        "",
        "| command | median s | min s | max s |",
        "|---|---:|---:|---:|",
        *[f"| `{label}` | {med:.3f} | {lo:.3f} | {hi:.3f} |" for label, med, lo, hi in rows],
    ]
    if not args.no_write:
        write_section("latency", "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
