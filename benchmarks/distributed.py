"""Per-rank memory of sharded steps: the trace (one process, fake process group) against real
CPU ranks under torchrun (gloo), FSDP2 and DDP, 2 and 4 ranks.

Debug cases (GPT-2, the cases the FSDP2 trace and DDP buckets were built on) are reported apart
from the evaluation cases, drawn at random from ``SEED`` (20261126, fixed before any result was
looked at), and holdout cases from ``HOLDOUT_SEED``, over the scaled-down architectures in
``configs/``, precision, sharding, ranks, micro-batch and sequence. Truth: ``_fsdp_truth.py``
on every rank (VmHWM after three steps, ``MALLOC_MMAP_THRESHOLD_=65536``), the largest rank's.
Estimate: ``estimate(..., device="cpu")`` with ``num_gpus`` = ranks (trace; analytic beside).

    python benchmarks/distributed.py [--no-write] [--only SUBSTR] [--cases N]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from _report import write_section  # noqa: E402

SEED = 20261126
# drawn after the first evaluation run had found gloo's reduce-scatter copy (its two llama-style
# cases were 11% and 29% under before it was modelled): cases no fix has seen
HOLDOUT_SEED = 20261127
MIB = 2**20
DEBUG = [
    {"model": "gpt2", "setup": {"sharding": "fsdp"}, "ranks": 2, "micro": 2, "seq": 256},
    {"model": "gpt2", "setup": {"sharding": "ddp"}, "ranks": 2, "micro": 2, "seq": 256},
]


def draw(n: int, seed: int = SEED) -> list[dict[str, Any]]:
    """``n`` evaluation cases from ``seed`` (the draw order is part of the record)."""
    rng = random.Random(seed)
    configs = sorted(p.name for p in (HERE / "configs").glob("gen-*.json"))
    configs = [c for c in configs if "bart" not in c]  # encoder-decoder: not a layer stack FSDP
    cases = []
    for _ in range(n):
        cases.append(
            {
                "model": str(HERE / "configs" / rng.choice(configs)),
                "setup": {
                    "sharding": rng.choice(["fsdp", "fsdp", "ddp"]),
                    "precision": rng.choice(["fp32", "amp-bf16"]),
                },
                "ranks": rng.choice([2, 4]),
                "micro": rng.choice([1, 2, 4]),
                "seq": rng.choice([128, 256]),
            }
        )
    return cases


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def truth(case: dict[str, Any]) -> int:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT / "src"),
        "OMP_NUM_THREADS": "1",
        "MALLOC_MMAP_THRESHOLD_": "65536",
    }
    spec = {k: case[k] for k in ("model", "setup", "micro", "seq")}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(case["ranks"]),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(_port()),
        str(HERE / "_fsdp_truth.py"),
        json.dumps(spec),
    ]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, timeout=1200)
    line = [x for x in out.stdout.splitlines() if x.startswith("{")][-1]
    return max(r["truth_bytes"] for r in json.loads(line)["ranks"])


def estimates(case: dict[str, Any]) -> dict[str, int]:
    from batchfit.memory.estimate import estimate
    from batchfit.models import resolve_model
    from batchfit.spec import TrainingSetup

    model = resolve_model(case["model"])
    setup = TrainingSetup(**case["setup"], num_gpus=case["ranks"])
    out = {}
    for engine in ("trace", "analytic"):
        est = estimate(
            model,
            setup,
            micro_batch_size=case["micro"],
            seq_len=case["seq"],
            device="cpu",
            engine=engine,  # type: ignore[arg-type]
        )
        out[engine] = est.peak_bytes
        if engine == "trace" and est.engine != "trace":
            out["fallback"] = 1
    return out


def describe(case: dict[str, Any]) -> str:
    s = case["setup"]
    name = Path(case["model"]).stem.removeprefix("gen-")
    prec = s.get("precision", "fp32")
    return f"{name} {s['sharding']} x{case['ranks']} {prec} {case['micro']}x{case['seq']}"


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| case | real rank peak MiB | trace MiB | trace error | analytic MiB | analytic error |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        t = r["truth"]
        lines.append(
            f"| {r['name']} | {t / MIB:,.1f} | {r['trace'] / MIB:,.1f} | "
            f"{(r['trace'] - t) / t:+.1%} | {r['analytic'] / MIB:,.1f} | "
            f"{(r['analytic'] - t) / t:+.1%} |"
        )
    return "\n".join(lines)


def summary(rows: list[dict[str, Any]], engine: str) -> str:
    errs = [abs(r[engine] - r["truth"]) / r["truth"] for r in rows]
    return f"{engine}: median {statistics.median(errs):.1%}, worst {max(errs):.1%}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--only", default="")
    ap.add_argument("--cases", type=int, default=6)
    args = ap.parse_args()
    os.environ.setdefault("BATCHFIT_NO_CACHE", "1")
    groups = {
        "debug": DEBUG,
        "evaluation": draw(args.cases),
        "holdout": draw(args.cases, HOLDOUT_SEED),
    }
    results: dict[str, list[dict[str, Any]]] = {}
    for group, cases in groups.items():
        rows = []
        for case in cases:
            name = describe(case)
            if args.only not in name:
                continue
            start = time.perf_counter()
            row = {"name": name, "truth": truth(case), **estimates(case)}
            row["seconds"] = time.perf_counter() - start
            print(json.dumps(row), flush=True)
            rows.append(row)
        results[group] = rows
    body = [
        "Per-rank peak of sharded CPU steps: real ranks under torchrun (gloo) vs the estimate "
        "for one rank (`benchmarks/distributed.py`; truth = VmHWM of the largest rank after "
        "three steps). FSDP2: `fully_shard` per layer, then the root; DDP: default buckets.",
        "",
        "The evaluation cases' first run, before gloo's reduce-scatter copy was modelled (the "
        "CPU ranks reduce-scatter through a copy of the whole input, allocated below the "
        "dispatcher), missed two llama-style cases whose peak falls at the root's reduce-scatter: "
        "mistral-small -11.3%, llama-gqa-small -28.9% (the other four as below). The fix was "
        "found on them, so the holdout cases, drawn after it, are the unseen check.",
        "",
    ]
    for group, rows in results.items():
        if not rows:
            continue
        label = {
            "debug": "Debug cases (built on)",
            "evaluation": f"Evaluation cases (seed {SEED})",
            "holdout": f"Holdout cases (seed {HOLDOUT_SEED}, drawn after the fix)",
        }[group]
        body += [f"**{label}**", "", table(rows), "", summary(rows, "trace"), ""]
        body += [summary(rows, "analytic"), ""]
    text = "\n".join(body)
    print(text)
    if not args.no_write and not args.only:
        write_section("distributed", text)


if __name__ == "__main__":
    main()
