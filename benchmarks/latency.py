"""Wall time of whole `batchfit` processes (import time counts), median of repeated runs.

Goal (issue #2): under 1.0 s for `plan` and the analytic `estimate` on catalog models.

    python benchmarks/latency.py [--repeat 9] [--no-write]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import write_section

CASES = [
    ("python -c pass (interpreter start, for reference)", [sys.executable, "-c", "pass"]),
    (
        "batchfit plan llama-3.1-8b --gpu a100-40gb --global-batch-tokens 1048576 --seq-len 4096",
        None,
    ),
    ("batchfit estimate gpt2 --micro-batch 8 --seq-len 1024 --engine analytic --gpu t4", None),
    (
        "batchfit estimate llama-3.1-70b --micro-batch 1 --seq-len 8192 --engine analytic "
        "--gpu h100-80gb --num-gpus 8 --sharding zero3",
        None,
    ),
    ("batchfit gpus llama-3.1-8b --seq-len 4096 (26 GPUs x ladder)", None),
    ("batchfit estimate gpt2 --micro-batch 8 --seq-len 1024 --engine trace --gpu t4", None),
    (
        "batchfit estimate llama-3.1-8b --micro-batch 1 --seq-len 4096 --engine trace "
        "--gpu h100-80gb",
        None,
    ),
    (
        "batchfit estimate llama-3.1-70b --micro-batch 1 --seq-len 4096 --engine trace "
        "--precision bf16 --gpu h200",
        None,
    ),
]


def command(label: str) -> list[str]:
    words = label.split(" (")[0].split()
    return [sys.executable, "-m", "batchfit", *words[1:], "--json"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    rows = []
    for label, cmd in CASES:
        cmd = cmd or command(label)
        subprocess.run(cmd, capture_output=True, check=True, env=env)  # warm the file cache
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            subprocess.run(cmd, capture_output=True, check=True, env=env)
            times.append(time.perf_counter() - t0)
        rows.append((label, statistics.median(times), min(times), max(times)))
        print(f"{statistics.median(times):7.3f} s  {label}", flush=True)
    lines = [
        "## Start-up latency (issue #2)",
        "",
        f"Whole processes, median of {args.repeat} runs after one warm-up; "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}. Goals: under 1.0 s for `plan` and the analytic "
        "engine (issue #2), under 5 s for the trace engine (issue #3; importing torch and "
        "one transformers model class is most of it). "
        "Produced by `python benchmarks/latency.py`.",
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
