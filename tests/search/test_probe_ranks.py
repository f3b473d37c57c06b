"""The probe on several torchrun ranks (gloo): they agree under different budgets, a dead rank
ends the probe with its number and leaves no process behind."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from batchfit.errors import RankFailure, UsageError
from batchfit.search import _ranks
from batchfit.search import probe as _probe
from batchfit.spec import TrainingSetup
from tests._cli import run_captured

TINY = {
    "model_type": "gpt2",
    "architectures": ["GPT2LMHeadModel"],
    "n_embd": 128,
    "n_layer": 2,
    "n_head": 4,
    "n_positions": 512,
    "vocab_size": 4000,
    "bos_token_id": 0,
    "eos_token_id": 0,
}
MIB = 2**20


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One config path for the file's probes: a dry run is cached under the model's path, so
    the ranks' predictions at sizes an earlier probe predicted are read back."""
    path = tmp_path_factory.mktemp("tiny") / "config.json"
    path.write_text(json.dumps(TINY))
    return str(path)


def _spec(model: str, sharding: str, **extra: Any) -> dict[str, Any]:
    setup = TrainingSetup(num_gpus=2, sharding=sharding)  # type: ignore[arg-type]
    spec = _probe.make_spec(model, setup, "cpu", 64, 400 * MIB, "max", 16, 2, nproc=2)
    return {**spec, **extra}


def _probe_processes() -> list[int]:
    """This process's descendants that run the probe (torchrun and its ranks): another test's
    probe child, in another pytest-xdist worker, is not this test's."""
    me, parents, pids = os.getpid(), {}, []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes()
                # the parent's pid follows the command's name, in parentheses, and the state
                parents[int(entry.name)] = int(
                    (entry / "stat").read_text().rsplit(")", 1)[1].split()[1]
                )
            except (OSError, IndexError, ValueError):
                continue
            if b"batchfit.search.probe" in cmdline:
                pids.append(int(entry.name))

    def mine(pid: int) -> bool:
        while pid > 1:
            pid = parents.get(pid, 0)
            if pid == me:
                return True
        return False

    return [pid for pid in pids if mine(pid)]


class CliRun(NamedTuple):
    """``batchfit probe --nproc 2 --json`` run once: its exit, output, and what it launched."""

    code: int
    out: str
    err: str
    spec: dict[str, Any]
    final: dict[str, Any] | None
    ranks: list[dict[str, Any]]


@pytest.fixture(scope="module", params=["ddp", "fsdp"])
def cli_run(request: pytest.FixtureRequest, tiny: str) -> Iterator[CliRun]:
    """``batchfit probe TINY --nproc 2 --sharding S --memory-budget 400MiB --max-micro-batch 16
    --choose max --steps-per-trial 2 --json`` once per sharding, rank 1 given 60 MiB
    (``rank_budgets``) where rank 0 keeps the 400 MiB: the command's exit and output, and the
    spec, final message and rank summaries of its launch."""
    launched: list[tuple[dict[str, Any], dict[str, Any] | None, list[dict[str, Any]]]] = []
    launch = _ranks.launch

    def tight_rank_one(
        spec: dict[str, Any], env: dict[str, str], on_line: Callable[[dict[str, Any]], None]
    ) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
        final, ranks = launch(
            {**spec, "rank_budgets": [spec["memory_budget"], 60 * MIB]}, env, on_line
        )
        launched.append((spec, final, ranks))
        return final, ranks

    args = ["probe", tiny, "--device", "cpu", "--seq-len", "64", "--memory-budget", "400MiB"]
    args += ["--nproc", "2", "--sharding", request.param, "--max-micro-batch", "16"]
    args += ["--choose", "max", "--steps-per-trial", "2", "--json"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_ranks, "launch", tight_rank_one)
        code, out, err = run_captured(args)
    ((spec, final, ranks),) = launched
    yield CliRun(code, out, err, spec, final, ranks)


