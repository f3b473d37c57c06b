import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from batchfit.search import PLATEAU, find_batch_size

CHILD = Path(__file__).with_name("_search_child.py")


def _child(mode: str) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, str(CHILD), mode], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


class Law:
    """A step whose memory law is known: it raises a real OOM type above ``limit``."""

    def __init__(self, limit: int, seconds_per_sample: float = 0.0, plateau_from: int = 10**9):
        self.limit, self.sps, self.plateau_from = limit, seconds_per_sample, plateau_from
        self.sizes: list[int] = []

    def step(self, batch: torch.Tensor) -> None:
        n = batch.shape[0]
        self.sizes.append(n)
        if n > self.limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {n} GiB")
        # time per step: grows with n, per-sample time falls until the plateau
        time.sleep(0.002 + self.sps * max(n, n * n / self.plateau_from))


def test_known_law_never_returns_an_untested_size():
    law = Law(limit=37)
    result = find_batch_size(
        law.step, lambda n: torch.zeros(n, 1), high=200, start=16, steps_per_trial=2, choose="max"
    )
    ran_ok = {t.micro_batch_size for t in result.trials if t.ok}
    assert result.max_fitting_micro_batch == 37 and result.micro_batch_size in ran_ok
    assert all(t.micro_batch_size <= 200 for t in result.trials)
    assert len(result.trials) <= 10


def test_plateau_rule_prefers_the_smaller_of_equally_fast_sizes():
    # Per-sample time stops falling at 8: sizes >= 8 are within 2% of each other.
    law = Law(limit=64, seconds_per_sample=0.0005, plateau_from=8)
    result = find_batch_size(
        law.step, lambda n: torch.zeros(n, 1), high=64, start=64, steps_per_trial=3
    )
    speeds = {t.micro_batch_size: t.samples_per_s for t in result.trials if t.ok}
    best = max(speeds.values())
    assert speeds[result.micro_batch_size] >= (1 - PLATEAU) * best
    assert all(n >= result.micro_batch_size for n, s in speeds.items() if s >= (1 - PLATEAU) * best)


def test_bad_arguments():
    with pytest.raises(ValueError, match="low <= high"):
        find_batch_size(print, lambda n: n, low=4, high=2)
    with pytest.raises(ValueError, match="steps_per_trial"):
        find_batch_size(print, lambda n: n, high=4, steps_per_trial=1)
    with pytest.raises(ValueError, match="memory_budget"):
        find_batch_size(print, lambda n: n)
    with pytest.raises(ValueError, match="even a micro-batch of 1"):
        find_batch_size(Law(limit=0).step, lambda n: torch.zeros(n, 1), high=4)


def test_non_oom_errors_propagate():
    def broken(_batch: torch.Tensor) -> None:
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    with pytest.raises(RuntimeError, match="shapes"):
        find_batch_size(broken, lambda n: torch.zeros(n, 1), high=4)


@pytest.mark.slow
def test_real_cpu_oom_under_an_os_limit():
    data = _child("search")
    result = data["result"]
    assert data["state_restored"] and data["optimizer_restored"] and data["limit_restored"]
    assert result["ooms"] >= 1  # a real allocator failure happened and was survived
    assert result["max_fitting_micro_batch"] >= 0.9 * data["truth"]
    assert result["max_fitting_micro_batch"] <= data["truth"]
    ok_sizes = {t["micro_batch_size"] for t in result["trials"] if t["ok"]}
    assert result["micro_batch_size"] in ok_sizes
    assert len(result["trials"]) <= 8


@pytest.mark.slow
def test_twenty_ooms_in_a_row_leave_memory_flat():
    rss = _child("creep")["rss"]
    assert max(rss[1:]) <= 1.05 * rss[1]


@pytest.mark.slow
def test_two_ranks_agree_on_the_smaller_budget(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    worker = Path(__file__).with_name("_search_ddp_worker.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(port),
            str(worker),
            str(tmp_path),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["sizes"] == ranks[1]["sizes"]  # the same trials, in the same order
    assert ranks[0]["choice"] == ranks[1]["choice"] == 20
    assert ranks[0]["max"] == ranks[1]["max"] == 20
