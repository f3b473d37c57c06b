"""``MicroBatcher``: an out-of-memory error redoes the global batch at half the micro-batch,
and the result equals a run at that size from the start.

The real OOMs come from PyTorch's CPU allocator under an OS limit (``RLIMIT_DATA``), in a child
process (``_oom_child.py``) run with ``MALLOC_MMAP_THRESHOLD_=65536`` so freed blocks leave
the process. The budget, 64 MiB above what the child holds before training, was measured:
a micro-batch of 8 of ``wide_mlp`` needs 46-50 MiB, one of 16 needs 80-90 MiB. One child runs
both of the child's modes, each with its own limit (torch is imported once).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from torch import nn

from batchfit.train import Accumulator, MicroBatcher, StepResult
from tests._tiny import wide_batches, wide_mlp, wide_step_fn

pytestmark = pytest.mark.usefixtures("frozen_gc")


ROOT = Path(__file__).resolve().parents[2]
BUDGET_MIB = 64


# The child's modes one after the other in one process, each under a limit set afresh from
# what the process holds when it starts: ``repeat`` first, in the fresh process, as when run
# alone. The objects alive before the first (torch, batchfit, and what torch loads when the
# first optimizer is made: torch._dynamo's 800 modules) are moved out of the collector's reach,
# as ``frozen_gc`` does in this process: each out-of-memory error's ``gc.collect()`` then scans
# only what the runs made (under a millisecond, not 60). After each mode a line on stderr says
# how it ended.
MODES = ("repeat", "recover")
_RUN_MODES = """
import gc, runpy, sys, traceback
import torch
import batchfit.train, tests._tiny
torch.optim.AdamW(torch.nn.Linear(1, 1).parameters())
gc.collect()
gc.freeze()
child, budget, mark, *runs = sys.argv[1:]
failed = False
for mode, out in zip(runs[::2], runs[1::2]):
    sys.argv = [child, mode, budget, out]
    ok = True
    try:
        runpy.run_path(child, run_name="__main__")
    except BaseException:
        traceback.print_exc()
        ok, failed = False, True
    print(mark + mode + (" ok" if ok else " failed"), file=sys.stderr, flush=True)
sys.exit(1 if failed else 0)
"""
_MARK = "--- _oom_child.py mode: "


class ChildRun(NamedTuple):
    """One mode's share of the child: whether it ended well, its stderr, its output folder."""

    ok: bool
    stderr: str
    out: Path


