"""Real CUDA training steps against ``estimate --gpu``: memory (allocated, reserved, nvidia-smi)
and step time, on a grid of cases drawn at random from a seed fixed before any was measured.

On a CUDA machine it measures every case in a fresh process, then compares with batchfit's
estimates (trace and formulas) for the catalog GPU named by ``--gpu``::

    python benchmarks/gpu_validate.py --gpu h100-80gb --out DIR        # measure + compare
    python benchmarks/gpu_validate.py --measure-only --out DIR         # on the GPU machine
    python benchmarks/gpu_validate.py --compare DIR/gpu_validate_raw.json --gpu h100-80gb
                                                                        # elsewhere, later

What each case measures (one fresh process each, so nothing of another case stays cached):

- ``context``: what the process holds on the device outside PyTorch's allocator once CUDA is
  initialised (NVML's per-process figure, what nvidia-smi lists, minus ``memory_reserved``);
  the ``context`` case adds each library's lazily loaded kernels in turn (cuBLAS, cuBLASLt,
  SDPA flash, cross-entropy, the foreach optimizer).
- a training case: the model built on the GPU as batchfit builds it (``step_parts``, the setup
  applied), two optimizer steps of the HF Trainer loop (``benchmarks/_truth.py``'s loop, the
  outputs released before backward) while a thread samples NVML; then ``max_memory_allocated``
  (compared with ``peak_bytes``), ``max_memory_reserved`` (``reserved_bytes``) and the sampled
  per-process peak (``device_total_bytes``); then three timed steps (median seconds).
- the first cases again with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``.

Cases are drawn from ``SPACE`` by ``random.Random(SEED)``; a draw is redrawn only by rules that
read no estimate: the static state (16 B/param full fp32/AMP AdamW, 8 pure bf16, 2 LoRA) must
stay under 64 GiB and 6·params·tokens under a time cap (fp32 runs without TF32 are slow).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "src"))

GIB = 1024**3
MIB = 1024**2
SEED = 20261126  # fixed on 2026-11-26 before any case was measured on a GPU
NUM_CASES = 14
NUM_EXPANDABLE = 3

# (catalog name, task, longest sequence): decoders and encoders people fine-tune on one GPU,
# and image models (their "seq" is the image side in pixels).
MODELS: list[tuple[str, str, int]] = [
    ("gpt2", "causal-lm", 1024),
    ("gpt2-medium", "causal-lm", 1024),
    ("pythia-410m", "causal-lm", 2048),
    ("opt-1.3b", "causal-lm", 2048),
    ("smollm2-360m", "causal-lm", 2048),
    ("qwen2.5-0.5b", "causal-lm", 2048),
    ("qwen3-0.6b", "causal-lm", 2048),
    ("qwen2.5-1.5b", "causal-lm", 2048),
    ("llama-3.2-1b", "causal-lm", 2048),
    ("gemma-3-1b", "causal-lm", 2048),
    ("llama-3.2-3b", "causal-lm", 2048),
    ("phi-3-mini", "causal-lm", 2048),
    ("mistral-7b", "causal-lm", 2048),
    ("llama-3.1-8b", "causal-lm", 2048),
    ("qwen3-8b", "causal-lm", 2048),
    ("bert-base-uncased", "masked-lm", 512),
    ("roberta-large", "classification", 512),
    ("modernbert-base", "masked-lm", 2048),
    ("vit-base-patch16-224", "image-classification", 224),
    ("convnext-tiny-224", "image-classification", 224),
]
PRECISIONS = ["fp32", "amp-bf16", "amp-bf16", "bf16"]
METHODS = ["full", "full", "lora"]
MICRO = [1, 2, 4, 8, 16]
IMAGE_MICRO = [16, 32, 64, 128]
SEQS = [256, 512, 1024, 2048]
STATIC_CAP_BYTES = 64 * GIB
FLOP_CAP = {"fp32": 1.5e14, "amp-bf16": 1.2e15, "bf16": 1.2e15}


def draw_cases(seed: int = SEED, count: int = NUM_CASES) -> list[dict[str, Any]]:
    """``count`` cases from ``random.Random(seed)``, redrawn only by the caps in the docstring."""
    from batchfit.models import resolve_model

    rng = random.Random(seed)
    cases: list[dict[str, Any]] = []
    while len(cases) < count:
        name, task, longest = rng.choice(MODELS)
        precision = rng.choice(PRECISIONS)
        image = task == "image-classification"
        method = "full" if image or task != "causal-lm" else rng.choice(METHODS)
        ckpt = rng.random() < 0.3
        micro = rng.choice(IMAGE_MICRO if image else MICRO)
        seq = 224 if image else rng.choice([s for s in SEQS if s <= longest])
        loss = "chunked" if task == "causal-lm" and rng.random() < 0.25 else "full"
        info = resolve_model(name, None if image else task)
        params = info.total_params
        bytes_per_param = 2 if method == "lora" else 8 if precision == "bf16" else 16
        static = params * bytes_per_param
        tokens = micro * (1 if image else seq)
        flops = 6 * params * tokens * (256 if image else 1)  # ~196 patches + overhead a image
        if static > STATIC_CAP_BYTES or flops > FLOP_CAP[precision]:
            continue
        if ckpt and not info.supports_grad_ckpt:
            ckpt = False
        setup: dict[str, Any] = {
            "precision": precision,
            "method": method,
            "grad_ckpt": ckpt,
            "optimizer": "adamw",
        }
        if loss != "full":
            setup["loss"] = loss
        cases.append(
            {
                "id": f"c{len(cases) + 1:02d}",
                "model": name,
                "task": task,
                "micro": micro,
                "seq": seq,
                "setup": setup,
            }
        )
    return cases


# ---------------------------------------------------------------- the child (one fresh process)


class _Nvml:
    """This process's device memory as nvidia-smi lists it (NVML), or None without NVML."""

    def __init__(self) -> None:
        self.handle: Any = None
        try:
            import pynvml

            pynvml.nvmlInit()
            index = int(os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or 0)
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            self.pynvml = pynvml
        except Exception:  # no NVML (CPU machine, no nvidia-ml-py): the figure is None
            self.handle = None

    def process_bytes(self) -> int | None:
        if self.handle is None:
            return None
        pid = os.getpid()
        for proc in self.pynvml.nvmlDeviceGetComputeRunningProcesses(self.handle):
            if proc.pid == pid and proc.usedGpuMemory is not None:
                return int(proc.usedGpuMemory)
        return None

    def device_used(self) -> int | None:
        if self.handle is None:
            return None
        return int(self.pynvml.nvmlDeviceGetMemoryInfo(self.handle).used)


