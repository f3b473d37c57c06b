"""One answer per question: a plan's micro-batch fits by its own ``estimate`` (same
flags), and the next size up does not, on cases at the
edge of a T4's memory."""

from __future__ import annotations

import json

import pytest

from batchfit.hardware import get_gpu
from batchfit.models import resolve_model
from batchfit.plan import make_plan
from batchfit.spec import TrainingSetup
from tests._cli import plan_setup_flags, run_cli
from tests._tiny import DEBERTA_V3_BASE

pytestmark = pytest.mark.slow

# (model, plan flags, setup flags shared with estimate). The global batch bounds the plan's
# searches (its alternatives search up to it): where a case's point is the edge of its GPU, the
# batch is twice the largest micro-batch that fits there, so the plan takes that largest and the
# size after it (already traced by the plan's search) is checked not to fit. BERT, DeBERTa and
# GPT-2's full fine-tune keep a batch of 64, which their largest does not divide: their plans take
# a smaller size, whose figure an estimate there must reproduce too.
CASES = [
    (
        "bert-base-uncased",
        ["--gpu", "t4", "--seq-len", "512", "--global-batch", "64"],
        ["--task", "classification"],
    ),
    # a full fine-tune (LoRA may be offered): the question the Python API's ``TrainingSetup()``
    # asks below, so its plans' ladders are these
    ("gpt2", ["--gpu", "t4", "--seq-len", "1024", "--global-batch", "64"], ["--method", "full"]),
    # 39 x 512 tokens is the largest on an A100-40GB (amp-bf16): 2 x 39
    ("roberta-large", ["--gpu", "a100-40gb", "--seq-len", "512", "--global-batch", "78"], []),
    (
        "DEBERTA",
        ["--gpu", "t4", "--seq-len", "512", "--global-batch", "64"],
        ["--task", "classification"],
    ),
    # 14 x 1024 tokens is the largest on a T4 without checkpointing: 2 x 14 (at 64 the plan
    # checkpoints 64 x 1, capped by the batch, and the size after it is not checked)
    (
        "gpt2",
        ["--gpu", "t4", "--seq-len", "1024", "--global-batch", "28"],
        ["--task", "classification"],
    ),
]


def _json(args: list[str], capsys: pytest.CaptureFixture[str]) -> dict:
    code, out, err = run_cli([*args, "--json"], capsys)
    assert code == 0, err
    return dict(json.loads(out))


@pytest.mark.parametrize(("model", "plan_flags", "setup_flags"), CASES)
def test_the_planned_micro_batch_fits_by_its_own_estimate(
    model, plan_flags, setup_flags, capsys, tmp_path
):
    if model == "DEBERTA":
        model = str(tmp_path / "config.json")
        (tmp_path / "config.json").write_text(json.dumps(DEBERTA_V3_BASE))
    plan = _json(["plan", model, *plan_flags, *setup_flags], capsys)
    assert plan["engine"] == "trace"
    assert not any("analytic engine answered" in w for w in plan["warnings"])
    micro = plan["micro_batch_size"]
    # --gpu G --seq-len S, and the plan's accumulation (later micro-steps hold gradients)
    gpu_seq = [*plan_flags[:4], "--grad-accum", str(plan["grad_accum_steps"])]
    gpu_seq += plan_setup_flags(plan)  # as the plan prints them: they share its dry runs
    est = _json(["estimate", model, *gpu_seq, "-b", str(micro), *setup_flags], capsys)
    assert est["fits"]
    assert est["device_total_bytes"] == plan["device_total_bytes"]
    assert est["engine"] == "trace"
    # the largest that fits, unless the batch capped the search: one more does not
    if plan["max_micro_batch"] == micro < plan["global_batch_size"]:
        over = _json(["estimate", model, *gpu_seq, "-b", str(micro + 1), *setup_flags], capsys)
        assert not over["fits"] or over["headroom_bytes"] < 512 * 2**20