@pytest.fixture(scope="module")
def oom_child(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ChildRun]:
    """``_oom_child.py MODE 64 OUT`` for each of ``MODES``, in one child process."""
    outs = {mode: tmp_path_factory.mktemp(mode) for mode in MODES}
    env = {
        **os.environ,
        "MALLOC_MMAP_THRESHOLD_": "65536",
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
    }
    child = str(Path(__file__).with_name("_oom_child.py"))
    runs = [str(a) for mode in MODES for a in (mode, outs[mode])]
    proc = subprocess.run(
        [sys.executable, "-c", _RUN_MODES, child, str(BUDGET_MIB), _MARK, *runs],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    shares: dict[str, ChildRun] = {}
    rest = proc.stderr
    for mode in MODES:
        text, found, rest = rest.partition(f"{_MARK}{mode} ")
        status, _, rest = rest.partition("\n")
        ok = bool(found) and status == "ok"
        shares[mode] = ChildRun(ok, text if found else text + proc.stderr[-3000:], outs[mode])
    return shares


@pytest.mark.slow
def test_real_cpu_oom_recovers_at_half_size(oom_child: dict[str, ChildRun]) -> None:
    run = oom_child["recover"]
    assert run.ok, run.stderr[-3000:]
    assert "DefaultCPUAllocator: can't allocate memory" in run.stderr
    assert "out of memory at micro-batch 16" in run.stderr
    record = json.loads((run.out / "record.json").read_text())
    assert record["ooms"] == [1, 0]  # the smaller size persists: no second OOM
    assert record["micro"] == [8, 8]

    # The same two global batches at micro-batch 8 from the start, with a plain loop.
    model = wide_mlp()
    acc = Accumulator(model, torch.optim.AdamW(model.parameters(), lr=1e-3), 4)
    step_fn = wide_step_fn(model)
    torch.manual_seed(0)
    for batch in wide_batches(2, 32):
        for start in range(0, 32, 8):
            with acc.micro_step():
                acc.backward(*step_fn(batch[start : start + 8]))
    recovered = torch.load(run.out / "params.pt")
    for name, value in model.state_dict().items():
        torch.testing.assert_close(recovered[name], value, atol=1e-6, rtol=0)


@pytest.mark.slow
def test_repeated_real_ooms_leave_memory_flat(oom_child: dict[str, ChildRun]) -> None:
    run = oom_child["repeat"]
    assert run.ok, run.stderr[-3000:]
    assert "DefaultCPUAllocator: can't allocate memory" in run.stderr
    record = json.loads((run.out / "record.json").read_text())
    assert record["ooms"] == [1] * 21
    rss = record["rss"]
    # after the first OOM and recovery (warm), 20 more leave the resident set where it was
    assert max(rss[1:]) <= rss[0] * 1.05
    assert min(rss[1:]) >= rss[0] * 0.95


# --- in-process: OOMs raised where real ones would be, on a small model with dropout ----------


def _small(seed: int = 0, middle: str = "dropout") -> nn.Sequential:
    """Linear, then dropout (draws random numbers) or BatchNorm (keeps running statistics)."""
    torch.manual_seed(seed)
    norm = nn.BatchNorm1d(32) if middle == "batchnorm" else nn.Dropout(0.5)
    return nn.Sequential(nn.Linear(6, 32), norm, nn.Tanh(), nn.Linear(32, 1))


def _data(n: int = 32, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=gen), torch.randn(n, generator=gen)


def _step_fn(
    model: nn.Sequential, fail: Callable[[int], bool] = lambda size: False
) -> Callable[[Any], tuple[torch.Tensor, int]]:
    """Forward of a micro-batch; ``fail(size)`` makes its backward raise half way through."""

    def step_fn(micro: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, int]:
        x, y = micro
        hidden = model[0](x)
        if fail(len(x)):
            # fires after the last layer's gradients have been accumulated: a partial step
            hidden.register_hook(lambda g: _raise_oom())
        out = model[3](model[2](model[1](hidden))).squeeze(1)
        return ((out - y) ** 2).sum(), len(y)

    return step_fn


def _raise_oom() -> None:
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB (simulated)")


def _reference(
    micro: int, batches: list[tuple[torch.Tensor, torch.Tensor]], middle: str = "dropout"
) -> nn.Module:
    model = _small(middle=middle)
    acc = Accumulator(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    batcher = MicroBatcher(acc, micro)
    step_fn = _step_fn(model)
    torch.manual_seed(7)
    for batch in batches:
        batcher.run(batch, step_fn)
    return model


@pytest.mark.parametrize("middle", ["dropout", "batchnorm"])
def test_oom_mid_backward_redoes_batch_exactly(
    middle: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Parameters and buffers (BatchNorm's running statistics and batch count) equal a run at
    the smaller size from the start: the aborted micro-batches leave nothing behind."""
    batches = [_data(seed=s) for s in range(3)]
    reference = _reference(8, batches, middle)
    model = _small(middle=middle)
    batcher = MicroBatcher(Accumulator(model, torch.optim.AdamW(model.parameters(), lr=1e-2)), 16)
    calls: list[int] = []

    def fail(size: int) -> bool:
        calls.append(size)
        return size == 16 and len(calls) == 2  # the second micro-step of the first batch

    step_fn = _step_fn(model, fail)
    torch.manual_seed(7)
    with caplog.at_level(logging.WARNING, logger="batchfit.train.recover"):
        results = [batcher.run(batch, step_fn) for batch in batches]
    assert [(r.micro_batch_size, r.ooms, r.micro_steps) for r in results] == [
        (8, 1, 4),
        (8, 0, 4),
        (8, 0, 4),
    ]
    assert "out of memory at micro-batch 16" in caplog.text
    assert "redoing the global batch of 32 samples" in caplog.text
    state, expected = model.state_dict(), reference.state_dict()
    assert list(state) == list(expected)
    for name, value in state.items():
        torch.testing.assert_close(
            value, expected[name], atol=1e-6, rtol=0, msg=lambda m, n=name: f"{n}: {m}"
        )


def test_without_rng_restore_dropout_would_differ() -> None:
    """Negative control: the redo only matches because the random state is put back."""
    batches = [_data()]
    reference = _reference(8, batches)
    model = _small()
    acc = Accumulator(model, torch.optim.AdamW(model.parameters(), lr=1e-2), 4)
    step_fn = _step_fn(model)
    torch.manual_seed(7)
    torch.rand(16, 32)  # what a failed first micro-step of 16 would have drawn
    x, y = batches[0]
    for start in range(0, 32, 8):
        with acc.micro_step():
            acc.backward(*step_fn((x[start : start + 8], y[start : start + 8])))
    diff = max(
        (a - b).abs().max().item()
        for a, b in zip(model.parameters(), reference.parameters(), strict=True)
    )
    assert diff > 1e-4


def test_grows_back_after_clean_steps(caplog: pytest.LogCaptureFixture) -> None:
    model = _small()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.01))
    batcher = MicroBatcher(acc, 16, grow_after_steps=2)
    failed: list[int] = []

    def fail(size: int) -> bool:
        if size == 16 and not failed:
            failed.append(size)
            return True
        return False

    step_fn = _step_fn(model, fail)
    with caplog.at_level(logging.INFO, logger="batchfit.train.recover"):
        sizes = [batcher.run(_data(), step_fn).micro_batch_size for _ in range(4)]
    assert sizes == [8, 8, 8, 16]
    assert "trying 16" in caplog.text
    assert batcher.num_ooms == 1


def test_smallest_size_still_out_of_memory() -> None:
    model = _small()
    batcher = MicroBatcher(Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1)), 4)
    with pytest.raises(torch.OutOfMemoryError, match="micro-batch 1, the smallest allowed"):
        batcher.run(_data(8), _step_fn(model, lambda size: True))
    assert batcher.num_ooms == 3  # 4, 2, 1
    assert all(p.grad is None for p in model.parameters())


def test_other_errors_are_not_retried() -> None:
    model = _small()
    batcher = MicroBatcher(Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1)), 4)

    def step_fn(micro: Any) -> tuple[torch.Tensor, int]:
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        batcher.run(_data(8), step_fn)
    assert batcher.num_ooms == 0 and batcher.micro_batch_size == 4


class Pair(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


@pytest.mark.parametrize("form", ["tuple", "list", "dict", "namedtuple", "samples"])
def test_batch_forms(form: str) -> None:
    """Every batch form splits into the same micro-batches: the same step."""
    x, y = _data(10)
    batch: Any = {
        "tuple": (x, y),
        "list": [x, y],
        "dict": {"x": x, "y": y, "note": "kept whole"},
        "namedtuple": Pair(x, y),
        "samples": [(x[i], y[i]) for i in range(10)],
    }[form]
    model = _small()
    model.eval()  # no dropout: the forms must agree exactly
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    inner = _step_fn(model)

    def step_fn(micro: Any) -> tuple[torch.Tensor, int]:
        if isinstance(micro, dict):
            assert micro["note"] == "kept whole"
            return inner((micro["x"], micro["y"]))
        if form == "samples":
            return inner((torch.stack([s[0] for s in micro]), torch.stack([s[1] for s in micro])))
        return inner(tuple(micro))

    result = MicroBatcher(acc, 4).run(batch, step_fn)
    assert (result.micro_steps, result.num_items) == (3, 10.0)
    ref = _small()
    ref.eval()
    torch.optim.SGD(ref.parameters(), lr=0.1)
    loss = ((ref(x).squeeze(1) - y) ** 2).mean()
    loss.backward()
    assert result.loss == pytest.approx(float(loss), rel=1e-6)
    for p, r in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, r - 0.1 * r.grad, atol=1e-6, rtol=0)


def test_mismatched_fields() -> None:
    model = _small()
    batcher = MicroBatcher(Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1)), 4)
    with pytest.raises(ValueError, match="different lengths"):
        batcher.run((torch.zeros(8, 6), torch.zeros(7)), _step_fn(model))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"micro_batch_size": 0}, "micro_batch_size must be a positive integer"),
        ({"micro_batch_size": 4, "min_micro_batch_size": 8}, "above micro_batch_size"),
        ({"micro_batch_size": 4, "grow_after_steps": 0}, "grow_after_steps"),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], match: str) -> None:
    model = _small()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match=match):
        MicroBatcher(acc, **kwargs)


def test_run_refuses_a_half_done_step() -> None:
    model = _small()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), 2)
    with acc.micro_step():
        acc.backward(model(torch.ones(1, 6)).sum(), 1)
    with pytest.raises(RuntimeError, match="middle of a global step"):
        MicroBatcher(acc, 4).run(_data(8), _step_fn(model))


def test_result_type() -> None:
    model = _small()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    result = MicroBatcher(acc, 3).run(_data(7), _step_fn(model))
    assert isinstance(result, StepResult)
    assert (result.micro_batch_size, result.micro_steps, result.num_items) == (3, 3, 7.0)


def test_empty_batch_and_wrong_step_fn_return_are_clear_errors():
    import pytest
    import torch

    from batchfit.train import Accumulator, MicroBatcher

    model = torch.nn.Linear(2, 1)
    batcher = MicroBatcher(Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1)), 2)
    with pytest.raises(ValueError, match="empty"):
        batcher.run(torch.zeros(0, 2), lambda mb: (model(mb).sum(), len(mb)))
    with pytest.raises(TypeError, match=r"\(loss_sum, num_items\)"):
        batcher.run(torch.zeros(4, 2), lambda mb: model(mb).sum())
