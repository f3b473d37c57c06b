"""Measure this machine's CPU profile for the step-time model and write it into the catalog.

The profile is what ``batchfit.speed`` needs to time a training step on the CPU, measured
with the same library the step runs on (PyTorch's CPU kernels, on ``--threads`` threads: by
default all this process may use), never taken from a datasheet (a CPU's vendor peak assumes
turbo clocks and every core; a VM's share of a socket has neither):

- ``fp32_gflops``: the best of several fp32 ``torch.mm`` of two 2048 x 2048 matrices
  (2 x 2048³ FLOPs each) after warm-up; MKL's GEMM, the kernel an fp32 ``nn.Linear`` calls.
- ``bf16_gflops``: the same in bf16 (oneDNN; AMX or AVX-512-BF16 where the CPU has them),
  recorded for completeness: the time model predicts fp32 steps only so far.
- ``bandwidth_gb_s``: a STREAM-style triad ``a = b + s x c`` (``torch.add(b, c, alpha=s,
  out=a)``) over three 512 MiB fp32 arrays, far beyond the caches; bytes counted as STREAM
  counts them (two reads and one write per element, no write-allocate traffic), best of
  several runs.

Each figure is the best of 10 runs after a warm-up, timed in CPU time (divided by the thread
count, with OpenMP's waiting threads asleep: ``OMP_WAIT_POLICY=PASSIVE``, set here before torch
loads), not wall time: other processes sharing the cores cannot inflate it (measured: with the
load average at 5 on 2 cores a 2-thread matmul ran at 60 GFLOP/s of wall time, one thread at
160 of CPU time). On several threads it is the rate with every thread on a core of its own and
no cost of synchronising them, an upper bound.

The entry is keyed by the CPU's model name (``/proc/cpuinfo``) and the thread count, so
``batchfit estimate --device cpu`` finds it on this machine (``hardware.host_cpu``). Run it
again on another machine to add that machine's entry; an entry with the same name is replaced.

    python scripts/measure_cpu_profile.py [--name NAME] [--threads N] [--dry-run]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads its OpenMP runtime

import torch

from batchfit.hardware import cpu_model_name, host_threads

OUT = Path(__file__).resolve().parents[1] / "src" / "batchfit" / "catalog" / "cpus.json"
MATMUL_N = 2048
STREAM_BYTES = 512 * 1024**2
REPEATS = 10


def best_seconds(fn: Any, repeats: int = REPEATS) -> float:
    """The fastest of ``repeats`` runs in CPU time over the thread count (see the module
    docstring): what the threads take running side by side on cores of their own."""
    fn()  # warm-up: thread pool, page faults, kernel selection
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        fn()
        best = min(best, (time.process_time() - start) / torch.get_num_threads())
    return best


def matmul_gflops(dtype: torch.dtype) -> float:
    a = torch.randn(MATMUL_N, MATMUL_N).to(dtype)
    b = torch.randn(MATMUL_N, MATMUL_N).to(dtype)
    out = torch.empty(MATMUL_N, MATMUL_N, dtype=dtype)
    seconds = best_seconds(lambda: torch.mm(a, b, out=out))
    return 2 * MATMUL_N**3 / seconds / 1e9


def triad_gb_s() -> float:
    n = STREAM_BYTES // 4
    a, b, c = torch.empty(n), torch.rand(n), torch.rand(n)
    seconds = best_seconds(lambda: torch.add(b, c, alpha=3.0, out=a))
    return 3 * STREAM_BYTES / seconds / 1e9


def default_name(model_name: str, threads: int) -> str:
    words = "".join(ch if ch.isalnum() else "-" for ch in model_name.lower()).split("-")
    kept = [w for w in words if w and w not in ("r", "tm", "cpu", "processor", "with")]
    return "-".join(kept[:5]) + f"-{threads}t"


def measure(threads: int) -> dict[str, Any]:
    torch.set_num_threads(threads)
    model_name = cpu_model_name()
    flags = _cpu_flags()
    when = datetime.date.today().isoformat()
    clock = "CPU time" if threads == 1 else "CPU time / threads, OMP_WAIT_POLICY=PASSIVE"
    how = (
        f"measured by scripts/measure_cpu_profile.py on {when}, torch {torch.__version__}, "
        f"{threads} thread{'s' if threads > 1 else ''}, {clock}, load average "
        f"{os.getloadavg()[0]:.1f}"
    )
    return {
        "full_name": model_name,
        "cpu_model_name": model_name,
        "threads": threads,
        "vector_isa": [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags],
        "fp32_gflops": round(matmul_gflops(torch.float32), 1),
        "fp32_source": f"best fp32 torch.mm of {MATMUL_N}x{MATMUL_N} matrices; {how}",
        "bf16_gflops": round(matmul_gflops(torch.bfloat16), 1),
        "bf16_source": f"best bf16 torch.mm of {MATMUL_N}x{MATMUL_N} matrices; {how}",
        "bandwidth_gb_s": round(triad_gb_s(), 1),
        "bandwidth_source": (
            f"best STREAM-style fp32 triad over 3 x {STREAM_BYTES // 1024**2} MiB arrays "
            f"(STREAM's byte count: 2 reads + 1 write); {how}"
        ),
        "machine": f"{platform.machine()}, {os.cpu_count()} logical CPUs visible",
    }


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=host_threads())
    parser.add_argument("--name", default=None)
    parser.add_argument("--dry-run", action="store_true", help="print, do not write")
    args = parser.parse_args()
    entry = measure(args.threads)
    name = args.name or default_name(entry["cpu_model_name"], args.threads)
    entry = {"name": name, **entry}
    print(json.dumps(entry, indent=2))
    if args.dry_run:
        return
    data = json.loads(OUT.read_text()) if OUT.exists() else {"_about": ABOUT, "cpus": []}
    data["cpus"] = [c for c in data["cpus"] if c["name"] != name] + [entry]
    tmp = OUT.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(OUT)
    print(f"wrote {name} into {OUT}")


ABOUT = (
    "One entry per CPU (model name as /proc/cpuinfo gives it) and thread count, as PyTorch's CPU "
    "kernels reach them on that machine: fp32_gflops and bf16_gflops are the best dense matmul "
    "rates, bandwidth_gb_s a STREAM-style triad, all measured by scripts/measure_cpu_profile.py "
    "(each *_source says when, with which torch and how many threads). batchfit estimate "
    "--device cpu uses the entry whose cpu_model_name and threads match the host."
)

if __name__ == "__main__":
    main()
