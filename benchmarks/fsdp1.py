"""FSDP1 per rank: the trace (``--fsdp-version 1``: FullyShardedDataParallel under a fake
process group) against real CPU ranks under torchrun (gloo), wrapped as accelerate wraps them.

Cases are drawn at random from ``SEED`` (20261128, fixed before any FSDP1 result was looked at)
over two 2-layer configs (``configs/tiny-*-2l.json``), full fine-tuning and LoRA, precision,
ranks (2 or 4), micro-batch and sequence. LoRA keeps its frozen base in fp32 (one FlatParameter
holds one dtype; peft's FSDP recipe loads the base in fp32 for the same reason). Truth:
``_fsdp_truth.py`` on every rank (VmHWM after three steps), rank 0's and the largest; the trace
is one rank. The FSDP2 trace of the same case is printed beside it.

Truths are kept in ``data/fsdp1_truth.json`` and measured again only with ``--remeasure``.

    python benchmarks/fsdp1.py [--no-write] [--remeasure] [--cases N]
"""

from __future__ import annotations

import argparse
import json
import os
import random
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
from distributed import _port  # noqa: E402

SEED = 20261128
# drawn after the evaluation cases had found gloo's list all-gather scratch (their two LoRA cases
# at micro-batch 1 missed by -9.2% before it was modelled): cases no fix was found on
HOLDOUT_SEED = 20261129
# the diagnosis case of that fix, measured before the holdout draw, which then drew it
SEEN = "tiny-llama-2l lora x2 fp32 1x128"
TRUTHS = HERE / "data" / "fsdp1_truth.json"  # every rank's measured bytes, by case
MIB = 2**20
CONFIGS = ("tiny-llama-2l.json", "tiny-gpt2-2l.json")


def draw(n: int, seed: int = SEED) -> list[dict[str, Any]]:
    """``n`` cases from ``seed`` (the draw order is part of the record)."""
    rng = random.Random(seed)
    cases = []
    for _ in range(n):
        method = rng.choice(["full", "lora"])
        setup: dict[str, Any] = {
            "sharding": "fsdp",
            "fsdp_version": 1,
            "method": method,
            "precision": rng.choice(["fp32", "amp-bf16"]),
        }
        if method == "lora":
            setup["frozen_dtype"] = "fp32"
        cases.append(
            {
                "model": str(HERE / "configs" / rng.choice(CONFIGS)),
                "setup": setup,
                "ranks": rng.choice([2, 4]),
                "micro": rng.choice([1, 2]),
                "seq": rng.choice([64, 128]),
            }
        )
    return cases


def truth(case: dict[str, Any]) -> list[int]:
    """Every rank's peak (bytes above the RSS before the model), rank order."""
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT / "src"),
        "OMP_NUM_THREADS": "1",
        "MALLOC_MMAP_THRESHOLD_": "65536",
    }
    spec = {k: case[k] for k in ("model", "setup", "micro", "seq")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(case["ranks"])]
    cmd += ["--master_addr", "127.0.0.1", "--master_port", str(_port())]
    cmd += [str(HERE / "_fsdp_truth.py"), json.dumps(spec)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, timeout=1200)
    line = [x for x in out.stdout.splitlines() if x.startswith("{")][-1]
    ranks = sorted(json.loads(line)["ranks"], key=lambda r: r["rank"])
    return [int(r["truth_bytes"]) for r in ranks]


def traced(case: dict[str, Any], version: int) -> int:
    """The trace's peak for one rank of ``case`` under FSDP ``version``."""
    from batchfit.memory.estimate import estimate
    from batchfit.models import resolve_model
    from batchfit.spec import TrainingSetup

    fields = {**case["setup"], "fsdp_version": version, "num_gpus": case["ranks"]}
    est = estimate(
        resolve_model(case["model"]),
        TrainingSetup(**fields),
        micro_batch_size=case["micro"],
        seq_len=case["seq"],
        device="cpu",
        engine="trace",
    )
    if est.engine != "trace":
        raise RuntimeError(f"the trace fell back: {est.warnings}")
    return est.peak_bytes


