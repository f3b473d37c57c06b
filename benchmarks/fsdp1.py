"""FSDP1 per rank: the trace (``--fsdp-version 1``: FullyShardedDataParallel under a fake
process group) against real CPU ranks under torchrun (gloo), wrapped as accelerate wraps them.

Cases are drawn at random from ``SEED`` (20261128, fixed before any FSDP1 result was looked at)
over two 2-layer configs (``configs/tiny-*-2l.json``), full fine-tuning and LoRA, precision,
ranks (2 or 4), micro-batch and sequence; their LoRA keeps its frozen base in fp32. LoRA wraps
each adapter leaf (lora_A, lora_B) in its own FlatParameter, as peft's ``fsdp_auto_wrap_policy``
(which transformers' Trainer installs), so the layer's flat parameter holds only frozen weights
and may be 16-bit: the AMP LoRA cases (``AMP_LORA_SEED``, 20261130, fixed before any of them was
measured) train LoRA over a bf16 base and QLoRA (4-bit codes stored in bf16, as
``bnb_4bit_quant_storage``) under amp-bf16, each at 2 and 4 ranks. Truth:
``_fsdp_truth.py`` on every rank (VmHWM after three steps), rank 0's and the largest; the trace
is one rank. The FSDP2 trace of the same case is printed beside it; the AMP LoRA cases are also
run with ``fully_shard`` (FSDP2) on the real ranks, against that trace.

Truths are kept in ``data/fsdp1_truth.json`` (an FSDP2 one under its case's name + " fsdp2")
and measured again only with ``--remeasure`` or ``--remeasure-only``.

    python benchmarks/fsdp1.py [--no-write] [--remeasure | --remeasure-only SUBSTR] [--cases N]

``--remeasure-only SUBSTR`` measures again the cases whose name holds ``SUBSTR`` (``" lora x"``: the
evaluation and holdout LoRA cases).
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
# LoRA over a 16-bit frozen base and QLoRA under FSDP1, drawn after each LoRA leaf became its own
# FlatParameter; fixed before any of these cases was measured
AMP_LORA_SEED = 20261130
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


def draw_amp_lora(seed: int = AMP_LORA_SEED) -> list[dict[str, Any]]:
    """LoRA (bf16 frozen base) and QLoRA under amp-bf16, each at 2 and 4 ranks; the model,
    micro-batch and sequence drawn from ``seed``."""
    rng = random.Random(seed)
    cases = []
    for method in ("lora", "qlora"):
        for ranks in (2, 4):
            setup: dict[str, Any] = {
                "sharding": "fsdp",
                "fsdp_version": 1,
                "method": method,
                "precision": "amp-bf16",
            }
            if method == "lora":
                setup["frozen_dtype"] = "bf16"
            cases.append(
                {
                    "model": str(HERE / "configs" / rng.choice(CONFIGS)),
                    "setup": setup,
                    "ranks": ranks,
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
    base = s.get("frozen_dtype", "fp32")
    method = s["method"] if base in ("fp32", "auto") else f"{s['method']} ({base} base)"
    return f"{name} {method} x{case['ranks']} {s['precision']} {case['micro']}x{case['seq']}"


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


def table_fsdp2(rows: list[dict[str, Any]]) -> str:
    """The same cases wrapped with ``fully_shard`` (FSDP2) on the real ranks, vs its trace."""
    lines = [
        "| case | real FSDP2 rank 0 MiB | real FSDP2 max rank MiB | FSDP2 trace MiB "
        "| error vs rank 0 | error vs max |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        t0, tmax, est = r["truth2"][0], max(r["truth2"]), r["fsdp2"]
        lines.append(
            f"| {r['name']} | {t0 / MIB:,.1f} | {tmax / MIB:,.1f} | {est / MIB:,.1f} | "
            f"{(est - t0) / t0:+.1%} | {(est - tmax) / tmax:+.1%} |"
        )
    return "\n".join(lines)


def _rows(
    cases: list[dict[str, Any]], remeasure: str | None, fsdp2: bool = False
) -> list[dict[str, Any]]:
    """Each case's truth (cached; measured again where its name holds ``remeasure``, every
    case for ``""``) and traces; with ``fsdp2`` the FSDP2 truth too (``truth2``)."""
    known = json.loads(TRUTHS.read_text()) if TRUTHS.exists() else {}
    rows = []
    for case in cases:
        start = time.perf_counter()
        name = describe(case)
        if (remeasure is not None and remeasure in name) or name not in known:
            known[name] = truth(case)
            TRUTHS.write_text(json.dumps(known, indent=1) + "\n")
        row = {"name": name, "truth": known[name], "trace": traced(case, 1)}
        if fsdp2:
            key = f"{name} fsdp2"
            if (remeasure is not None and remeasure in key) or key not in known:
                known[key] = truth({**case, "setup": {**case["setup"], "fsdp_version": 2}})
                TRUTHS.write_text(json.dumps(known, indent=1) + "\n")
            row["truth2"] = known[key]
        row["fsdp2"] = traced(case, 2)
        row["seconds"] = time.perf_counter() - start
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def _summary(rows: list[dict[str, Any]], version: int = 1) -> str:
    est, real = ("trace", "truth") if version == 1 else ("fsdp2", "truth2")
    errs = [abs(r[est] - r[real][0]) / r[real][0] for r in rows]
    return (
        f"FSDP{version} trace vs rank 0: median {statistics.median(errs):.1%}, "
        f"worst {max(errs):.1%}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-write", action="store_true")
    how = ap.add_mutually_exclusive_group()
    how.add_argument("--remeasure", action="store_const", const="", dest="remeasure")
    how.add_argument("--remeasure-only", metavar="SUBSTR", dest="remeasure")
    ap.add_argument("--cases", type=int, default=6)
    args = ap.parse_args()
    os.environ.setdefault("BATCHFIT_NO_CACHE", "1")
    evaluation = _rows(draw(args.cases), args.remeasure)
    holdout = _rows(draw(4, HOLDOUT_SEED), args.remeasure)
    amp_lora = _rows(draw_amp_lora(), args.remeasure, fsdp2=True)
    body = [
        "FSDP1 per rank: real CPU ranks under torchrun (gloo), each decoder layer and the root "
        "wrapped in `FullyShardedDataParallel` as accelerate wraps them (`use_orig_params=True`, "
        "FULL_SHARD, BACKWARD_PRE, accelerate's `MixedPrecision` and fp32 upcast under AMP), and "
        "with LoRA each adapter leaf (lora_A, lora_B) its own unit, as peft's "
        "`fsdp_auto_wrap_policy` (which transformers' Trainer installs for a PEFT model), vs the "
        "trace of one rank (`--fsdp-version 1`; truth = VmHWM after three steps). The last "
        "column is the FSDP2 trace of the same case: what the estimate said before FSDP1 was "
        "a setup. The evaluation and holdout LoRA cases keep their frozen base in fp32 (drawn "
        "when the adapters shared the layer's FlatParameter, which holds one dtype); their "
        "truths were measured again when the adapters became their own units (rank 0 before: "
        "183.4, 146.9 and 167.9 MiB, the trace then -0.2%, -0.3% and -0.2%).",
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
        "",
        f"**AMP LoRA and QLoRA cases (seed {AMP_LORA_SEED}, held out)**",
        "",
        "With each adapter its own unit the decoder layer's FlatParameter holds only frozen "
        "weights, so it may be 16-bit under AMP: LoRA over a bf16 base, and QLoRA with its 4-bit "
        "codes stored in bf16 (`bnb_4bit_quant_storage`, as the FSDP-QLoRA recipes; the "
        "emulated 4-bit layer of `_nf4.py`), both under amp-bf16, each at 2 and 4 ranks; the "
        "model, micro-batch and sequence drawn from the seed, fixed before any was measured.",
        "",
        table(amp_lora),
        "",
        _summary(amp_lora),
        "",
        "The same cases wrapped with `fully_shard` (FSDP2) on the real ranks:",
        "",
        table_fsdp2(amp_lora),
        "",
        _summary(amp_lora, 2),
    ]
    text = "\n".join(body).replace(f"| {SEEN} |", f"| {SEEN} (seen) |")
    print(text)
    if not args.no_write:
        held = (
            f"the holdout cases (`random.Random({HOLDOUT_SEED})`, drawn after the fix) but the "
            "one marked seen; the evaluation cases were drawn before any result was seen, but "
            "the fix was found on them; the AMP LoRA and QLoRA cases "
            f"(`random.Random({AMP_LORA_SEED})`), drawn and fixed before any was measured."
        )
        write_section("fsdp1", text, held_out=held)


if __name__ == "__main__":
    main()