class _Sampler(threading.Thread):
    """The highest per-process NVML figure seen while a block runs (every ~2 ms)."""

    def __init__(self, nvml: _Nvml) -> None:
        super().__init__(daemon=True)
        self.nvml, self.peak, self.device_peak = nvml, 0, 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            value = self.nvml.process_bytes()
            if value is not None:
                self.peak = max(self.peak, value)
            used = self.nvml.device_used()  # the fallback where NVML hides processes
            if used is not None:
                self.device_peak = max(self.device_peak, used)
            time.sleep(0.002)


def _stage(torch: Any, nvml: _Nvml, device: str) -> dict[str, Any]:
    if device == "cuda":
        torch.cuda.synchronize()
    reserved = torch.cuda.memory_reserved() if device == "cuda" else 0
    proc = nvml.process_bytes()
    return {
        "process_bytes": proc,
        "device_used_bytes": nvml.device_used(),
        "reserved_bytes": reserved,
        "outside_allocator_bytes": None if proc is None else proc - reserved,
    }


def _versions(torch: Any, nvml: _Nvml) -> dict[str, Any]:
    import transformers

    out: dict[str, Any] = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
        "cuda_module_loading": os.environ.get("CUDA_MODULE_LOADING"),
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
    }
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name()
        out["gpu_total_bytes"] = torch.cuda.get_device_properties(0).total_memory
    if nvml.handle is not None:
        out["driver"] = nvml.pynvml.nvmlSystemGetDriverVersion()
    return out


