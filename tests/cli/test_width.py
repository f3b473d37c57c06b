"""Answers that fit the terminal: rendered at 80, 120 and 200 columns, no line is longer than
the width, no technique name is broken across lines, the plan's first line names its precision,
and a line names the columns a narrow table leaves out. Each answer is computed once (analytic
engine) and drawn at each width."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import pytest
from rich.cells import cell_len

from batchfit.cli import render
from batchfit.cli.render import catalog, estimate, plan
from batchfit.hardware import get_gpu
from batchfit.memory.estimate import estimate as estimate_memory
from batchfit.memory.types import MemoryEstimate
from batchfit.models import ModelInfo, resolve_model
from batchfit.plan import FitRow, Plan, PlanRequest, fit_table, make_plan
from batchfit.spec import TrainingSetup

WIDTHS = (80, 120, 200)
# the columns each table leaves out at 80 columns, and the ones it keeps at 200
LEFT_OUT = re.compile(r"^left out at (\d+) columns: (.+) \(a wider terminal", re.M)


@pytest.fixture(scope="module")
def gpt2() -> ModelInfo:
    return resolve_model("gpt2")


@pytest.fixture(scope="module")
def t4_plan(gpt2: ModelInfo) -> Plan:
    # a T4 has no bf16: the plan trains in amp-fp16, and its alternatives name long rungs
    return make_plan(
        gpt2, get_gpu("t4"), TrainingSetup(), seq_len=1024, global_batch=64, engine="analytic"
    )


@pytest.fixture(scope="module")
def auto_plan() -> tuple[Plan, ModelInfo]:
    """On as many H100s as pay, with the run's length and cost: every column of both tables."""
    info = resolve_model("llama-3.1-8b")
    request = PlanRequest(
        info,
        get_gpu("h100-80gb"),
        TrainingSetup(),
        seq_len=4096,
        global_batch=256,
        engine="analytic",
        num_gpus="auto",
        train_tokens=10**10,
        gpu_hour_price=2.5,
    )
    return make_plan(request), info


@pytest.fixture(scope="module")
def fits(gpt2: ModelInfo) -> list[FitRow]:
    # a few cards (the whole catalog takes seconds): fp16 and bf16 ones, long rungs among them
    gpus = [get_gpu(n) for n in ("p100", "v100-16gb", "t4", "a100-40gb", "rtx-3060", "h100-80gb")]
    return fit_table(gpt2, TrainingSetup(), gpus, seq_len=1024, engine="analytic")


@pytest.fixture(scope="module")
def t4_estimate(gpt2: ModelInfo) -> MemoryEstimate:
    return estimate_memory(
        gpt2, micro_batch_size=8, seq_len=1024, gpu=get_gpu("t4"), engine="analytic"
    )


@pytest.fixture
def draw(capsys: pytest.CaptureFixture[str]) -> Iterator[Callable[..., tuple[str, str]]]:
    """Draws an answer at a width: (stdout, stderr), both consoles that wide."""
    # the consoles' own setting (None: rich asks the terminal each time), not the width it
    # gives now: restoring a number would pin every later test's console to it
    kept = render.out._width, render.err._width

    def at(width: int, answer: Callable[[], None]) -> tuple[str, str]:
        capsys.readouterr()
        render.out.width = render.err.width = width
        answer()
        captured = capsys.readouterr()
        return captured.out, captured.err

    yield at
    render.out._width, render.err._width = kept


def _fits(text: str, width: int) -> None:
    long = [line for line in text.splitlines() if cell_len(line) > width]
    assert not long, f"{len(long)} lines over {width} columns:\n" + "\n".join(long)


def _rows(text: str, title: str, key: int) -> list[list[str]]:
    """The cells of the table under ``title``, each row's lines joined: a row goes on where
    its ``key`` cell is blank."""
    lines = text[text.index(title) :].splitlines()
    body = lines[next(i for i, ln in enumerate(lines) if ln.startswith("┡")) + 1 :]
    rows: list[list[str]] = []
    for line in body:
        if line.startswith("└"):
            break
        if not line.startswith("│"):
            continue
        cells = [c.strip() for c in line.strip("│").split("│")]
        if cells[key] or not rows:
            rows.append(cells)
        else:
            rows[-1] = [f"{a} {b}".strip() for a, b in zip(rows[-1], cells, strict=True)]
    return rows


def _names(cell: str) -> list[str]:
    """The technique names in a cell: ``a + b* (plan)`` or ``a, b (analytic)``."""
    cell = re.sub(r" \((plan|analytic|needs code|no native bf16 on this GPU)\)", "", cell)
    return [name.rstrip("*") for name in re.split(r" \+ |, ", cell)]


def _left_out(text: str) -> list[str]:
    return [m.group(2) for m in LEFT_OUT.finditer(text)]