@pytest.mark.slow
def test_ranks_under_different_budgets_agree(cli_run: CliRun) -> None:
    """Rank 0 has room for every size up to 16 (400 MiB), rank 1 for a few (60 MiB): both
    run the same trials and end on the same sizes, the tight rank's, below 16."""
    final, ranks = cli_run.final, cli_run.ranks
    assert final is not None and "result" in final, (final, cli_run.err[-2000:])
    assert [r["rank"] for r in sorted(ranks, key=lambda r: r["rank"])] == [0, 1]
    assert ranks[0]["micro_batch_size"] == ranks[1]["micro_batch_size"]
    assert ranks[0]["max_fitting_micro_batch"] == ranks[1]["max_fitting_micro_batch"]
    result = final["result"]
    assert 1 <= result["max_fitting_micro_batch"] < 16
    assert any("2 ranks (gloo)" in note for note in result["notes"])


@pytest.mark.slow
def test_cli_probe_with_two_ranks(cli_run: CliRun) -> None:
    """The command gives the ranks its setup, budget and largest size, and prints rank 0's
    result, with the sharding's note."""
    assert cli_run.code == 0, cli_run.err[-2000:]
    sharding = cli_run.spec["setup"]["sharding"]
    assert cli_run.spec["nproc"] == 2 and cli_run.spec["setup"]["num_gpus"] == 2
    assert cli_run.spec["memory_budget"] == 400 * MIB and cli_run.spec["high"] == 16
    assert cli_run.spec["choose"] == "max" and cli_run.spec["steps_per_trial"] == 2
    data = json.loads(cli_run.out)
    assert 1 <= data["micro_batch_size"] <= 16
    assert data["micro_batch_size"] == cli_run.ranks[0]["micro_batch_size"]
    assert any(("FSDP2" if sharding == "fsdp" else "DDP's") in note for note in data["notes"])


@pytest.mark.slow
def test_a_dead_rank_ends_the_probe_naming_it(tiny: str) -> None:
    """SIGKILL rank 1 once the trials start: the probe raises RankFailure naming rank 1,
    and no process of the probe (torchrun, either rank) is left."""
    launched: list[int] = []
    killed: list[int] = []

    def on_line(message: dict[str, Any]) -> None:
        if "start" not in message or killed:
            return
        launched.extend(_probe_processes())  # torchrun and both ranks, all alive at the start
        for pid in launched:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            if b"RANK=1" in environ:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)

    with pytest.raises(RankFailure, match=r"rank 1 died \(killed by signal 9"):
        _probe.run_ranks(_spec(tiny, "ddp"), on_line)
    assert killed and len(launched) == 3
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{pid}").exists() for pid in launched) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in launched if Path(f"/proc/{pid}").exists()]


def test_probe_refuses_sharding_without_ranks_and_deepspeed_ranks() -> None:
    from batchfit.cli.probe import _ranks_setup

    with pytest.raises(UsageError, match="nproc"):
        _ranks_setup(TrainingSetup(sharding="fsdp"), 1, "cpu")
    with pytest.raises(UsageError, match="DeepSpeed"):
        _ranks_setup(TrainingSetup(sharding="zero2"), 2, "cpu")
    with pytest.raises(UsageError, match="disagrees"):
        _ranks_setup(TrainingSetup(num_gpus=4), 2, "cpu")
    assert _ranks_setup(TrainingSetup(), 2, "cpu").sharding == "ddp"


def test_torchruns_failure_report_becomes_one_line() -> None:
    report = (
        "Root Cause (first observed failure):\n[0]:\n  time : x\n  host : localhost\n"
        "  rank      : 1 (local_rank: 1)\n  exitcode  : -9 (pid: 123)\n"
    )
    assert _ranks.failure(report, 1) == (
        "rank 1 died (killed by signal 9 (SIGKILL), out of memory?): the probe has no result"
    )
    assert "exit code 3" in _ranks.failure("rank : 0\nexitcode : 3\n", 1)
    assert _ranks.failure("", 7) == "the probe's ranks failed: exit code 7"
