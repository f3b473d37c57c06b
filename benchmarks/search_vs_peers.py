"""batchfit's batch-size search against Lightning's and accelerate's finders, on a CPU budget.

One model (``--model seen``: a 6-layer GPT-2-like causal LM, seq 256; ``--model unseen``: an
8-layer Llama-like one, seq 512, chosen before the probe ever ran on it), fp32, AdamW, one
memory budget, every finder in a fresh process under the same OS limit (RLIMIT_DATA set in the
child before the model is built, after imports and a tiny warm-up step), all training the same
step (outputs alive through backward):

- batchfit: ``batchfit.search.probe.run_child`` with the spec ``batchfit probe`` builds (the start
  predicted in the child), ``choose="max"`` and, with ``--throughput``, ``"throughput"``;
- Lightning: ``Tuner(trainer).scale_batch_size(model, mode="binsearch" | "power")``, defaults
  (steps_per_trial=3, init_val=2, max_trials=25), the same HF model in a LightningModule;
- accelerate: ``find_executable_batch_size(starting_batch_size=128)`` around 3 training steps.

Truth: the largest micro-batch that runs one step (after a step at micro-batch 1, so the
optimizer state exists) in a fresh process under the limit, found by galloping from batchfit's
answer then bisecting, each probe a fresh process. Verified: the returned size trains
``--verify-steps`` steps in a fresh process under the limit, in the finder's environment.

    python benchmarks/search_vs_peers.py [--model seen|unseen] [--budget-gib G]
        [--verify-steps 20] [--throughput] [--peer-env fixed|glibc|both] [--timeout 420]
        [--no-write]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _report import write_section  # noqa: E402

CHILD = HERE / "_peer_child.py"
GIB = 1024**3
# "seen": the model the probe was developed against. "unseen": chosen, and its budget fixed,
# before the probe first ran on it; nothing was tuned on it afterwards.
MODELS: dict[str, dict[str, Any]] = {
    "seen": {
        "config": {
            "model_type": "gpt2",
            "architectures": ["GPT2LMHeadModel"],
            "n_layer": 6,
            "n_embd": 768,
            "n_head": 12,
            "vocab_size": 50257,
            "n_positions": 1024,
        },
        "text": "a GPT-2-like causal LM (model_type gpt2, 6 layers, n_embd 768, 12 heads, vocab "
        "50257, n_positions 1024)",
        "seq": 256,
        "budget_gib": 4.5,
    },
    "unseen": {
        "config": {
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
        "text": "a Llama-like causal LM (model_type llama, 8 layers, hidden 512, intermediate "
        "1408, 8 heads, 4 KV heads, vocab 32000, untied embeddings)",
        "seq": 512,
        "budget_gib": 3.0,
    },
}
SEQ = 256  # set from the model in main()
FIXED = "MALLOC_MMAP_THRESHOLD_=65536"
GLIBC = "glibc defaults"


@dataclass
class Run:
    """One finder's run: what it returned and what it cost."""

    finder: str
    env: str
    size: int | None
    steps: int | None
    ooms: int | None
    wall: float
    trials: list[list[Any]] = field(default_factory=list)  # [size, steps done, OOM]
    failure: str = ""  # "timed out after N s" or the error
    verified: str = "-"
    walls: list[float] = field(default_factory=list)  # every repeat's wall seconds

    def wall_text(self) -> str:
        if len(self.walls) < 2:
            return f"{self.wall:.0f}"
        return f"{self.wall:.0f} ({min(self.walls):.0f}-{max(self.walls):.0f})"


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def child_env(env: str) -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    out["HF_HUB_OFFLINE"] = "1"
    if env == FIXED:
        out["MALLOC_MMAP_THRESHOLD_"] = "65536"
    return out


def run_peer_child(
    spec: dict[str, Any], env: str, timeout: float
) -> tuple[Any, float, str, list[int]]:
    """(result or None, wall seconds, failure text, sizes attempted) of one child process."""
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, str(CHILD), json.dumps(spec)],
            capture_output=True,
            text=True,
            env=child_env(env),
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        attempts = [json.loads(x)["attempt"] for x in out.splitlines() if '"attempt"' in x]
        return None, time.perf_counter() - start, f"timed out after {timeout:.0f} s", attempts
    wall = time.perf_counter() - start
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith('{"result"'):
            return json.loads(line)["result"], wall, "", []
    tail = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"rc {proc.returncode}"
    return None, wall, f"failed: {tail[:200]}", []


