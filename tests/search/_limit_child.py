"""Subprocess for tests/search/test_search.py: searches under a real OS memory limit.

Run with MALLOC_MMAP_THRESHOLD_=65536 so freed blocks go back to the kernel. Prints one JSON.
"""

from __future__ import annotations

import json
import resource
import sys
from collections.abc import Callable

import torch

from batchfit._oom import is_oom, release_memory
from batchfit.search import find_batch_size

MIB = 1 << 20
PER_SAMPLE = 8 * MIB  # activations of one sample in the toy step


def main() -> None:
    mode = sys.argv[1]
    torch.manual_seed(0)
    net = torch.nn.Linear(256, 256)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)

    def step(batch: torch.Tensor) -> None:
        opt.zero_grad(set_to_none=True)
        # memory grows with the batch: a real allocation the OS limit can refuse
        scratch = torch.ones(batch.shape[0] * PER_SAMPLE, dtype=torch.uint8)
        loss = net(batch).square().mean() + scratch[:1].float().mean() * 0
        loss.backward()
        opt.step()
        del scratch

    def make(n: int) -> torch.Tensor:
        return torch.randn(n, 256)

    step(make(1))  # optimizer state exists before the search, as in a real run
    budget = 200 * MIB
    if mode == "search":
        before = {k: v.clone() for k, v in net.state_dict().items()}
        opt_before = opt.state_dict()["state"][0]["exp_avg"].clone()
        result = find_batch_size(
            step,
            make,
            device="cpu",
            memory_budget=budget,
            start=40,  # above the limit: the first trial fails for real
            model=net,
            optimizer=opt,
            steps_per_trial=2,
        )
        same = all(torch.equal(before[k], v) for k, v in net.state_dict().items())
        same_opt = torch.equal(opt_before, opt.state_dict()["state"][0]["exp_avg"])
        # truth: bisect fresh sizes under the same limit, one real step each
        limit_soft = resource.getrlimit(resource.RLIMIT_DATA)
        truth = _largest_fitting(step, make, budget, net, opt)
        print(
            json.dumps(
                {
                    "result": result.to_json(),
                    "state_restored": same,
                    "optimizer_restored": same_opt,
                    "truth": truth,
                    "limit_restored": limit_soft == resource.getrlimit(resource.RLIMIT_DATA),
                }
            )
        )
    elif mode == "creep":
        from batchfit._memwatch import MemoryWatch, status_bytes
        from batchfit.search._trialrun import TrialRun

        watch = MemoryWatch(torch.device("cpu"), budget, model=net, optimizer=opt)
        rss = []
        with watch:
            for _ in range(20):
                run = TrialRun(64, watch)  # 512 MiB: always fails
                run.steps(step, make, 2)
                assert not run.ok
                rss.append(status_bytes("VmRSS"))
        print(json.dumps({"rss": rss}))


def _largest_fitting(
    step: Callable[[torch.Tensor], None],
    make: Callable[[int], torch.Tensor],
    budget: int,
    net: torch.nn.Module,
    opt: torch.optim.Optimizer,
) -> int:
    from batchfit._memwatch import MemoryWatch

    def fits(n: int) -> bool:
        failed = False
        with MemoryWatch(torch.device("cpu"), budget, model=net, optimizer=opt):
            try:
                step(make(n))
            except RuntimeError as e:
                if not is_oom(e):
                    raise
                failed = True
        net.zero_grad(set_to_none=True)
        release_memory()
        return not failed

    lo, hi = 1, 64
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


if __name__ == "__main__":
    main()