def test_the_gpus_table_agrees_with_plan_at_accumulation_one():
    from batchfit.hardware import get_gpu
    from batchfit.models import resolve_model
    from batchfit.plan import fit_table, make_plan
    from batchfit.spec import TrainingSetup

    info, setup = resolve_model("gpt2"), TrainingSetup()
    (row,) = fit_table(info, setup, [get_gpu("t4")], seq_len=1024)
    assert row.max_micro_batch > 0 and not row.techniques
    plan = make_plan(
        info, get_gpu("t4"), setup, seq_len=1024, global_batch=row.max_micro_batch
    )  # one micro-batch per step: accumulation 1, as the table assumes
    assert plan.grad_accum_steps == 1
    assert plan.micro_batch_size == row.max_micro_batch
    assert plan.estimate.device_total_bytes == row.device_total_bytes
    # the row's size was traced, the size after it not (marked): the plan, which searches,
    # finds no fewer
    assert row.from_lines
    searched = make_plan(info, get_gpu("t4"), setup, seq_len=1024, global_batch=64)
    assert searched.max_micro_batch >= row.max_micro_batch


def test_a_ladder_rung_the_plan_takes_is_confirmed_and_its_hint_reproduces_it(capsys):
    """llama-2-7b on a T4 needs offload and more: once LoRA, whose lines through
    micro-batch 1 and 2 overpredicted its largest size (5 at 15.03 GiB, short of the card)
    before the chosen rung was traced at its answer; since DeepSpeed's 16-bit layout is
    counted, the exact ZeRO-3 parameter offload (ZeRO-Infinity) fits first. The
    plan's setup, as flags, gives its figures."""
    flags = ["--gpu", "t4", "--seq-len", "512"]
    plan = _json(
        ["plan", "llama-2-7b", *flags, "--global-batch", "40", "--headroom", "100MiB"], capsys
    )
    # with checkpointing as a dial, the time model may checkpoint fewer layers, or none once the
    # parameters are offloaded too
    every = plan["setup"]["grad_ckpt_every"]
    ckpt = (
        [f"gradient-checkpointing-every-{every}" if every else "gradient-checkpointing"]
        if plan["setup"]["grad_ckpt"]
        else []
    )
    names = [t["name"] for t in plan["techniques"]]
    assert names == ["fused-loss", *ckpt, "zero3", "offload-optimizer+params"]
    assert plan["fits"]
    technique_flags = plan_setup_flags(plan)
    micro, accum = plan["micro_batch_size"], plan["grad_accum_steps"]
    common = [*flags, "--grad-accum", str(accum), *technique_flags]
    est = _json(["estimate", "llama-2-7b", *common, "-b", str(micro)], capsys)
    assert est["fits"] and est["device_total_bytes"] == plan["device_total_bytes"]
    if plan["max_micro_batch"] == micro < plan["global_batch_size"]:  # not capped by the batch
        over = _json(["estimate", "llama-2-7b", *common, "-b", str(micro + 1)], capsys)
        assert not over["fits"] or over["headroom_bytes"] < 100 * 2**20


@pytest.mark.slow
def test_the_alternatives_sizes_are_traced_and_fit():
    """An alternative's figure is the trace's at its size and fits, whether the size after it
    was traced (``alternatives="traced"``) or not (the default, ``from_lines``); the lines'
    answer alone may not fit (GPT-2 with checkpointing on a T4: 18 by the lines, 15.5 GiB)."""
    info = resolve_model("gpt2")
    gpu = get_gpu("t4")
    plan = make_plan(info, gpu, TrainingSetup(), seq_len=1024, global_batch=64)
    from batchfit.memory.estimate import estimate

    assert any(a.from_lines for a in plan.alternatives)
    for alt in plan.alternatives:
        if alt.max_micro_batch and alt.engine == "trace":
            size = alt.max_micro_batch
            est = estimate(
                info,
                alt.setup,
                micro_batch_size=size,
                seq_len=1024,
                gpu=gpu,
                grad_accum_steps=1 if size >= 64 else max(2, 64 // size),  # as the plan sizes it
            )
            assert est.device_total_bytes == alt.device_total_bytes, alt.techniques
            assert est.device_total_bytes <= gpu.memory_bytes - plan.headroom_wanted_bytes