def describe(case: dict[str, Any]) -> str:
    s = case["setup"]
    name = Path(case["model"]).stem
    return f"{name} {s['method']} x{case['ranks']} {s['precision']} {case['micro']}x{case['seq']}"


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| case | real rank 0 MiB | real max rank MiB | FSDP1 trace MiB | error vs rank 0 "
        "| error vs max | FSDP2 trace MiB |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        t0, tmax, est = r["truth"][0], max(r["truth"]), r["trace"]
        lines.append(
            f"| {r['name']} | {t0 / MIB:,.1f} | {tmax / MIB:,.1f} | {est / MIB:,.1f} | "
            f"{(est - t0) / t0:+.1%} | {(est - tmax) / tmax:+.1%} | {r['fsdp2'] / MIB:,.1f} |"
        )
    return "\n".join(lines)


def _rows(cases: list[dict[str, Any]], remeasure: bool) -> list[dict[str, Any]]:
    known = json.loads(TRUTHS.read_text()) if TRUTHS.exists() else {}
    rows = []
    for case in cases:
        start = time.perf_counter()
        name = describe(case)
        if remeasure or name not in known:
            known[name] = truth(case)
            TRUTHS.write_text(json.dumps(known, indent=1) + "\n")
        row = {"name": name, "truth": known[name], "trace": traced(case, 1)}
        row["fsdp2"] = traced(case, 2)
        row["seconds"] = time.perf_counter() - start
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def _summary(rows: list[dict[str, Any]]) -> str:
    errs = [abs(r["trace"] - r["truth"][0]) / r["truth"][0] for r in rows]
    return f"FSDP1 trace vs rank 0: median {statistics.median(errs):.1%}, worst {max(errs):.1%}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--remeasure", action="store_true")
    ap.add_argument("--cases", type=int, default=6)
    args = ap.parse_args()
    os.environ.setdefault("BATCHFIT_NO_CACHE", "1")
    evaluation = _rows(draw(args.cases), args.remeasure)
    holdout = _rows(draw(4, HOLDOUT_SEED), args.remeasure)
    body = [
        "FSDP1 per rank: real CPU ranks under torchrun (gloo), each decoder layer and the root "
        "wrapped in `FullyShardedDataParallel` as accelerate wraps them (`use_orig_params=True`, "
        "FULL_SHARD, BACKWARD_PRE, accelerate's `MixedPrecision` and fp32 upcast under AMP), vs "
        "the trace of one rank (`--fsdp-version 1`; truth = VmHWM after three steps). The last "
        "column is the FSDP2 trace of the same case: what the estimate said before FSDP1 was "
        "a setup. LoRA keeps its frozen base in fp32 (one FlatParameter holds one dtype).",
        "",
        "The evaluation cases' first run missed the LoRA case at micro-batch 1 by -9.2% and "
        "tiny-gpt2-2l full x4 fp32 2x128 by -1.5% (the other four as below): FSDP1 gathers a "
        "CPU flat parameter with gloo's list all-gather, "
        "which gathers into one flat tensor of the whole output before copying it into the "
        "chunks. The fix was found on it (and on tiny-llama-2l lora x2 fp32 1x128, measured "
        "then), so the holdout cases, drawn after it, are the check; that one case is marked.",
        "",
        f"**Evaluation cases (seed {SEED})**",
        "",
        table(evaluation),
        "",
        _summary(evaluation),
        "",
        f"**Holdout cases (seed {HOLDOUT_SEED}, drawn after the fix)**",
        "",
        table(holdout),
        "",
        _summary(holdout),
    ]
    text = "\n".join(body).replace(f"| {SEEN} |", f"| {SEEN} (seen) |")
    print(text)
    if not args.no_write:
        held = (
            f"the holdout cases (`random.Random({HOLDOUT_SEED})`, drawn after the fix) but the "
            "one marked seen; the evaluation cases were drawn before any result was seen, but "
            "the fix was found on them."
        )
        write_section("fsdp1", text, held_out=held)


if __name__ == "__main__":
    main()