@pytest.mark.parametrize("width", WIDTHS)
def test_plan_fits_the_width(
    width: int, t4_plan: Plan, gpt2: ModelInfo, draw: Callable[..., tuple[str, str]]
) -> None:
    out, err = draw(width, lambda: plan.plan(t4_plan, gpt2))
    _fits(out, width)
    _fits(err, width)
    assert out.splitlines()[0] == "gpt2 on 1 x t4, seq 1024, amp-fp16"
    # the time line wraps under its text, never inside a word
    assert "  time: ~" in out and "published runs it was not fitted on," in " ".join(out.split())
    rows = _rows(out, "Alternatives", key=1)
    assert len(rows) == len(t4_plan.alternatives)
    known = {t.name for a in t4_plan.alternatives for t in a.techniques}
    for row in rows:
        assert set(_names(row[0])) <= known, row[0]
    assert "adamw-8bit*" in out  # changes what is learned, marked as `gpus` marks it
    left_out = _left_out(out)
    if width == 80:
        assert left_out == ["how it is counted", "kind, timed at"]
        assert "changes-training" not in out
    elif width == 120:
        assert left_out == [] and "how it is counted" in out and "changes-training" in out
    else:
        assert left_out == [] and "tokens/s/GPU" in out


@pytest.mark.parametrize("width", WIDTHS)
def test_auto_plan_fits_the_width(
    width: int, auto_plan: tuple[Plan, ModelInfo], draw: Callable[..., tuple[str, str]]
) -> None:
    p, info = auto_plan
    out, err = draw(width, lambda: plan.plan(p, info))
    _fits(out, width)
    _fits(err, width)
    assert out.splitlines()[0].endswith(f", seq 4096, {p.setup.precision}")
    assert p.gpu_counts and "GPU counts (--num-gpus auto)" in out
    known = {"ddp"} | {t.name for a in p.alternatives for t in a.techniques}
    rows = _rows(out, "Alternatives", key=1)
    assert len(rows) == len(p.alternatives)
    for row in rows:
        assert set(_names(row[0])) <= known, row[0]
    headers = " ".join(out[out.index("Alternatives") :].split("┡")[0].split())
    # the run and its cost stay longest; the kind goes first
    assert "run" in headers and "cost" in headers
    if width == 80:
        assert "kind, timed at" in _left_out(out)[-1]
    if width == 200:
        assert _left_out(out) == [] and "kind" in headers


@pytest.mark.parametrize("width", WIDTHS)
def test_estimate_fits_the_width(
    width: int,
    t4_estimate: MemoryEstimate,
    gpt2: ModelInfo,
    draw: Callable[..., tuple[str, str]],
) -> None:
    out, err = draw(width, lambda: estimate.estimate(t4_estimate, gpt2, get_gpu("t4")))
    _fits(out, width)
    _fits(err, width)
    assert out.splitlines()[0].startswith("gpt2 on cuda:t4, amp-fp16 (")
    assert "torch.cuda.max_memory_allocated" in out or width < 100  # a word kept whole
    assert ("how it is counted" in _left_out(out)) == (width == 80)


@pytest.mark.parametrize("width", WIDTHS)
def test_gpus_fits_the_width(
    width: int, fits: list[FitRow], gpt2: ModelInfo, draw: Callable[..., tuple[str, str]]
) -> None:
    out, _ = draw(width, lambda: catalog.fit_table(gpt2, 1024, fits, "analytic"))
    _fits(out, width)
    rows = _rows(out, "largest micro-batch per GPU", key=0)
    assert [r[0] for r in rows] == [r.gpu.name for r in fits]
    known = {"as given"} | {t.name for r in fits for t in r.techniques}
    for row in rows:  # the GPU, its precision and the techniques are kept at any width
        assert {"amp-fp16", "amp-bf16"} & set(row), row
        if not row[-1].startswith("cannot run"):
            assert set(_names(row[-1])) <= known, row[-1]
    assert bool(_left_out(out)) == (width == 80)
    # the card's memory, named apart from the memory used (both in GiB)
    assert _left_out(out) in ([], ["card GiB"], ["card GiB, GiB used"])


@pytest.mark.parametrize("width", WIDTHS)
def test_the_catalog_listings_fit_the_width_keeping_the_names(
    width: int, draw: Callable[..., tuple[str, str]]
) -> None:
    from batchfit.hardware import all_gpus
    from batchfit.models import catalog_names

    infos, gpus = [resolve_model(n) for n in catalog_names()], list(all_gpus().values())
    for answer, names in (
        (lambda: catalog.models(infos), [i.name for i in infos]),
        (lambda: catalog.gpus(gpus), [g.name for g in gpus]),
    ):
        out, _ = draw(width, answer)
        _fits(out, width)
        cells = [line.strip("│").split("│")[0].strip() for line in out.splitlines()]
        assert [c for c in cells if c in names] == names  # every name, whole, in order
        if width != 120:  # at 120 one listing fits whole, the other not
            assert bool(_left_out(out)) == (width == 80)
        assert "GPU" not in _left_out(out)  # the full name is "full name": the name stays


@pytest.mark.parametrize("width", [80, 100])
def test_help_wraps_between_words_never_inside_an_option_value(width, monkeypatch, capsys):
    """click's wrapper breaks after a hyphen; --help lists option values a reader copies
    (``sgd-momentum``, ``masked-lm``, ``amp-fp16``): they stay whole at any width."""
    from tests._cli import run_cli

    monkeypatch.setenv("COLUMNS", str(width))
    code, out, _ = run_cli(["plan", "--help"], capsys)
    assert code == 0
    lines = out.splitlines()
    assert not [line for line in lines if re.search(r"[a-z0-9]-$", line.rstrip())], out
    for value in ("sgd-momentum", "masked-lm", "amp-fp16", "image-classification"):
        assert value in out
