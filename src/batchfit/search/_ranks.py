"""The probe on several ranks: ``torchrun`` launches them, every rank runs the same trials and
agrees on each outcome (``batchfit probe --nproc N --sharding ddp|fsdp``).

A rank that runs out of memory inside a collective leaves the others waiting in it, so no trial
step runs a collective across the real process group: each rank's memory and compute are real,
its communication is not. DDP runs collectives of its own inside forward and backward (buffer
broadcasts, the unused-parameter map, the bucket rebuild), so its one memory cost, the gradient
buckets, is held as a buffer of their size beside the unwrapped model; FSDP2 shards over a fake
process group of the same size (real shards, all-gather and reduce-scatter buffers, no data
moved). The
real group (gloo on the CPU, NCCL on CUDA) carries only what the ranks agree on: the first size,
each trial's out-of-memory flag (``find_batch_size``), whether the model could be built.
Throughput is therefore the compute's alone, without communication time.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from batchfit.errors import NoFitError, RankFailure, UsageError
from batchfit.memory.trace.fsdp import shard
from batchfit.search._child import die_with_parent
from batchfit.spec import TrainingSetup

SHARDINGS = ("none", "ddp", "fsdp")


def world() -> tuple[int, int]:
    """This process's (rank, world size) under torchrun; (0, 1) otherwise."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def launch(
    spec: dict[str, Any], env: dict[str, str], on_line: Callable[[dict[str, Any]], None]
) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """Run the probe's child on ``spec["nproc"]`` ranks under torchrun; stream rank 0's trial
    lines. Returns rank 0's final message and every rank's summary line.

    torchrun dies with this process (``PR_SET_PDEATHSIG``), its ranks with torchrun; when a rank
    fails torchrun stops the others and names the first failure, which is raised here.
    """
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(spec["nproc"]),
        "-m",
        "batchfit.search.probe",
        json.dumps(spec, allow_nan=False),
    ]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**env, "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1")},
        preexec_fn=_die_with_parent if sys.platform == "linux" else None,
    )
    final: dict[str, Any] | None = None
    ranks: list[dict[str, Any]] = []
    try:
        assert proc.stdout is not None and proc.stderr is not None
        for line in proc.stdout:
            try:
                message = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "rank_summary" in message:
                ranks.append(message["rank_summary"])
            elif "trial" in message or "start" in message:
                on_line(message)
            else:
                final = message
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    refused = [r for r in ranks if "usage_error" in r]
    if refused:  # a rank's own refusal (its budget cannot hold the model) says more than a crash
        first = min(refused, key=lambda r: r["rank"])
        raise (NoFitError if first.get("no_fit") else UsageError)(
            f"rank {first['rank']}: {first['usage_error']}"
        )
    if proc.returncode != 0 or final is None:
        raise RankFailure(failure(err, proc.returncode))
    return final, ranks


def failure(stderr: str, returncode: int) -> str:
    """One line from torchrun's report of its first failed rank."""
    rank = re.search(r"rank\s*:\s*(\d+)", stderr)
    code = re.search(r"exitcode\s*:\s*(-?\d+)", stderr)
    if returncode == 0:
        return "the probe's ranks ended without a result (rank 0's report could not be read)"
    if rank is None:
        tail = stderr.strip().splitlines()[-1] if stderr.strip() else f"exit code {returncode}"
        return f"the probe's ranks failed: {tail}"
    how = f"exit code {code.group(1)}" if code else f"torchrun exit code {returncode}"
    if code and int(code.group(1)) < 0:
        number = -int(code.group(1))
        how = f"killed by signal {number} ({signal.Signals(number).name})"
        if number == signal.SIGKILL:
            how += ", out of memory?"
    return f"rank {rank.group(1)} died ({how}): the probe has no result"


def _die_with_parent() -> None:
    die_with_parent()


def init(device_type: str) -> Any:
    """Join the real process group of this torchrun rank; its device (CUDA: the local rank's)."""
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device_type == "cuda":
        torch.cuda.set_device(local)
        dist.init_process_group("nccl")
        return torch.device("cuda", local)
    dist.init_process_group("gloo")
    return torch.device("cpu")


def gather(summary: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Every rank's summary, on every rank (None when no process group was joined)."""
    if not dist.is_initialized():
        return None
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, summary)
    return out


def finish() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def agree_min(value: int, device: torch.device) -> int:
    """The smallest ``value`` over the ranks (the first size: the tightest rank's)."""
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return int(tensor.item())


def failed_ranks(failed: bool, device: torch.device) -> list[int]:
    """Which ranks report ``failed`` (every rank learns all of them)."""
    flags = torch.zeros(dist.get_world_size(), dtype=torch.uint8, device=device)
    flags[dist.get_rank()] = int(failed)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return [i for i, f in enumerate(flags.tolist()) if f]


def wrapper(setup: TrainingSetup, device: torch.device) -> Callable[[Any], Any]:
    """What ``step_parts`` wraps the model in on this rank: DDP with its buckets unreduced, or
    FSDP2 over a fake process group (see the module docstring)."""
    if setup.sharding == "fsdp":
        # torch's test utilities load only for an FSDP probe; importing them registers "fake"
        from torch.testing._internal.distributed.fake_pg import FakeStore

        del FakeStore
        group = dist.new_group(backend="fake")
        mesh = DeviceMesh.from_group(group, device.type)
        return lambda net: shard(net, setup, mesh)

    def ddp(net: Any) -> Any:
        # DDP's own collectives (the unused-parameter map, the bucket rebuild, buffer
        # broadcasts) run inside forward and backward: its memory is stood in for instead,
        # a flat buffer the size of the trainable gradients, as its buckets are
        # (gradient_as_bucket_view=False; measured on 2 gloo ranks, benchmarks/distributed.py)
        size = sum(p.numel() * p.element_size() for p in net.parameters() if p.requires_grad)
        net.ddp_buckets_stand_in = torch.empty(size, dtype=torch.uint8, device=device)
        return net

    return ddp


def note(setup: TrainingSetup, nproc: int, backend: str) -> str:
    how = (
        "FSDP2 over a fake group of the same size (real shards and buffers)"
        if setup.sharding == "fsdp"
        else "DDP's gradient buckets held as a buffer of their size"
    )
    return (
        f"{nproc} ranks ({backend}) ran every trial and agreed on each; {how}: memory and "
        "compute per rank are real, communication is not run, so samples/s leaves it out"
    )
