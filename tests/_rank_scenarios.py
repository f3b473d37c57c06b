"""The two-rank (gloo) scenarios of the tests, in one launch per test run.

Each scenario is a worker of its own that writes its files into the folder it is given
(``tests/search/_ranks_worker.py``, ``tests/train/_ddp_worker.py``, ``_gns_worker.py``,
``_fsdp_worker.py``, ``tests/integrations/_deepspeed_worker.py``), or prints its figures
(``benchmarks/_fsdp_truth.py``: into the folder's ``stdout.txt``). Run as a script
(``python _rank_scenarios.py OUT NAME...`` with torchrun's variables), a rank joins the process
group once and runs the named workers' ``main`` in turn, each into ``OUT/NAME``: the ranks
import torch (and start DDP's and FSDP2's lazy imports) once for all of them, not once per
test file.

``scenario_out`` is the test files' side: the scenarios of every test of the session that reads
one (through the fixtures of ``FIXTURES``) run in one launch, made by the first test that needs
it; under pytest-xdist the other worker waits for that launch and reads the same folder.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the ranks run this file without pytest
    import pytest

ROOT = Path(__file__).resolve().parents[1]
# worker modules (or scripts, by their path in the repository) in the order they run: the
# FSDP2 peak measurement first, in a process that has run nothing else; DeepSpeed, which
# patches torch's collectives, last
WORKERS = {
    "fsdp_truth": "benchmarks/_fsdp_truth.py",
    "search": "tests.search._ranks_worker",
    "ddp": "tests.train._ddp_worker",
    "gns": "tests.train._gns_worker",
    "fsdp": "tests.train._fsdp_worker",
    "deepspeed": "tests.integrations._deepspeed_worker",
}
# the module fixture through which a test file reads each scenario's folder
FIXTURES = {
    "fsdp_truth_out": "fsdp_truth",
    "search_ranks_out": "search",
    "ddp_out": "ddp",
    "gns_out": "gns",
    "fsdp_out": "fsdp",
    "ds_out": "deepspeed",
}
# freed blocks go back to the OS, so RLIMIT_DATA behaves like a GPU budget (the OOM scenarios
# of FSDP2 and DeepSpeed); DeepSpeed runs on the CPU
ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "DS_ACCELERATOR": "cpu"}


def scenario_out(request: pytest.FixtureRequest, name: str) -> Path:
    """The folder scenario ``name`` wrote into, from this test run's one launch of every
    scenario its collected tests read; asserts that the launch succeeded."""
    wanted = {name}
    for item in request.session.items:
        wanted |= {FIXTURES[f] for f in getattr(item, "fixturenames", ()) if f in FIXTURES}
    names = [n for n in WORKERS if n in wanted]

    from tests._per_run import once_per_run  # pytest's side: the ranks run this file alone

    def launch(out: Path) -> dict[str, Any]:
        from tests._torchrun import torchrun

        for n in names:
            (out / n).mkdir(parents=True, exist_ok=True)
            (out / n / "argv.json").write_text(json.dumps(_arguments(n, out / n)))
        proc = torchrun(Path(__file__), out, *names, attempts=3, env=ENV)
        return {"returncode": proc.returncode, "output": proc.stdout[-2000:] + proc.stderr[-4000:]}

    out, done = once_per_run(request, "ranks-" + "-".join(names), launch)
    assert "error" not in done, done["error"]
    assert done["returncode"] == 0, done["output"]
    return out / name


def _arguments(name: str, folder: Path) -> list[str]:
    """A worker's command-line arguments: its folder; the FSDP2 peak measurement's spec, of
    ``tests/memory/test_fsdp_trace.py``'s model (its config written into the folder)."""
    if name != "fsdp_truth":
        return [str(folder)]
    from tests.memory.test_fsdp_trace import TINY_GPT2, TRUTH

    (folder / "config.json").write_text(json.dumps(TINY_GPT2))
    return [json.dumps({"model": str(folder / "config.json"), **TRUTH})]


def _worker(name: str) -> Any:
    target = WORKERS[name]
    if not target.endswith(".py"):
        return importlib.import_module(target)
    spec = importlib.util.spec_from_file_location(Path(target).stem, ROOT / target)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    import torch.distributed as dist

    out, names = Path(sys.argv[1]), sys.argv[2:]
    dist.init_process_group("gloo")
    init, destroy = dist.init_process_group, dist.destroy_process_group
    # each worker joins and leaves the group itself: here it finds the group joined, and leaves
    # it for the next worker
    dist.init_process_group = lambda *args, **kwargs: None  # type: ignore[assignment]
    dist.destroy_process_group = lambda *args, **kwargs: None  # type: ignore[assignment]
    try:
        for name in names:
            sys.argv = [sys.argv[0], *json.loads((out / name / "argv.json").read_text())]
            printed = out / name / f"stdout{dist.get_rank()}.txt"
            with open(printed, "w") as stdout, contextlib.redirect_stdout(stdout):
                _worker(name).main()
            dist.barrier()  # no rank starts the next scenario while the other ends this one
    finally:
        dist.init_process_group, dist.destroy_process_group = init, destroy  # type: ignore[assignment]
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