def child_context(device: str) -> dict[str, Any]:
    """The device memory outside the allocator after each library's first use."""
    import torch

    nvml = _Nvml()
    stages: dict[str, Any] = {}
    torch.zeros(1, device=device)
    stages["init"] = _stage(torch, nvml, device)
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    (a @ a).sum().item()
    stages["cublas_bf16"] = _stage(torch, nvml, device)
    b = torch.randn(4096, 4096, device=device)
    (b @ b).sum().item()
    stages["cublas_fp32"] = _stage(torch, nvml, device)
    q = torch.randn(4, 16, 1024, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
    stages["sdpa_bf16"] = _stage(torch, nvml, device)
    logits = torch.randn(2048, 32000, device=device, requires_grad=True)
    target = torch.randint(0, 32000, (2048,), device=device)
    torch.nn.functional.cross_entropy(logits, target).backward()
    stages["cross_entropy"] = _stage(torch, nvml, device)
    params = [torch.nn.Parameter(torch.randn(1024, 1024, device=device)) for _ in range(4)]
    for p in params:
        p.grad = torch.randn_like(p)
    torch.optim.AdamW(params).step()
    stages["adamw_foreach"] = _stage(torch, nvml, device)
    return {"stages": stages, "versions": _versions(torch, nvml)}


def _train_steps(parts: Any, steps: int, device: str) -> None:
    """``steps`` optimizer steps of the HF Trainer loop (``_truth.train``), finished on the GPU."""
    import torch
    from _truth import train

    with torch.device(device):
        train(
            parts.model,
            parts.optimizer,
            parts.make_batch,
            parts.autocast_dtype,
            "trainer",
            steps,
            device_type=device,
        )
    if device == "cuda":
        torch.cuda.synchronize()


def child_case(spec: dict[str, Any], device: str) -> dict[str, Any]:
    """One case's real steps: memory through two steps, then the time of three more."""
    import torch

    from batchfit.memory.trace import hf as _hf_trace
    from batchfit.models import resolve_model
    from batchfit.spec import TrainingSetup

    nvml = _Nvml()
    torch.manual_seed(0)
    torch.zeros(1, device=device)
    start = _stage(torch, nvml, device)
    image = spec["task"] == "image-classification"
    info = resolve_model(spec["model"], None if image else spec["task"])
    bf16 = device == "cuda" and torch.cuda.is_bf16_supported()
    setup = TrainingSetup(**spec["setup"]).resolved(device="cuda", bf16_supported=bf16)
    out: dict[str, Any] = {"start": start, "versions": _versions(torch, nvml)}
    sampler = _Sampler(nvml)
    try:
        with torch.device(device):
            parts = _hf_trace.step_parts(
                info, setup, micro=spec["micro"], seq=spec["seq"], emulate_cuda=device == "cuda"
            )
        out["built"] = _stage(torch, nvml, device)

        def steps(n: int) -> None:
            _train_steps(parts, n, device)

        explain = spec.get("explain")
        if explain and device == "cuda":
            # PyTorch's memory history: every block with the Python stack that allocated it
            torch.cuda.memory._record_memory_history(max_entries=500_000, stacks="python")
        sampler.start()
        steps(2)
        if device == "cuda":
            torch.cuda.synchronize()
        sampler.stop.set()
        sampler.join()
        out["after_steps"] = _stage(torch, nvml, device)
        if device == "cuda":
            out["max_allocated_bytes"] = torch.cuda.max_memory_allocated()
            out["max_reserved_bytes"] = torch.cuda.max_memory_reserved()
            out["num_alloc_retries"] = torch.cuda.memory_stats().get("num_alloc_retries", 0)
        out["smi_peak_bytes"] = sampler.peak or None
        out["smi_device_peak_bytes"] = sampler.device_peak or None
        if explain and device == "cuda":
            import gzip
            import pickle

            snap = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            out["explain"] = summarise_snapshot(snap["device_traces"][0])
            blob = gzip.compress(pickle.dumps(snap))
            if len(blob) < 15 * MIB:
                Path(explain).write_bytes(blob)
            return out
        seconds = []
        for _ in range(3):
            t0 = time.perf_counter()
            steps(1)
            if device == "cuda":
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - t0)
        out["step_seconds"] = seconds
        out["oom"] = False
    except torch.OutOfMemoryError as exc:
        sampler.stop.set()
        out["oom"] = True
        out["error"] = str(exc).splitlines()[0][:300]
    return out


def _site(frames: list[dict[str, Any]]) -> str:
    """Where a block was allocated: the innermost frame in a model, peft, batchfit or the loop
    (an allocation made by autograd's backward shows the loop's ``backward()`` line)."""
    for frame in frames:
        name = frame.get("filename", "")
        if any(k in name for k in ("transformers/", "peft/", "batchfit/", "_truth.py", "optim/")):
            short = "/".join(name.split("/")[-2:])
            return f"{short}:{frame.get('line')} {frame.get('name')}"
    return "other"


