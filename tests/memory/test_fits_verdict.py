"""A verdict "fits" needs the whole device total, uncapped, with memory to spare."""

import dataclasses

import pytest

from batchfit.cli.render.estimate import fit_verdict
from batchfit.hardware import get_gpu
from batchfit.memory.device.totals import fits_on_card
from batchfit.memory.estimate import estimate
from batchfit.models import resolve_model
from batchfit.plan._max_micro_batch import fits
from batchfit.spec import TrainingSetup
from tests._cli import run_cli

GIB = 1 << 30
QLORA_3060 = [
    "estimate",
    "llama-2-7b",
    "--gpu",
    "rtx-3060",
    "--method",
    "qlora",
    "--grad-ckpt",
    "-s",
    "2432",
    "-b",
    "3",
    "--engine",
    "analytic",
    "--loop",
    "keep-outputs",  # the loop whose logits outlive forward
]


def test_fits_on_card_boundary():
    card = 12 * GIB
    assert fits_on_card(card - 1, card)
    assert not fits_on_card(card, card)  # full to the byte: no headroom, no fit
    assert not fits_on_card(card + 1, card)
    assert fits_on_card(card - GIB, card, headroom_bytes=GIB)
    assert not fits_on_card(card - GIB + 1, card, headroom_bytes=GIB)


@pytest.mark.parametrize(
    ("free", "verdict", "amount"),
    [
        (-5 * GIB // 4, "does not fit", "short by 1.25 GiB"),
        (0, "does not fit", "no headroom"),
        (1, "fits, with less than", "headroom 1 B"),
        (3 << 20, "fits, with less than", "headroom 3.0 MiB"),
        (2 * GIB, "[green]fits[/]", "headroom 2.00 GiB"),
    ],
)
def test_verdict_never_fits_without_headroom(free, verdict, amount):
    gpu = get_gpu("rtx-3060")
    est = estimate(
        resolve_model("gpt2"),
        TrainingSetup(),
        micro_batch_size=1,
        seq_len=64,
        gpu=gpu,
        engine="analytic",
    )
    est = dataclasses.replace(est, device_total_bytes=gpu.memory_bytes - free)
    text = fit_verdict(est, gpu)
    assert verdict in text and amount in text
    assert ("does not fit" in text) == (free <= 0)


def test_qlora_on_a_3060_is_not_cut_to_fit(capsys):
    # It printed "12.00 GiB of 12.00: fits": the reserve had been capped at the card.
    code, out, _ = run_cli(QLORA_3060, capsys)
    assert code == 0
    verdict = next(line for line in out.splitlines() if "RTX 3060" in line)
    assert "does not fit" in verdict and "short by" in verdict


def test_when_it_fits_the_headroom_printed_is_positive(capsys):
    # With the trainer loop the logits die before backward and the same step fits: the
    # verdict then shows what is left, never zero or less.
    code, out, _ = run_cli(QLORA_3060[:-2], capsys)
    assert code == 0
    verdict = next(line for line in out.splitlines() if "RTX 3060" in line)
    assert "fits" in verdict and "does not fit" not in verdict
    left = verdict.rsplit("headroom ", 1)[1]
    assert not left.startswith(("0.00", "0 B", "-"))


def test_plan_fits_agrees_with_the_uncapped_total():
    gpu = get_gpu("rtx-3060")
    setup = TrainingSetup(method="qlora", grad_ckpt=True, loop="keep-outputs")
    ok, est = fits(resolve_model("llama-2-7b"), setup, gpu, 4, 2048, 1, headroom=0)
    assert est.device_total_bytes > gpu.memory_bytes and not ok
