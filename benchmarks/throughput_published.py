"""Predicted vs published training throughput .

Every run in benchmarks/data/published_throughput.json is a published tokens/s per GPU figure
with the setup that produced it (source, quote, the framework's config) and the batchfit
options it maps onto. This script asks `batchfit estimate --json` for each run and compares
`tokens_per_s_per_gpu` with the published figure, separately for the calibration half and the
evaluation half of the runs (drawn with random.Random(20261126) before any error was seen, and
written into the JSON; the script refuses to run if the recorded split differs from the draw).

A run batchfit does not predict yet (`tokens_per_s_per_gpu` null: several GPUs, offload) is
listed as "not predicted" and counted apart. Options this batchfit does not know yet (for
example `--compile` or `--grad-ckpt-every` before they land) are dropped and the row says so,
so the table can be re-run unchanged as the time model grows. Runs marked `comparable: false`
(fp8) are listed apart, never counted.

The time model does not depend on the memory engine (the same step_seconds from `trace` and
`analytic`), so `--engine analytic` is the default here: the whole table takes seconds.

    python benchmarks/throughput_published.py [--engine analytic|trace] [--no-write] [--json OUT]
                                              [--set published|classes]

`--set classes` runs the second set (benchmarks/data/published_throughput_classes.json, split
with its own seed) and adds a table per class and per pair of methods (full vs LoRA, LoRA vs
QLoRA on one model and GPU: the published ratio against the predicted one).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from _report import write_section  # noqa: E402

DATA = HERE / "data" / "published_throughput.json"
SECTION = "throughput-published"
# the second set: runs by class (LoRA, QLoRA, MoE, small models, long sequences, ...), with
# pairs of methods on one model and GPU; its own split and section
CLASSES = HERE / "data" / "published_throughput_classes.json"
CLASSES_SECTION = "throughput-classes"
# the targets, per half
TARGET_MEDIAN = 0.15
TARGET_WORST = 0.35


def _batchfit() -> list[str]:
    exe = Path(sys.executable).parent / "batchfit"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "batchfit"]


def known_options() -> set[str]:
    """The long options `batchfit estimate` accepts now (read from its --help)."""
    out = subprocess.run(
        [*_batchfit(), "estimate", "--help"], capture_output=True, text=True, cwd=ROOT, check=True
    ).stdout
    return set(re.findall(r"(--[a-z0-9][a-z0-9-]*)", out))


def split_args(args: list[str], known: set[str]) -> tuple[list[str], list[str]]:
    """(kept, dropped): an unknown option is dropped with its value (a token not starting --)."""
    kept: list[str] = []
    dropped: list[str] = []
    i = 0
    while i < len(args):
        token = args[i]
        takes_value = i + 1 < len(args) and not args[i + 1].startswith("--")
        group = args[i : i + 2] if takes_value else [token]
        (kept if token in known else dropped).extend(group)
        i += len(group)
    return kept, dropped


def check_split(runs: list[dict[str, Any]], seed: int) -> None:
    """The recorded halves must be the draw: shuffle the sorted ids, first half calibration."""
    order = sorted(r["id"] for r in runs)
    random.Random(seed).shuffle(order)
    calibration = set(order[: len(order) // 2])
    for r in runs:
        want = "calibration" if r["id"] in calibration else "evaluation"
        if r.get("split") != want:
            raise SystemExit(f"{r['id']}: split {r.get('split')!r} differs from the draw ({want})")


def predict(run: dict[str, Any], known: set[str], engine: str) -> dict[str, Any]:
    bf = run["batchfit"]
    kept, dropped = split_args(bf["args"], known)
    cmd = [
        *_batchfit(),
        "estimate",
        bf["model"],
        "--gpu",
        bf["gpu"],
        "--micro-batch",
        str(bf["micro_batch_size"]),
        "--seq-len",
        str(bf["seq_len"]),
        "--grad-accum",
        str(bf["grad_accum_steps"]),
        "--engine",
        engine,
        "--json",
        *kept,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    result: dict[str, Any] = {"id": run["id"], "dropped": dropped, "command": cmd[1:]}
    if proc.returncode != 0:
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        result["error"] = lines[-1] if lines else f"exit {proc.returncode}"
        result["predicted"] = None
        return result
    out = json.loads(proc.stdout)
    result["predicted"] = out.get("tokens_per_s_per_gpu")
    result["mfu"] = out.get("mfu")
    result["step_seconds"] = out.get("step_seconds")
    return result


def _pct(x: float) -> str:
    return f"{x * 100:+.0f}%"


def _setup(run: dict[str, Any]) -> str:
    s = run["setup"]
    bf = run["batchfit"]
    parts = [
        f"{s.get('num_gpus', 1)}x {bf['gpu']}",
        f"b{bf['micro_batch_size']} s{bf['seq_len']}",
    ]
    if bf["grad_accum_steps"] > 1:
        parts.append(f"ga{bf['grad_accum_steps']}")
    args = bf["args"]
    for flag, label in (
        ("--sharding", None),
        ("--precision", None),
        ("--method", None),
        ("--offload", "offload"),
    ):
        if flag in args:
            value = args[args.index(flag) + 1]
            parts.append(f"{label} {value}" if label else value)
    if "--grad-ckpt-every" in args:
        parts.append(f"ckpt/{args[args.index('--grad-ckpt-every') + 1]}")
    elif "--grad-ckpt" in args:
        parts.append("ckpt")
    if "--compile" in args:
        parts.append("compile")
    return ", ".join(parts)


def _source(run: dict[str, Any]) -> str:
    url = run["source"]
    name = url.split("github.com/")[1].split("/blob/")[0] if "github.com/" in url else url
    return f"[{name}]({url})"


def table(runs: list[dict[str, Any]], results: dict[str, dict[str, Any]]) -> list[str]:
    lines = [
        "| run | source | setup (batchfit) | published tok/s/GPU | predicted | error | "
        "published MFU | note |",
        "|---|---|---|---:|---:|---:|---:|---|",
    ]
    for run in runs:
        res = results[run["id"]]
        pub = run["published_tokens_per_s_per_gpu"]
        pred = res["predicted"]
        notes = []
        if pub != run["published"]["value"]:
            notes.append(f"published {run['published']['value']:,} converted (see JSON)")
        if res["dropped"]:
            notes.append("not in this batchfit yet: " + " ".join(res["dropped"]))
        if res.get("error"):
            notes.append("error: " + res["error"].replace("|", "/"))
        if pred is None:
            cells = "not predicted", "—", "—"
        else:
            # the published figure in batchfit's MFU convention (its model FLOPs a token and
            # the catalog's dense peak): above ~0.7 the setup or the figure is suspect
            implied = f"{res['mfu'] * pub / pred:.2f}" if res.get("mfu") else "—"
            cells = f"{pred:,.0f}", _pct(pred / pub - 1), implied
        lines.append(
            f"| {run['id']} | {_source(run)} | {_setup(run)} | {pub:,.0f} | {cells[0]} | "
            f"{cells[1]} | {cells[2]} | {'; '.join(notes)} |"
        )
    return lines


def summary(name: str, runs: list[dict[str, Any]], results: dict[str, dict[str, Any]]) -> str:
    errors = [
        results[r["id"]]["predicted"] / r["published_tokens_per_s_per_gpu"] - 1
        for r in runs
        if results[r["id"]]["predicted"] is not None
    ]
    missing = len(runs) - len(errors)
    if not errors:
        return f"**{name}**: {len(runs)} runs, none predicted yet."
    absolute = [abs(e) for e in errors]
    median = statistics.median(absolute)
    worst = max(errors, key=abs)
    verdict = (
        "meets"
        if median <= TARGET_MEDIAN and abs(worst) <= TARGET_WORST and not missing
        else "misses"
    )
    return (
        f"**{name}**: {len(errors)} of {len(runs)} runs predicted ({missing} not predicted); "
        f"median |error| {median * 100:.0f}%, worst {_pct(worst)}, mean signed error "
        f"{_pct(statistics.mean(errors))} — {verdict} the target (median ≤ "
        f"{TARGET_MEDIAN * 100:.0f}%, worst ≤ {TARGET_WORST * 100:.0f}%, every run predicted)."
    )


def misses(
    runs: list[dict[str, Any]], results: dict[str, dict[str, Any]], explained: dict[str, Any]
) -> list[str]:
    """One line per counted run whose |error| is above the median target, with the cause and
    the evidence recorded in the data file's ``misses`` (read from the code and the source that
    produced the figure); a miss with none recorded says so."""
    lines = []
    for run in runs:
        pred = results[run["id"]]["predicted"]
        if pred is None:
            continue
        error = pred / run["published_tokens_per_s_per_gpu"] - 1
        if abs(error) <= TARGET_MEDIAN:
            continue
        why = explained.get(run["id"])
        head = f"- **{run['id']}** ({run['split']}, {_pct(error)}):"
        if why is None:
            lines.append(f"{head} not explained yet.")
            continue
        lines.append(f"{head} {why['cause']}. Evidence: {why['evidence']}. Model: {why['model']}.")
    return lines


def _error(run: dict[str, Any], results: dict[str, dict[str, Any]]) -> float | None:
    pred = results[run["id"]]["predicted"]
    return None if pred is None else pred / run["published_tokens_per_s_per_gpu"] - 1


def by_class(runs: list[dict[str, Any]], results: dict[str, dict[str, Any]]) -> list[str]:
    """Median and worst |error| per class and half."""
    lines = [
        "| class | half | runs predicted | median abs error | worst |",
        "|---|---|---:|---:|---:|",
    ]
    for name in sorted({r["class"] for r in runs}):
        for half in ("calibration", "evaluation", "both"):
            members = [r for r in runs if r["class"] == name and half in (r["split"], "both")]
            errors = [e for e in (_error(r, results) for r in members) if e is not None]
            if not errors:
                continue
            median = statistics.median(abs(e) for e in errors)
            worst = max(errors, key=abs)
            lines.append(
                f"| {name} | {half} | {len(errors)} of {len(members)} | {median * 100:.0f}% | "
                f"{_pct(worst)} |"
            )
    return lines


def pairs(runs: list[dict[str, Any]], results: dict[str, dict[str, Any]]) -> list[str]:
    """Each pair of methods on one model and GPU: the published throughput ratio against the
    predicted one (the second run over the first, in the file's order)."""
    lines = [
        "| pair | runs | published ratio | predicted ratio | predicted / published |",
        "|---|---|---:|---:|---:|",
    ]
    groups: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        if run.get("pair"):
            groups.setdefault(run["pair"], []).append(run)
    for name, members in groups.items():
        first = members[0]
        for other in members[1:]:
            pub = other["published_tokens_per_s_per_gpu"] / first["published_tokens_per_s_per_gpu"]
            a, b = results[first["id"]]["predicted"], results[other["id"]]["predicted"]
            if a is None or b is None:
                continue
            lines.append(
                f"| {name} | {other['id']} / {first['id']} | {pub:.2f} | {b / a:.2f} | "
                f"{_pct(b / a / pub - 1)} |"
            )
    return lines


def report(
    doc: dict[str, Any], results: dict[str, dict[str, Any]], engine: str, classes: bool = False
) -> str:
    runs = doc["runs"]
    comparable = [r for r in runs if r["comparable"]]
    apart = [r for r in runs if not r["comparable"]]
    sources = sorted({_source(r).split("]")[0] for r in runs})
    data = (CLASSES if classes else DATA).relative_to(ROOT)
    out = [
        "## Throughput by class: predicted vs published"
        if classes
        else "## Throughput: predicted vs published",
        "",
        f"`python benchmarks/throughput_published.py{' --set classes' if classes else ''}` — "
        f"{len(runs)} published runs from {len(sources)} sources (`{data}`: each run's quote, "
        "setup, the config that produced it and what did not map onto batchfit's options). "
        f"Predicted with `batchfit estimate --engine {engine} --json` (`tokens_per_s_per_gpu`; "
        "the time model is the same under either engine). Error = predicted / published − 1. "
        f"The halves were drawn with `random.Random({doc['split_seed']})` before any error was "
        "seen: the time model may be calibrated on the first, and is checked on the second.",
        "",
    ]
    for half in ("calibration", "evaluation"):
        members = [r for r in comparable if r["split"] == half]
        out += [f"### {half.capitalize()} half", "", summary(half, members, results), ""]
        out += [*table(members, results), ""]
    if classes:
        out += ["### By class", "", *by_class(comparable, results), ""]
        out += ["### Pairs of methods on one model and GPU", "", *pairs(comparable, results), ""]
    missed = misses(comparable, results, doc.get("misses", {}))
    if missed:
        out += [
            "### Misses explained",
            "",
            f"Every counted run with |error| above {TARGET_MEDIAN * 100:.0f}%, with what the "
            "framework's code and the source say causes it (`misses` in the data file), and "
            "whether batchfit's time model counts it.",
            "",
            *missed,
            "",
        ]
    if apart:
        out += [
            "### Not comparable (listed, never counted)",
            "",
            "What dominates their time is outside batchfit's options:",
            "",
        ]
        out += table(apart, results)
        out += [""]
        out += [f"- {r['id']}: {'; '.join(r['unmapped'][:1])}" for r in apart]
        out += [""]
    out += [
        "Setup: GPUs x catalog GPU, micro-batch b and sequence s, ga = accumulation steps, "
        "ckpt = full checkpointing, ckpt/K = every K-th layer. Published MFU = the published "
        "figure in batchfit's convention (6 x matmul parameters + attention a token, 4 x under "
        "LoRA, over the catalog's dense peak; recompute not counted). What each run does that "
        "batchfit does not model (fused kernels, selective op-level checkpointing, HSDP, packing, "
        "a power-capped H100) is in its `unmapped` list in the JSON.",
    ]
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", default="analytic", choices=("analytic", "trace"))
    parser.add_argument("--no-write", action="store_true", help="print, do not touch docs/")
    parser.add_argument("--json", type=Path, help="also write every prediction to this file")
    parser.add_argument("--set", default="published", choices=("published", "classes"))
    args = parser.parse_args()
    classes = args.set == "classes"

    doc = json.loads((CLASSES if classes else DATA).read_text())
    check_split(doc["runs"], doc["split_seed"])
    known = known_options()
    with ThreadPoolExecutor(max_workers=2) as pool:
        predictions = list(pool.map(lambda r: predict(r, known, args.engine), doc["runs"]))
    results = {p["id"]: p for p in predictions}
    text = report(doc, results, args.engine, classes)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(predictions, indent=1, allow_nan=False) + "\n")
    if not args.no_write:
        write_section(CLASSES_SECTION if classes else SECTION, text)


if __name__ == "__main__":
    main()