def summarise_snapshot(trace: list[dict[str, Any]], top: int = 30) -> dict[str, Any]:
    """The moment of the highest allocated total in a memory-history trace, and what was live
    then, grouped by allocation site; with the last allocations that led to it.

    Example:
        >>> t = [{"action": "alloc", "addr": 1, "size": 512, "frames": []},
        ...      {"action": "alloc", "addr": 2, "size": 1024, "frames": []},
        ...      {"action": "free_completed", "addr": 1, "size": 512, "frames": []}]
        >>> summarise_snapshot(t)["peak_bytes"]
        1536
    """
    live: dict[int, int] = {}
    current = peak = peak_index = 0
    for i, entry in enumerate(trace):
        action, addr = entry.get("action"), entry.get("addr")
        if action == "alloc":
            live[addr] = entry["size"]
            current += entry["size"]
            if current > peak:
                peak, peak_index = current, i
        elif action == "free_completed" and addr in live:
            current -= live.pop(addr)
    held: dict[int, dict[str, Any]] = {}
    for entry in trace[: peak_index + 1]:
        if entry.get("action") == "alloc":
            held[entry["addr"]] = entry
        elif entry.get("action") == "free_completed":
            held.pop(entry.get("addr"), None)
    sites: dict[str, list[int]] = {}
    for entry in held.values():
        site = sites.setdefault(_site(entry.get("frames", [])), [0, 0])
        site[0] += entry["size"]
        site[1] += 1
    ranked = sorted(sites.items(), key=lambda kv: -kv[1][0])
    lead = [
        {"size": e["size"], "site": _site(e.get("frames", []))}
        for e in trace[max(0, peak_index - 15) : peak_index + 1]
        if e.get("action") == "alloc"
    ]
    return {
        "peak_bytes": peak,
        "peak_index": peak_index,
        "entries": len(trace),
        "sites": [{"site": k, "bytes": v[0], "blocks": v[1]} for k, v in ranked[:top]],
        "lead_up": lead,
    }


# Step time against micro-batch and checkpointing, one model per process (the time
# model needs achieved throughput by model width and micro-batch): (model, task, seq, precision,
# [(micro, grad_ckpt), ...]).
SWEEPS: list[tuple[str, str, int, str, list[tuple[int, bool]]]] = [
    (
        "llama-3.2-1b",
        "causal-lm",
        2048,
        "amp-bf16",
        [(1, False), (2, False), (4, False), (8, False), (4, True)],
    ),
    ("qwen2.5-0.5b", "causal-lm", 1024, "amp-bf16", [(1, False), (4, False), (16, False)]),
    ("gpt2", "causal-lm", 1024, "fp32", [(4, False), (16, False)]),
]


def sweep_table(raw: dict[str, Any]) -> str:
    """The step-time sweeps of a raw file as a table: median step, tokens/s and model TFLOP/s
    (6 x parameters x tokens, no attention term)."""
    rows = [
        "| model | precision | micro x seq | checkpointing | step s | tokens/s | model TFLOP/s |",
        "|---|---|---|---|---:|---:|---:|",
    ]
    for key in sorted(k for k in raw["results"] if k.startswith("sweep")):
        sweep = raw["results"][key]
        for point in sweep["points"]:
            step = statistics.median(point["step_seconds"])
            tokens = point["micro"] * sweep["seq"]
            tflops = 6 * sweep["total_params"] * tokens / step / 1e12
            rows.append(
                f"| {sweep['model']} | {sweep['precision']} | {point['micro']} x {sweep['seq']} "
                f"| {'yes' if point['grad_ckpt'] else 'no'} | {step:.3f} | {tokens / step:,.0f} "
                f"| {tflops:.0f} |"
            )
    return "\n".join(rows)