def repeated(runs: list[Run]) -> Run:
    """The first run, with the median wall time of all (they take the same path or nearly)."""
    walls = sorted(r.wall for r in runs)
    first = runs[0]
    first.walls = walls
    first.wall = walls[len(walls) // 2]
    return first


def run_batchfit(config: str, budget: int, choose: str, steps: int = 3) -> Run:
    from batchfit.cli.app import _setup_dict
    from batchfit.search import probe as _probe
    from batchfit.spec import TrainingSetup

    start = time.perf_counter()
    setup = TrainingSetup()
    spec = {
        "model": config,
        "task": setup.task,
        "setup": _setup_dict(setup),
        "device": "cpu",
        "seq_len": SEQ,
        "memory_budget": budget,
        "choose": choose,
        "start": None,  # predicted in the child by the trace engine, as the CLI does
        "high": None,
        "steps_per_trial": steps,
    }

    def on_line(message: dict[str, Any]) -> None:
        if "start" in message:
            log(f"    batchfit predicted start {message['start']}")
            return
        t = message["trial"]
        log(f"    batchfit trial {t['micro_batch_size']}: {'ok' if t['ok'] else 'OOM'}")

    final = _probe.run_child(spec, on_line)
    wall = time.perf_counter() - start
    result = final["result"]
    trials = [[t["micro_batch_size"], t["steps"], not t["ok"]] for t in result["trials"]]
    # Step calls: the completed ones, and one per OOM trial (it failed partway through a step).
    return Run(
        f"batchfit probe (choose {choose}" + (f", {steps} steps a trial)" if steps != 3 else ")"),
        FIXED,
        result["micro_batch_size"],
        result["steps_run"] + result["ooms"],
        result["ooms"],
        wall,
        trials,
    )


def run_peer(config: str, budget: int, kind: str, env: str, timeout: float) -> Run:
    spec: dict[str, Any] = {"model": config, "seq": SEQ, "budget": budget}
    if kind == "accelerate":
        spec["mode"] = "accelerate"
        name = "accelerate find_executable_batch_size (start 128)"
    else:
        spec.update(mode="lightning", lightning_mode=kind)
        name = f"Lightning scale_batch_size (mode {kind})"
    result, wall, failure, attempts = run_peer_child(spec, env, timeout)
    if result is None:
        # A killed run: the sizes it had started (all but the last ran out of memory).
        trials = [[n, 0, True] for n in attempts[:-1]] + [[n, 0, False] for n in attempts[-1:]]
        return Run(name, env, None, None, None, wall, trials, failure=failure)
    return Run(name, env, result["size"], result["steps"], result["ooms"], wall, result["trials"])


class Checks:
    """Fresh-process checks under the limit, cached per (kind, size, env)."""

    def __init__(self, config: str, budget: int, verify_steps: int) -> None:
        self.config, self.budget, self.verify_steps = config, budget, verify_steps
        self.cache: dict[tuple[str, int, str], tuple[bool, str]] = {}
        self.seconds: dict[tuple[str, int, str], float] = {}

    def _run(self, mode: str, n: int, env: str) -> tuple[bool, str]:
        key = (mode, n, env)
        if key not in self.cache:
            spec = {"mode": mode, "model": self.config, "seq": SEQ, "budget": self.budget}
            spec.update(n=n, steps=self.verify_steps)
            result, wall, failure, _ = run_peer_child(spec, env, 900)
            self.seconds[key] = wall
            if result is None:
                raise RuntimeError(f"{mode} check at {n} {failure}")
            done = sum(t[1] for t in result["trials"] if t[0] == n)
            self.cache[key] = (result["ok"], f"OOM after {done} steps" if not result["ok"] else "")
            log(f"    {mode} {n} [{env}]: {'ok' if result['ok'] else 'OOM'} ({wall:.0f} s)")
        return self.cache[key]

    def fits(self, n: int, env: str) -> bool:
        return self._run("truth", n, env)[0]

    def verify(self, n: int, env: str) -> str:
        ok, why = self._run("verify", n, env)
        return f"yes ({self.verify_steps} steps)" if ok else f"no: {why}"

    def largest(self, seed: int, env: str) -> int:
        """Gallop from ``seed`` (steps 1, 2, 4, ...) to a bracket, then bisect."""
        lo, hi, step = 0, None, 1
        if self.fits(seed, env):
            lo = seed
            while hi is None:
                if self.fits(lo + step, env):
                    lo, step = lo + step, step * 2
                else:
                    hi = lo + step
        else:
            hi = seed
            while lo == 0 and hi > 1:
                m = max(1, hi - step)
                if self.fits(m, env):
                    lo = m
                else:
                    hi, step = m, step * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.fits(mid, env):
                lo = mid
            else:
                hi = mid
        return lo

    def probes(self, env: str) -> str:
        rows = sorted(
            (n, ok) for (mode, n, e), (ok, _) in self.cache.items() if mode == "truth" and e == env
        )
        return ", ".join(f"{n} {'ok' if ok else 'OOM'}" for n, ok in rows)


def path_text(trials: list[list[Any]]) -> str:
    return " → ".join(f"{n}{' OOM' if oom else ''}" for n, _, oom in trials) or "-"


def render(
    runs: list[Run],
    truth: dict[str, int],
    checks: Checks,
    args: argparse.Namespace,
    params: int,
    total: float,
) -> str:
    envs = sorted({r.env for r in runs}, key=[FIXED, GLIBC].index)
    slowest = max(
        ((n, s) for (mode, n, _), s in checks.seconds.items() if mode == "verify"),
        default=(0, 0.0),
        key=lambda x: x[1],
    )
    probes = "; ".join(f"{e}: {checks.probes(e)}" for e in envs)
    peer_envs = " and with ".join(f"`{e}`" if e == FIXED else e for e in envs)
    model = MODELS[args.model]
    method = [
        f"Model: {model['text']}; {params / 1e6:.1f} M parameters, built from a config.json), "
        f"seq {SEQ}, fp32, AdamW (torch's per-parameter loop, the CPU default). Every finder "
        "trains the same step, `out = model(**batch); out.loss.backward(); opt.step()`: the "
        "outputs (logits) stay alive through backward (Lightning: kept in `training_step`, "
        "dropped in `on_after_backward`).",
        f"Budget: {args.budget_gib:g} GiB of training state, an OS limit (`RLIMIT_DATA` = the "
        "data segment held after imports and a warm-up step, plus the budget) set in each "
        "finder's own fresh process before the model is built.",
        "batchfit: `batchfit.search.probe.run_child`, the child process "
        "`batchfit probe --device cpu` "
        "runs (the first size and the bytes per sample predicted there by the trace engine, "
        f"3 steps for the chosen size, 1 for a size only measured), with `{FIXED}`.",
        f"The peers run with {peer_envs}, as marked in the env column"
        + ("" if GLIBC in envs else " (glibc's defaults: `--peer-env both`)")
        + ("." if args.throughput else "; batchfit's throughput mode: `--throughput`."),
        "Lightning: `Tuner(trainer).scale_batch_size(model, mode=...)` with its defaults "
        "(steps_per_trial 3, init_val 2, max_trials 25), the same HF model in a LightningModule "
        "whose `train_dataloader` uses `self.batch_size`, a new AdamW per fit.",
        "accelerate: `find_executable_batch_size(starting_batch_size=128)` around 3 training "
        f"steps (zero_grad, forward, backward, step), capped at {args.timeout:.0f} s.",
        "*Real steps* counts calls of the training step (`training_step` for Lightning), "
        "including those an out-of-memory error ended partway.",
        "*OOMs*: out-of-memory errors the finder caught. *Wall s*: the whole finder process, "
        f"start-up included; for batchfit (choose max) and Lightning binsearch the median of "
        f"{args.repeat} runs, interleaved (range in brackets), the first run's path shown.",
        "*True largest*: the largest micro-batch that runs one step (after one at micro-batch "
        "1, so the optimizer state exists) in a fresh process under the same limit, each probe "
        f"its own process ({probes}).",
        f"*Verified*: the returned size trains {args.verify_steps} steps in a fresh process "
        f"under the limit, in the finder's environment ({args.verify_steps} steps at "
        f"micro-batch {slowest[0]} took a {slowest[1]:.0f} s process here).",
        "Other processes may share this machine's 2 cores, so wall times are comparable only "
        "within this table.",
        f"Produced by `python benchmarks/search_vs_peers.py` in {total / 60:.0f} min.",
    ]
    lines = [
        f"## Batch-size search against its peers on a CPU budget ({args.model} model)",
        "",
        " ".join(method),
        "",
        "| finder | env | size returned | true largest | within 10%? | real steps | OOMs | "
        "wall s | verified |",
        "|---|---|---:|---:|---|---:|---:|---:|---|",
    ]
    for r in runs:
        t = truth[r.env]
        size = str(r.size) if r.size is not None else r.failure or "-"
        if r.size is None and r.trials:
            size += f" (at {r.trials[-1][0]})"
        within = "-" if r.size is None else ("yes" if abs(r.size - t) <= 0.1 * t else "no")
        lines.append(
            f"| {r.finder} | {'fixed' if r.env == FIXED else 'glibc'} | {size} | {t} | "
            f"{within} | {r.steps if r.steps is not None else '-'} | "
            f"{r.ooms if r.ooms is not None else '-'} | {r.wall_text()} | {r.verified} |"
        )
    lines += ["", "Sizes each finder ran, in order (OOM: the trial ran out of memory):", ""]
    lines += [
        f"- {r.finder}, {r.env}: {path_text(r.trials)}"
        + (
            f"; returned {r.size}, a size it never ran"
            if r.size is not None and r.size not in {n for n, done, oom in r.trials if done}
            else ""
        )
        + (" (killed)" if r.failure.startswith("timed out") else "")
        for r in runs
    ]
    lines += ["", targets(runs, truth)]
    return "\n".join(lines)


def targets(runs: list[Run], truth: dict[str, int]) -> str:
    bf = next(r for r in runs if r.finder == "batchfit probe (choose max)")
    binsearch = next(
        (r for r in runs if "binsearch" in r.finder and r.env == FIXED),
        next((r for r in runs if "binsearch" in r.finder), None),
    )
    t = truth[bf.env]
    parts = [
        f"Targets: batchfit (choose max) within 10% of the true largest: "
        f"{'met' if bf.size is not None and abs(bf.size - t) <= 0.1 * t else 'missed'} "
        f"({bf.size} vs {t})"
    ]
    if binsearch is not None and binsearch.steps and bf.steps:
        steps = binsearch.steps / bf.steps
        wall = binsearch.wall / bf.wall
        parts.append(
            f"at least 3x fewer real steps than Lightning binsearch ({binsearch.env}): "
            f"{'met' if steps >= 3 else 'missed'} ({binsearch.steps} / {bf.steps} = {steps:.2f}x)"
        )
        parts.append(
            f"at least 2x less wall time: {'met' if wall >= 2 else 'missed'} "
            f"({binsearch.wall:.0f} / {bf.wall:.0f} s = {wall:.2f}x)"
        )
    ok = all(r.verified.startswith("yes") for r in runs if r.size is not None)
    parts.append(f"every returned size verified: {'yes' if ok else 'no'}")
    return "; ".join(parts) + "."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="seen")
    ap.add_argument("--budget-gib", type=float, help="default: the model's own")
    ap.add_argument("--verify-steps", type=int, default=20)
    ap.add_argument(
        "--repeat", type=int, default=3, help="runs of batchfit and Lightning binsearch (median)"
    )
    ap.add_argument("--throughput", action="store_true", help="also batchfit's throughput mode")
    ap.add_argument("--peer-env", choices=["fixed", "glibc", "both"], default="fixed")
    ap.add_argument("--timeout", type=float, default=420.0, help="seconds per peer run")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    global SEQ
    SEQ = MODELS[args.model]["seq"]
    if args.budget_gib is None:
        args.budget_gib = MODELS[args.model]["budget_gib"]
    begin = time.perf_counter()
    budget = int(args.budget_gib * GIB)
    tmp = Path(tempfile.mkdtemp(prefix="search-vs-peers-"))
    config = str(tmp / "config.json")
    Path(config).write_text(json.dumps(MODELS[args.model]["config"]))

    # batchfit and Lightning's binsearch, the pair the targets compare: interleaved repeats, so
    # a change in the machine's load falls on both; the median wall time is reported.
    pair: tuple[list[Run], list[Run]] = ([], [])
    for i in range(args.repeat):
        log(f"batchfit (choose max), run {i + 1}")
        pair[0].append(run_batchfit(config, budget, "max"))
        log(f"binsearch [{FIXED}], run {i + 1}")
        pair[1].append(run_peer(config, budget, "binsearch", FIXED, args.timeout))
        log(f"    -> {pair[1][-1].size or pair[1][-1].failure} in {pair[1][-1].wall:.0f} s")
    runs: list[Run] = [repeated(pair[0])]
    log("batchfit (choose max, 2 steps a trial)")
    runs.append(run_batchfit(config, budget, "max", steps=2))
    if args.throughput:
        log("batchfit (choose throughput)")
        runs.append(run_batchfit(config, budget, "throughput"))
    runs.append(repeated(pair[1]))
    envs = {"fixed": [FIXED], "glibc": [GLIBC], "both": [FIXED, GLIBC]}[args.peer_env]
    for env in envs:
        for kind in ("binsearch", "power", "accelerate"):
            if kind == "binsearch" and env == FIXED:
                continue  # run above
            log(f"{kind} [{env}]")
            run = run_peer(config, budget, kind, env, args.timeout)
            log(f"    -> {run.size or run.failure} in {run.wall:.0f} s")
            runs.append(run)

    checks = Checks(config, budget, args.verify_steps)
    truth: dict[str, int] = {}
    seed = runs[0].size or 8
    for env in [FIXED, *(e for e in envs if e != FIXED)]:
        log(f"truth [{env}]")
        truth[env] = checks.largest(seed, env)
        seed = truth[env]
    for r in runs:
        if r.size is not None:
            log(f"verify {r.finder} [{r.env}] {r.size}")
            r.verified = checks.verify(r.size, r.env)
    from batchfit.models import resolve_model

    params = resolve_model(config, None).total_params
    text = render(runs, truth, checks, args, params, time.perf_counter() - begin)
    shutil.rmtree(tmp, ignore_errors=True)
    print(text)
    if not args.no_write:
        write_section("search-vs-peers" + ("" if args.model == "seen" else "-unseen"), text)


if __name__ == "__main__":
    main()
