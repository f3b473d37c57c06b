"""GPUs: the catalog of devices, their memory as nvidia-smi reports it, and their abilities."""

from __future__ import annotations

import os
import platform
import re
from dataclasses import dataclass
from functools import cache

from batchfit import catalog
from batchfit._names import normalise, suggest
from batchfit._units import BYTES_IN_MIB
from batchfit.errors import UsageError


@dataclass(frozen=True)
class GpuSpec:
    """One GPU model. ``memory_bytes`` is the total that nvidia-smi (rocm-smi) reports."""

    name: str
    full_name: str
    vendor: str
    architecture: str
    memory_bytes: int
    compute_capability: str | None
    bf16: bool
    fp8: bool
    fp16_tflops_dense: float | None
    bf16_tflops_dense: float | None
    bandwidth_gb_s: float | None
    fp32_tflops: float | None = None  # non-tensor FP32 (PyTorch's fp32 matmuls without TF32)
    link: str | None = None  # how the GPUs of one node talk: nvlink, pcie, infinity-fabric
    link_gb_s: float | None = None  # per GPU and direction, for collectives inside a node

    @property
    def sm(self) -> tuple[int, int] | None:
        """CUDA compute capability as ``(major, minor)``; None for AMD."""
        cc = self.compute_capability
        if self.vendor != "nvidia" or not cc or "." not in cc:
            return None
        major, minor = cc.split(".", 1)
        return int(major), int(minor)


@cache
def all_gpus() -> dict[str, GpuSpec]:
    """Every catalog GPU by name, in catalog order."""
    gpus: dict[str, GpuSpec] = {}
    for row in catalog.load("gpus")["gpus"]:
        gpus[row["name"]] = GpuSpec(
            name=row["name"],
            full_name=row["full_name"],
            vendor=row["vendor"],
            architecture=row["architecture"],
            memory_bytes=int(row["memory_mib"]) * BYTES_IN_MIB,
            compute_capability=row.get("compute_capability"),
            bf16=bool(row["bf16"]),
            fp8=bool(row.get("fp8", False)),
            fp16_tflops_dense=row.get("fp16_tflops_dense"),
            bf16_tflops_dense=row.get("bf16_tflops_dense"),
            bandwidth_gb_s=row.get("bandwidth_gb_s"),
            fp32_tflops=row.get("fp32_tflops"),
            link=row.get("link"),
            link_gb_s=row.get("link_gb_s"),
        )
    return gpus


def catalog_gpu(device_name: str, total_bytes: int | None = None) -> str | None:
    """The catalog GPU a device is, from the name PyTorch gives it (``torch.cuda.
    get_device_name``): the entry whose name's parts all appear in it, the most specific
    first; failing that, the entry of the same family nearest ``total_bytes``.

    Example:
        >>> catalog_gpu("NVIDIA H100 80GB HBM3"), catalog_gpu("NVIDIA A100-SXM4-40GB")
        ('h100-80gb', 'a100-40gb')
        >>> catalog_gpu("Tesla T4"), catalog_gpu("NVIDIA A10G"), catalog_gpu("NVIDIA H100 PCIe")
        ('t4', 'a10g', 'h100-pcie')
        >>> catalog_gpu("NVIDIA GeForce GTX 1080") is None
        True
    """
    words = set(re.split(r"[^a-z0-9]+", device_name.lower())) - {""}
    gpus = list(all_gpus().values())
    whole = [g for g in gpus if set(g.name.split("-")) <= words]
    if whole:
        return max(whole, key=lambda g: len(g.name.split("-"))).name
    family = [g for g in gpus if g.name.split("-")[0] in words]
    if not family:
        return None
    if total_bytes is None:
        return family[0].name if len(family) == 1 else None
    return min(family, key=lambda g: abs(g.memory_bytes - total_bytes)).name


def get_gpu(name: str) -> GpuSpec:
    """Look up a GPU by catalog name, case-insensitively (``A100-40GB`` = ``a100-40gb``).

    Raises:
        UsageError: the name is unknown; the message suggests close matches.
    """
    gpus = all_gpus()
    key = normalise(name)
    if key in gpus:
        return gpus[key]
    for prefix in ("nvidia-", "amd-", "tesla-", "geforce-"):
        if key.startswith(prefix) and key[len(prefix) :] in gpus:
            return gpus[key[len(prefix) :]]
    raise UsageError(f"unknown GPU {name!r}{suggest(key, gpus)}; `batchfit gpus` lists the catalog")


@dataclass(frozen=True)
class CpuSpec:
    """One CPU as PyTorch's kernels reach it with ``threads`` threads: the step-time model's
    device when training runs on the CPU (``catalog/cpus.json``, measured by
    ``scripts/measure_cpu_profile.py``)."""

    name: str
    full_name: str
    cpu_model_name: str  # as /proc/cpuinfo's "model name" gives it
    threads: int
    fp32_gflops: float  # best dense fp32 matmul rate
    bf16_gflops: float | None
    bandwidth_gb_s: float  # STREAM-style triad


@cache
def all_cpus() -> dict[str, CpuSpec]:
    """Every catalog CPU profile by name."""
    return {
        row["name"]: CpuSpec(
            name=row["name"],
            full_name=row["full_name"],
            cpu_model_name=row["cpu_model_name"],
            threads=int(row["threads"]),
            fp32_gflops=float(row["fp32_gflops"]),
            bf16_gflops=row.get("bf16_gflops"),
            bandwidth_gb_s=float(row["bandwidth_gb_s"]),
        )
        for row in catalog.load("cpus")["cpus"]
    }


def get_cpu(name: str) -> CpuSpec:
    """Look up a CPU profile by catalog name.

    Raises:
        UsageError: the name is unknown; the message suggests close matches.
    """
    cpus = all_cpus()
    key = normalise(name)
    if key in cpus:
        return cpus[key]
    raise UsageError(
        f"unknown CPU profile {name!r}{suggest(key, cpus)}; scripts/measure_cpu_profile.py "
        "measures this machine's"
    )


def cpu_model_name() -> str:
    """This machine's CPU model name (``/proc/cpuinfo``; ``platform.processor()`` elsewhere)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass

    return platform.processor() or platform.machine()


def host_threads() -> int:
    """The CPUs this process may run on: PyTorch's default intra-op thread count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@cache
def host_cpu(threads: int | None = None) -> CpuSpec | None:
    """The catalog profile of this machine's CPU on ``threads`` threads (default: all this
    process may use, PyTorch's default), if one was measured."""
    name, threads = cpu_model_name(), threads or host_threads()
    for cpu in all_cpus().values():
        if cpu.cpu_model_name == name and cpu.threads == threads:
            return cpu
    return None