def child_sweep(index: int, device: str) -> dict[str, Any]:
    """Median step seconds (two warm-up steps, three timed) at each micro-batch of a sweep."""
    import gc

    import torch

    from batchfit.memory.trace import hf as _hf_trace
    from batchfit.models import resolve_model
    from batchfit.spec import TrainingSetup

    name, task, seq, precision, points = SWEEPS[index]
    info = resolve_model(name, task)
    bf16 = device == "cuda" and torch.cuda.is_bf16_supported()
    out: dict[str, Any] = {"model": name, "seq": seq, "precision": precision, "points": []}
    for micro, ckpt in points:
        setup = TrainingSetup(precision=precision, grad_ckpt=ckpt).resolved(  # type: ignore[arg-type]
            device="cuda", bf16_supported=bf16
        )
        point: dict[str, Any] = {"micro": micro, "grad_ckpt": ckpt}
        try:
            with torch.device(device):
                parts = _hf_trace.step_parts(info, setup, micro=micro, seq=seq, emulate_cuda=True)
            seconds = []
            for i in range(5):
                t0 = time.perf_counter()
                _train_steps(parts, 1, device)
                if i >= 2:
                    seconds.append(time.perf_counter() - t0)
            point["step_seconds"] = seconds
            if device == "cuda":
                point["max_allocated_bytes"] = torch.cuda.max_memory_allocated()
        except torch.OutOfMemoryError:
            point["oom"] = True
        out["points"].append(point)
        parts = None  # type: ignore[assignment]
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    out["total_params"] = info.total_params
    return out


# ---------------------------------------------------------------- the parent


