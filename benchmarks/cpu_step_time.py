"""Predicted vs measured CPU training step time across micro-batch sizes .

The probe's two models (``search_vs_peers.py``: the GPT-2-like one the probe was developed
against, seq 256, and the Llama-like one held out from it, seq 512) and six small generalisation
configs (``benchmarks/configs/gen-*-small.json``, seq 128), each trained for real on this machine
at micro-batch sizes 1, 2, 4, 8 and 16: fp32, AdamW (PyTorch's per-parameter loop, the CPU
default), the trainer loop (only the loss outlives forward). The model is built once per model,
one warm-up step at micro-batch 1 makes the optimizer state; then a new optimizer per size
(its state made by its first step) and ``--steps`` optimizer steps at each size (forward,
backward, ``optimizer.step()``, ``zero_grad``). Truth: their median.

Timed on ``--threads`` threads (default 1) in CPU time, not wall time: this machine's 2 cores
are shared with other work, and measured there, with the load average at 5, a 2-thread step of
the probe's GPT-2 (micro-batch 1) took 11-14 s of wall time where one thread takes 2.1 s of CPU
time (5 s of wall time). One thread's CPU time is what that step costs a core of its own.

Prediction: ``batchfit.speed.step_time`` with this machine's CPU profile on as many threads
(``catalog/cpus.json``, measured by ``scripts/measure_cpu_profile.py`` in CPU time too).
Error = predicted / measured - 1.

The models were split into a calibration half and an evaluation half by
``random.Random(20261126)`` over their sorted names, fixed (``SPLIT``) before any step was timed;
the script refuses to run if the recorded split differs from the draw. The CPU time model's
fitted coefficients (``batchfit.speed._cpu``) come from ``--fit`` over the calibration half only.
About 9 minutes of CPU time (wall time grows with what else runs on the machine).

    python benchmarks/cpu_step_time.py [--steps 3] [--threads 1] [--no-write] [--from-json]
        [--fit] [--cpu NAME]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _report import write_section  # noqa: E402

DATA = HERE / "data" / "cpu_step_time.json"
SECTION = "cpu-step-time"
SEED = 20261126
MICRO_BATCHES = (1, 2, 4, 8, 16)

# name -> (config: a path under benchmarks/configs or a dict, seq, description)
MODELS: dict[str, tuple[str | dict[str, Any], int, str]] = {
    "probe-gpt2-6l": (
        {
            "model_type": "gpt2",
            "architectures": ["GPT2LMHeadModel"],
            "n_layer": 6,
            "n_embd": 768,
            "n_head": 12,
            "vocab_size": 50257,
            "n_positions": 1024,
        },
        256,
        "the probe's seen model (GPT-2-like, 6 layers, width 768)",
    ),
    "probe-llama-8l": (
        {
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": 512,
            "intermediate_size": 1408,
            "num_hidden_layers": 8,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "vocab_size": 32000,
            "max_position_embeddings": 2048,
            "tie_word_embeddings": False,
        },
        512,
        "the probe's unseen model (Llama-like, 8 layers, width 512, GQA)",
    ),
    "gen-gpt2-small": ("gen-gpt2-small.json", 128, "GPT-2, 4 layers, width 512"),
    "gen-llama-gqa-small": ("gen-llama-gqa-small.json", 128, "Llama GQA, 4 layers, width 576"),
    "gen-opt-small": ("gen-opt-small.json", 128, "OPT, 4 layers, width 512"),
    "gen-bert-small": ("gen-bert-small.json", 128, "BERT masked LM, 4 layers, width 512"),
    "gen-pythia-small": ("gen-pythia-small.json", 128, "GPT-NeoX, 4 layers, width 512"),
    "gen-qwen2-tied-small": (
        "gen-qwen2-tied-small.json",
        128,
        "Qwen2, 3 layers, width 384, 152k vocabulary (tied)",
    ),
}
# Drawn by draw_split() and written here before any step was timed.
SPLIT = {
    "gen-bert-small": "evaluation",
    "gen-gpt2-small": "calibration",
    "gen-llama-gqa-small": "calibration",
    "gen-opt-small": "evaluation",
    "gen-pythia-small": "evaluation",
    "gen-qwen2-tied-small": "calibration",
    "probe-gpt2-6l": "calibration",
    "probe-llama-8l": "evaluation",
}


def draw_split() -> dict[str, str]:
    """Shuffle the sorted names with the seed: the first half calibrates, the rest evaluates."""
    order = sorted(MODELS)
    random.Random(SEED).shuffle(order)
    calibration = set(order[: len(order) // 2])
    return {n: ("calibration" if n in calibration else "evaluation") for n in sorted(MODELS)}


def config_path(name: str, tmp: Path) -> Path:
    config = MODELS[name][0]
    if isinstance(config, str):
        return HERE / "configs" / config
    path = tmp / name / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config))
    return path


def setup_for() -> Any:
    from batchfit.spec import TrainingSetup

    return TrainingSetup(precision="fp32", optimizer="adamw").resolved(
        device="cpu", bf16_supported=True
    )


def measure_model(name: str, tmp: Path, steps: int) -> list[dict[str, Any]]:
    """Real step times of one model at every micro-batch size."""
    import torch
    from _truth import train

    from batchfit.memory.trace import hf as _hf_trace
    from batchfit.models import resolve_model

    torch.manual_seed(0)
    info = resolve_model(config_path(name, tmp))
    seq, setup = MODELS[name][1], setup_for()
    built = None
    rows = []
    for micro in MICRO_BATCHES:
        load_before = os.getloadavg()[0]
        parts = _hf_trace.step_parts(
            info, setup, micro=micro, seq=seq, emulate_cuda=False, built=built
        )
        built = parts.model
        if micro == MICRO_BATCHES[0]:  # the optimizer state, kernels, thread pool
            train(
                parts.model, parts.optimizer, parts.make_batch, parts.autocast_dtype, "trainer", 1
            )
        cpu, wall = [], []
        for _ in range(steps):
            start_cpu, start_wall = time.process_time(), time.perf_counter()
            train(
                parts.model, parts.optimizer, parts.make_batch, parts.autocast_dtype, "trainer", 1
            )
            cpu.append(time.process_time() - start_cpu)
            wall.append(time.perf_counter() - start_wall)
        rows.append(
            {
                "model": name,
                "micro_batch_size": micro,
                "seq_len": seq,
                "cpu_seconds": cpu,
                "wall_seconds": wall,
                "median_seconds": statistics.median(cpu),
                "min_seconds": min(cpu),
                "median_wall_seconds": statistics.median(wall),
                "load_before": load_before,
                "load_after": os.getloadavg()[0],
            }
        )
        print(
            f"{name} b{micro} s{seq}: median {rows[-1]['median_seconds']:.3f} CPU s "
            f"(steps {', '.join(f'{s:.3f}' for s in cpu)}; wall "
            f"{rows[-1]['median_wall_seconds']:.3f}; load {load_before:.1f})",
            flush=True,
        )
        del parts
    return rows


def measure_all(steps: int, threads: int) -> dict[str, Any]:
    import torch

    from batchfit.hardware import cpu_model_name

    torch.set_num_threads(threads)
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in MODELS:
            rows.extend(measure_model(name, Path(tmp), steps))
    return {
        "cpu_model_name": cpu_model_name(),
        "threads": threads,
        "torch": torch.__version__,
        "steps": steps,
        "wall_seconds": time.perf_counter() - started,
        "rows": rows,
    }


def predict_rows(data: dict[str, Any], cpu_name: str | None) -> list[dict[str, Any]]:
    from batchfit.hardware import get_cpu, host_cpu
    from batchfit.models import resolve_model
    from batchfit.speed import step_time
    from batchfit.speed._cpu import cpu_terms

    cpu = get_cpu(cpu_name) if cpu_name else host_cpu(data["threads"])
    if cpu is None:
        raise SystemExit(
            f"no CPU profile for this machine on {data['threads']} threads: run "
            f"scripts/measure_cpu_profile.py --threads {data['threads']}, or give --cpu NAME"
        )
    setup = setup_for()
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        infos = {n: resolve_model(config_path(n, Path(tmp))) for n in MODELS}
        for row in data["rows"]:
            info, micro, seq = infos[row["model"]], row["micro_batch_size"], row["seq_len"]
            t = step_time(info, setup, cpu, micro_batch_size=micro, seq_len=seq)
            predicted = t.step_seconds() if t is not None else None
            terms = cpu_terms(info, setup, cpu, micro_batch_size=micro, seq_len=seq)
            out.append(
                {
                    **row,
                    "split": SPLIT[row["model"]],
                    "predicted_seconds": predicted,
                    "terms": terms,
                    "cpu": cpu.name,
                }
            )
    return out


def fit(rows: list[dict[str, Any]]) -> dict[str, float]:
    """The CPU coefficients by least squares on relative error, calibration half only; a
    coefficient that comes out negative (no physical meaning) is held at 0 and the rest refit."""
    import numpy as np

    from batchfit.speed._cpu import FEATURES

    cal = [r for r in rows if r["split"] == "calibration"]
    x = np.array([[r["terms"][f] for f in FEATURES] for r in cal])
    fixed = np.array([r["terms"]["optimizer_seconds"] for r in cal])
    y = np.array([r["median_seconds"] for r in cal])
    weights = 1.0 / y
    active = list(range(len(FEATURES)))
    while True:
        coef, *_ = np.linalg.lstsq(
            x[:, active] * weights[:, None], (y - fixed) * weights, rcond=None
        )
        if coef.min() >= 0:
            break
        del active[int(coef.argmin())]
    out = dict.fromkeys(FEATURES, 0.0)
    out.update({FEATURES[i]: float(c) for i, c in zip(active, coef, strict=True)})
    return out


def _pct(x: float) -> str:
    return f"{x * 100:+.0f}%"


def summary(rows: list[dict[str, Any]], half: str) -> tuple[str, list[float]]:
    errors = [
        r["predicted_seconds"] / r["median_seconds"] - 1
        for r in rows
        if r["split"] == half and r["predicted_seconds"]
    ]
    worst = max(errors, key=abs)
    models = sorted({r["model"] for r in rows if r["split"] == half})
    line = (
        f"**{half}** ({', '.join(models)}): {len(errors)} cases; median |error| "
        f"{statistics.median(abs(e) for e in errors) * 100:.0f}%, worst {_pct(worst)}, "
        f"mean signed error {_pct(statistics.fmean(errors))}"
    )
    return line, errors


def table(rows: list[dict[str, Any]], half: str) -> list[str]:
    lines = [
        "| model | seq | micro-batch | measured CPU s (median) | fastest | wall s | predicted s "
        "| error | load |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if r["split"] != half:
            continue
        err = r["predicted_seconds"] / r["median_seconds"] - 1
        lines.append(
            f"| {r['model']} | {r['seq_len']} | {r['micro_batch_size']} | "
            f"{r['median_seconds']:.3f} | {r['min_seconds']:.3f} | "
            f"{r['median_wall_seconds']:.2f} | {r['predicted_seconds']:.3f} | {_pct(err)} | "
            f"{r['load_before']:.1f}-{r['load_after']:.1f} |"
        )
    return lines


def report(data: dict[str, Any], rows: list[dict[str, Any]], notes: list[str]) -> str:
    cpu = rows[0]["cpu"]
    threads = data["threads"]
    body = [
        "## CPU step time: predicted vs measured",
        "",
        "`python benchmarks/cpu_step_time.py` — real fp32 AdamW training steps (trainer loop, "
        "PyTorch's per-parameter AdamW, the CPU default) on this machine "
        f"({data['cpu_model_name']}, {threads} thread{'s' if threads > 1 else ''}, torch "
        f"{data['torch']}; {data['wall_seconds'] / 60:.0f} min of wall time) against "
        f"`batchfit.speed.step_time` with the catalog CPU profile `{cpu}` "
        "(`catalog/cpus.json`, measured here by `scripts/measure_cpu_profile.py`). Measured: "
        f"the median CPU time of {data['steps']} optimizer steps at each size (the fastest "
        "beside it, and the median wall time), after one warm-up step per model. CPU time, "
        "not wall time, because this machine's 2 cores are shared with other work (*load*: "
        "the 1-minute load average before and after the size): wall time here measures the "
        "neighbours. Error = predicted / measured − 1. The models were split by "
        "`random.Random(20261126)` before any step was timed; the CPU coefficients "
        "(`batchfit.speed._cpu`) were fitted on the calibration half only "
        "(`--fit`, least squares on relative error).",
        "",
    ]
    for half in ("calibration", "evaluation"):
        line, _ = summary(rows, half)
        body += [f"### {half.capitalize()} half", "", line, "", *table(rows, half), ""]
    body += ["Models:", ""]
    for name, (_, seq, text) in MODELS.items():
        body.append(f"- {name}: {text}, seq {seq} ({SPLIT[name]})")
    if notes:
        body += ["", *notes]
    return "\n".join(body) + "\n"


# What the tables above mean, written after this run (re-read them if the numbers move).
NOTES: list[str] = [
    "The model (`batchfit.speed._cpu`): per micro-step, FLOPs (the same count as on a GPU) / "
    "(profile's fp32 matmul rate x 0.636) x (1 + 64 / tokens in the micro-step) + 30 4-byte "
    "passes over each layer's width and the logits per token / the profile's bandwidth; per "
    "optimizer step, PyTorch's per-parameter AdamW loop streaming 20 4-byte accesses per "
    "parameter (counted from `torch/optim/adam.py`, not fitted) / the bandwidth. The three "
    "coefficients are the calibration half's least-squares fit; a per-layer launch term, as on "
    "a GPU, came out negative there and was left out.",
    "",
    "- **A bug the evaluation half found.** The first report of this same run had gen-bert-small "
    "at −23% to −41% (evaluation median 16%, worst −41%): the FLOPs left out BERT's tied MLM "
    "decoder (30522 x 512), because a masked LM's head group (the transform: a dense layer, a "
    "norm, the decoder's bias) was taken for an untied output matrix. Fixed in "
    "`batchfit.speed._step._matmul_params`, for GPUs too (`gpus bert-base-uncased`: hours per "
    "billion tokens +23%, the one plan golden that moved). No coefficient was refitted: no "
    "calibration model has such a head.",
    "- **Misses left.** The evaluation half's 4-layer, width-512 models at seq 128 (OPT, "
    "Pythia, BERT) are over-predicted, +4% to +33% (gen-opt-small at micro-batch 2 the worst), "
    "while the calibration half's model of the same shape, gen-gpt2-small, sits at +4% to +15% "
    "and gen-qwen2-tied-small (a 152k vocabulary) at −11% to +15%: one term in the token count "
    "cannot give matmuls of every shape their own efficiency (a narrow MLP and a vocabulary-wide "
    "head differ). Steps also vary: the fastest of three is up to 21% below the median "
    "(gen-opt-small, micro-batch 1) with the load average at 7 — a shared core's CPU time still "
    "carries its neighbours' cache and memory-bandwidth traffic. The probe's held-out Llama "
    "model, the largest here, is within −4% to +10% at every size.",
    "- **Threads.** Measured on one thread. `batchfit estimate --device cpu` on this machine "
    "uses the 2-thread profile `intel-xeon-2t` (299.7 GFLOP/s fp32, 32.9 GB/s: CPU time over "
    "the threads, with OpenMP's waiting threads asleep, so it is the rate with each thread on a "
    "core of its own, an upper bound), with the same coefficients; no 2-thread step was checked "
    "against it, since with the load average at 5 a 2-thread step of probe-gpt2-6l took 11-14 s "
    "of wall time where one thread takes 2.1 s of CPU time.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--from-json", action="store_true", help="re-report the saved run")
    parser.add_argument("--fit", action="store_true", help="print the calibration-half fit")
    parser.add_argument("--cpu", default=None, help="catalog CPU profile (default: this host's)")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    if draw_split() != SPLIT:
        raise SystemExit(f"SPLIT differs from the draw: {draw_split()}")
    if args.from_json:
        data = json.loads(DATA.read_text())
    else:
        data = measure_all(args.steps, args.threads)
        if not args.no_write:
            DATA.write_text(json.dumps(data, indent=1) + "\n")
    rows = predict_rows(data, args.cpu)
    if args.fit:
        print(json.dumps(fit(rows), indent=1))
    text = report(data, rows, NOTES)
    print(text)
    if not args.no_write:
        write_section(SECTION, text)


if __name__ == "__main__":
    main()