def _run_child(payload: dict[str, Any], env_extra: dict[str, str], timeout: int) -> dict[str, Any]:
    env = {**os.environ, **env_extra, "PYTHONPATH": f"{ROOT / 'src'}:{HERE}"}
    try:
        proc = subprocess.run(
            [sys.executable, __file__, "--child", json.dumps(payload)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1][:400]}
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def measure(
    out_dir: Path,
    device: str,
    count: int,
    expandable: int,
    timeout: int,
    sweeps: bool = True,
    seed: int = SEED,
) -> Path:
    """Every case in a fresh process; the raw file is rewritten after each (a cut run keeps
    what it measured)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    raw_path = out_dir / "gpu_validate_raw.json"
    cases = draw_cases(seed, count)
    raw: dict[str, Any] = {"seed": seed, "device": device, "cases": cases, "results": {}}
    raw["idle_device_used_bytes"] = _Nvml().device_used()  # before any child made a context

    def save() -> None:
        tmp = raw_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(raw, indent=1))
        tmp.replace(raw_path)

    jobs: list[tuple[str, dict[str, Any], dict[str, str]]] = [("context", {"kind": "context"}, {})]
    jobs += [(c["id"], {"kind": "case", "case": c}, {}) for c in cases]
    expandable_env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    jobs += [
        (f"{c['id']}-expandable", {"kind": "case", "case": c}, expandable_env)
        for c in cases[:expandable]
    ]
    if sweeps:
        jobs += [(f"sweep{i}", {"kind": "sweep", "index": i}, {}) for i in range(len(SWEEPS))]
    for key, payload, env_extra in jobs:
        t0 = time.perf_counter()
        result = _run_child({**payload, "device": device}, env_extra, timeout)
        result["wall_seconds"] = round(time.perf_counter() - t0, 2)
        raw["results"][key] = result
        save()
        status = "error: " + result["error"] if "error" in result else "ok"
        if result.get("oom"):
            status = "OOM"
        print(f"{key}: {status} ({result['wall_seconds']} s)", flush=True)
    return raw_path


def explain(out_dir: Path, ids: list[str], timeout: int) -> None:
    """The drawn cases ``ids`` again, each with its memory history summarised."""
    out_dir.mkdir(parents=True, exist_ok=True)
    cases = {c["id"]: c for c in draw_cases()}
    report: dict[str, Any] = {}
    for cid in ids:
        case = {**cases[cid], "explain": str(out_dir / f"{cid}.pickle.gz")}
        report[cid] = _run_child({"kind": "case", "case": case, "device": "cuda"}, {}, timeout)
        (out_dir / "explain.json").write_text(json.dumps(report, indent=1))
        print(f"{cid}: {'error' if 'error' in report[cid] else 'ok'}", flush=True)


def _estimate(case: dict[str, Any], gpu_name: str, engine: str, expandable: bool) -> Any:
    from batchfit.hardware import get_gpu
    from batchfit.memory.estimate import estimate
    from batchfit.models import resolve_model
    from batchfit.spec import TrainingSetup

    image = case["task"] == "image-classification"
    info = resolve_model(case["model"], None if image else case["task"])
    gpu = get_gpu(gpu_name)
    fields = dict(case["setup"])
    if expandable and "expandable_segments" in TrainingSetup.__dataclass_fields__:
        fields["expandable_segments"] = True
    setup = TrainingSetup(**fields)  # as the CLI passes it: estimate resolves "auto"
    return estimate(
        info,
        setup,
        micro_batch_size=case["micro"],
        seq_len=case["seq"],
        device="cuda",
        gpu=gpu,
        engine=engine,
    )


def _describe(case: dict[str, Any]) -> str:
    s = case["setup"]
    bits = [s["precision"], s["method"]]
    if s.get("grad_ckpt"):
        bits.append("ckpt")
    if s.get("loss"):
        bits.append(f"loss {s['loss']}")
    size = f"{case['micro']} x {case['seq']}" + (
        "px" if case["task"] == "image-classification" else ""
    )
    return f"{case['model']} {' '.join(bits)} {size}"


def compare(raw_path: Path, gpu_name: str, write: bool, section: str = "gpu-validate") -> str:
    """The table: each case's measured figures and the two engines' errors."""
    raw = json.loads(raw_path.read_text())
    results = raw["results"]
    cases = {c["id"]: c for c in raw["cases"]}
    rows = []
    errs: dict[str, list[float]] = {
        "trace": [],
        "analytic": [],
        "reserved": [],
        "smi": [],
        "step time": [],
    }
    for key, res in results.items():
        if key == "context" or key.startswith("sweep") or "error" in res:
            continue
        cid = key.split("-")[0]
        expandable = key.endswith("-expandable")
        case = cases[cid]
        trace = _estimate(case, gpu_name, "trace", expandable)
        try:
            analytic = _estimate(case, gpu_name, "analytic", expandable)
        except Exception as exc:  # image models have no formulas
            analytic = None
            del exc
        if res.get("oom"):
            verdict = "fits" if trace.device_total_bytes < _gpu_bytes(gpu_name) else "no fit"
            rows.append(f"| {key} | {_describe(case)} | OOM | | | | trace says {verdict} | | |")
            continue
        alloc, reserved, smi = (
            res["max_allocated_bytes"],
            res["max_reserved_bytes"],
            res.get("smi_peak_bytes"),
        )
        e_trace = (trace.peak_bytes - alloc) / alloc
        errs["trace"].append(e_trace)
        e_res = (trace.reserved_bytes - reserved) / reserved
        errs["reserved"].append(e_res)
        a_cell = "n/a"
        if analytic is not None:
            e_an = (analytic.peak_bytes - alloc) / alloc
            errs["analytic"].append(e_an)
            a_cell = f"{100 * e_an:+.1f}%"
        smi_cell = "n/a"
        if smi:
            e_smi = (trace.device_total_bytes - smi) / smi
            errs["smi"].append(e_smi)
            smi_cell = f"{smi / GIB:.2f} ({100 * e_smi:+.1f}%)"
        step = statistics.median(res["step_seconds"])
        tokens = case["micro"] * (1 if case["task"] == "image-classification" else case["seq"])
        predicted = trace.speed_json()["step_seconds"]  # batchfit.speed's, in the estimate
        time_cell = "n/a"
        if predicted is not None:
            errs["step time"].append((predicted - step) / step)
            time_cell = f"{predicted:.3f} ({100 * (predicted - step) / step:+.0f}%)"
        rows.append(
            f"| {key} | {_describe(case)} | {alloc / GIB:.2f} | {100 * e_trace:+.1f}% | {a_cell} "
            f"| {reserved / GIB:.2f} ({100 * e_res:+.1f}%) | {smi_cell} | {step:.3f} "
            f"| {time_cell} | {tokens / step:,.0f} |"
        )
    versions = next((r["versions"] for r in results.values() if "versions" in r), {"gpu": "?"})

    def summary(name: str) -> str:
        values = [abs(v) for v in errs[name]]
        if not values:
            return f"| {name} | 0 | | | |"
        signed = statistics.mean(errs[name])
        return (
            f"| {name} | {len(values)} | {100 * statistics.median(values):.1f}% "
            f"| {100 * max(values):.1f}% | {100 * signed:+.1f}% |"
        )

    ctx = results.get("context", {}).get("stages", {})
    ctx_rows = [
        f"| {stage} | {v['process_bytes'] / MIB:,.0f} | {v['reserved_bytes'] / MIB:,.0f} "
        f"| {v['outside_allocator_bytes'] / MIB:,.0f} |"
        for stage, v in ctx.items()
        if v.get("process_bytes") is not None
    ]
    body = "\n".join(
        [
            f"## Real CUDA steps against `estimate --gpu`: `{raw_path.name}` "
            "(benchmarks/gpu_validate.py)",
            "",
            f"Measured on {versions.get('gpu')} (driver {versions.get('driver')}, torch "
            f"{versions.get('torch')}, CUDA {versions.get('cuda')}, transformers "
            f"{versions.get('transformers')}); estimates for `--gpu {gpu_name}` made afterwards "
            "on the CPU machine with its own versions. Cases drawn by "
            f"`random.Random({raw['seed']})` before any was measured. "
            "Each case: a fresh process, the model built on the GPU as batchfit builds it, two "
            "steps of the HF Trainer loop (memory), three more (time, median).",
            "",
            "| case | setup (micro x seq) | max allocated GiB | trace | analytic "
            "| max reserved GiB (trace) | nvidia-smi peak GiB (trace device total) | step s "
            "| predicted step s | tokens/s |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
            *rows,
            "",
            "| error of | cases | median abs | worst abs | signed mean |",
            "|---|---:|---:|---:|---:|",
            summary("trace"),
            summary("analytic"),
            summary("reserved"),
            summary("smi"),
            summary("step time"),
            "",
            "Device memory outside PyTorch's allocator (NVML per-process figure minus "
            "`memory_reserved`) after each library's first use, in a fresh process:",
            "",
            "| after | process MiB | reserved MiB | outside allocator MiB |",
            "|---|---:|---:|---:|",
            *ctx_rows,
        ]
    )
    if write:
        from _report import write_section

        write_section(section, body)
    return body


def _gpu_bytes(name: str) -> int:
    from batchfit.hardware import get_gpu

    return get_gpu(name).memory_mib * MIB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--gpu", default="h100-80gb", help="catalog GPU to estimate for")
    parser.add_argument("--out", type=Path, default=Path("gpu_validate_out"))
    parser.add_argument("--measure-only", action="store_true")
    parser.add_argument("--compare", type=Path, help="a raw file measured earlier")
    parser.add_argument("--cases", type=int, default=NUM_CASES)
    parser.add_argument("--seed", type=int, default=SEED, help="the draw (fix it before measuring)")
    parser.add_argument("--expandable", type=int, default=NUM_EXPANDABLE)
    parser.add_argument("--timeout", type=int, default=90, help="seconds per case")
    parser.add_argument("--device", default=None, help="cuda (default when there) or cpu")
    parser.add_argument("--list", action="store_true", help="print the drawn cases and stop")
    parser.add_argument("--no-sweeps", action="store_true", help="skip the step-time sweeps")
    parser.add_argument(
        "--explain",
        help="case ids (c05,c03): record PyTorch's memory history through their two steps and "
        "write what was live at the peak, by allocation site, to OUT/explain.json",
    )
    parser.add_argument("--no-write", action="store_true", help="do not touch docs/benchmarks.md")
    parser.add_argument("--section", default="gpu-validate", help="docs/benchmarks.md section")
    args = parser.parse_args()
    if args.child:
        payload = json.loads(args.child)
        if payload["kind"] == "context":
            result = child_context(payload["device"])
        elif payload["kind"] == "sweep":
            result = child_sweep(payload["index"], payload["device"])
        else:
            result = child_case(payload["case"], payload["device"])
        print(json.dumps(result))
        return
    if args.list:
        for case in draw_cases(args.seed, args.cases):
            print(case["id"], _describe(case))
        return
    if args.compare:
        print(compare(args.compare, args.gpu, not args.no_write, args.section))
        return
    import torch

    if args.explain:
        explain(args.out, args.explain.split(","), args.timeout)
        return
    device = args.device or ("cuda" if torch.cuda.is_available() else "")
    if not device:
        sys.exit(
            "gpu_validate: no CUDA device here; measure on a GPU machine (--measure-only) "
            "and --compare the raw file here, or pass --device cpu to check the harness"
        )
    raw_path = measure(
        args.out, device, args.cases, args.expandable, args.timeout, not args.no_sweeps, args.seed
    )
    print(f"raw measurements: {raw_path}")
    if not args.measure_only and device == "cuda":
        print(compare(raw_path, args.gpu, not args.no_write))


if __name__ == "__main__":
    main()
