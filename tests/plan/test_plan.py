"""``make_plan``: the micro-batch, accumulation, learning rate, ladder and time of a plan."""

import functools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchfit import hardware
from batchfit.errors import UsageError, python_spelling
from batchfit.hardware import all_gpus, get_gpu
from batchfit.models import resolve_model
from batchfit.plan import fit_table, make_plan, scale_learning_rate
from batchfit.spec import TrainingSetup
from tests._cli import run_cli

# The planner's logic, on the fast analytic engine (the trace engine's plans: test_fit.py,
# test_plan_estimate_agree.py).
make_plan_analytic = functools.partial(make_plan, engine="analytic")
fit_table_analytic = functools.partial(fit_table, engine="analytic")

GPT2 = resolve_model("gpt2")
LLAMA_1B = resolve_model("llama-3.2-1b")  # a rotary model: 4096-token samples


def test_contract_gpt2_rtx3060():
    # the contract: 8 accumulation steps, 32768 tokens per step.
    p = make_plan_analytic(
        GPT2,
        get_gpu("rtx-3060"),
        TrainingSetup(),
        seq_len=256,
        global_batch_tokens=32768,
        micro_batch_size=16,
    )
    assert (p.micro_batch_size, p.grad_accum_steps, p.tokens_per_step) == (16, 8, 32768)
    assert p.headroom_bytes == p.gpu_bytes - p.estimate.device_total_bytes > 0
    assert p.techniques == ()


@settings(max_examples=30, deadline=None)
@given(
    global_batch=st.integers(1, 4096),
    num_gpus=st.sampled_from([1, 2, 4, 8]),
    gpu=st.sampled_from(["t4", "a100-40gb", "h100-80gb"]),
)
def test_every_plan_is_exact(global_batch, num_gpus, gpu):
    setup = TrainingSetup(num_gpus=num_gpus)
    if global_batch % num_gpus:
        with pytest.raises(UsageError, match="nearest reachable"):
            make_plan_analytic(GPT2, get_gpu(gpu), setup, seq_len=512, global_batch=global_batch)
        return
    p = make_plan_analytic(GPT2, get_gpu(gpu), setup, seq_len=512, global_batch=global_batch)
    assert p.micro_batch_size * p.grad_accum_steps * p.num_gpus == global_batch
    assert p.micro_batch_size <= max(p.max_micro_batch, 1)


def test_largest_fitting_micro_batch_is_chosen_when_it_divides():
    p = make_plan_analytic(
        GPT2, get_gpu("a100-80gb"), TrainingSetup(), seq_len=1024, global_batch=512
    )
    # the largest divisor of 512 that fits: the fitting maximum itself when it divides
    fitting_divisors = [d for d in range(1, p.max_micro_batch + 1) if 512 % d == 0]
    assert p.micro_batch_size == max(fitting_divisors)
    assert (p.micro_batch_size == p.max_micro_batch) == (512 % p.max_micro_batch == 0)
    # HF Trainer's conventions (the default) have no switch for a chunked loss: plain 32 x 16,
    # the chunked loss offered with the code it needs, never chosen
    assert not p.techniques and p.micro_batch_size == 32
    assert any(a.needs and a.techniques[0].name == "chunked-loss" for a in p.alternatives)
    # axolotl's config switches it on (chunked_cross_entropy): the time model's pick on one
    # GPU, the chunked loss's 64 x 8 before plain 32 x 16
    axolotl = TrainingSetup(framework="axolotl")
    chunked = make_plan_analytic(
        GPT2, get_gpu("a100-80gb"), axolotl, seq_len=1024, global_batch=512
    )
    assert [t.name for t in chunked.techniques] == ["chunked-loss"]
    assert chunked.micro_batch_size == 64
    bigger = make_plan_analytic(
        GPT2,
        get_gpu("a100-80gb"),
        axolotl,
        seq_len=1024,
        global_batch=512,
        micro_batch_size=64,
    )
    # Too big as is (plain fits about 50): the planner switches on the cheapest exact rung
    # that makes it fit: the chunked loss (GPT-2 has no Liger kernel), no recompute.
    assert [t.name for t in bigger.techniques] == ["chunked-loss"]
    assert bigger.setup.loss == "chunked" and not bigger.setup.grad_ckpt
    assert bigger.headroom_bytes >= bigger.headroom_wanted_bytes


def test_tokens_not_divisible_offers_nearest():
    with pytest.raises(UsageError, match=r"nearest reachable: 32,768 or 33,024"):
        make_plan_analytic(
            GPT2, get_gpu("t4"), TrainingSetup(), seq_len=256, global_batch_tokens=32800
        )


def test_micro_batch_must_divide():
    with pytest.raises(UsageError, match="does not divide"):
        make_plan_analytic(
            GPT2, get_gpu("t4"), TrainingSetup(), seq_len=256, global_batch=48, micro_batch_size=5
        )


def test_learning_rate_rules():
    assert scale_learning_rate(0.1, 256, 1024, "sgd-momentum")[0] == pytest.approx(0.4)
    assert scale_learning_rate(2e-5, 16, 64, "adamw")[0] == pytest.approx(4e-5)
    p = make_plan_analytic(
        GPT2,
        get_gpu("a100-40gb"),
        TrainingSetup(),
        seq_len=256,
        global_batch_tokens=65536,
        base_lr=6e-4,
        base_batch_tokens=32768,
    )
    assert p.learning_rate == pytest.approx(6e-4 * 2**0.5)  # tokens in, tokens out
    # the base recipe's batch in samples: 128 samples x 256 tokens = 32768 tokens, the same
    q = make_plan_analytic(
        GPT2,
        get_gpu("a100-40gb"),
        TrainingSetup(),
        seq_len=256,
        global_batch_tokens=65536,
        base_lr=6e-4,
        base_batch=128,
    )
    assert q.learning_rate == pytest.approx(6e-4 * 2**0.5)
    assert "taken as 32768 tokens" in (q.lr_rule or "")
    with pytest.raises(UsageError, match="base_batch"):
        make_plan_analytic(
            GPT2, get_gpu("t4"), TrainingSetup(), seq_len=256, global_batch=32, base_lr=1e-4
        )


def test_ladder_tries_exact_rungs_first_and_marks_kinds():
    p = make_plan_analytic(
        resolve_model("llama-3.1-8b"),
        get_gpu("a100-40gb"),
        TrainingSetup(),
        seq_len=4096,
        global_batch_tokens=1048576,
    )
    kinds = [t.kind for t in p.techniques]
    assert kinds and kinds[0] == "exact" and set(kinds) <= {"exact", "changes-training"}
    first_changing = next(
        i for i, a in enumerate(p.alternatives) if any(t.kind != "exact" for t in a.techniques)
    )
    assert all(
        all(t.kind == "exact" for t in a.techniques) for a in p.alternatives[:first_changing]
    )
    assert p.headroom_bytes >= p.headroom_wanted_bytes
    assert p.micro_batch_size * p.grad_accum_steps == 256


def test_multi_gpu_ladder_shards_before_changing_training():
    p = make_plan_analytic(
        resolve_model("llama-3.1-8b"),
        get_gpu("a100-80gb"),
        TrainingSetup(num_gpus=8),
        seq_len=4096,
        global_batch_tokens=4 * 1048576,
    )
    assert [t.kind for t in p.techniques] == ["exact"] * len(p.techniques)
    assert any(t.name.startswith("zero") for t in p.techniques)


def test_fp16_gpu_warns_about_gradscaler():
    p = make_plan_analytic(GPT2, get_gpu("t4"), TrainingSetup(), seq_len=512, global_batch=32)
    assert p.setup.precision == "amp-fp16"
    assert any("GradScaler" in w for w in p.warnings)


def test_fit_table_covers_every_gpu():
    rows = fit_table_analytic(
        resolve_model("bert-base-uncased"), TrainingSetup(), list(all_gpus().values()), seq_len=512
    )
    assert len(rows) == len(all_gpus())
    by_name = {r.gpu.name: r for r in rows}
    assert by_name["h200"].max_micro_batch > by_name["t4"].max_micro_batch > 0


@pytest.mark.parametrize(
    ("base_lr", "base_batch", "flag"),
    [
        (float("inf"), 32, "--base-lr"),
        (float("nan"), 32, "--base-lr"),
        (-1e-4, 32, "--base-lr"),
        (1e-4, float("inf"), "--base-batch"),
        (1e-4, float("nan"), "--base-batch"),
        (1e-4, 0, "--base-batch"),
    ],
)
def test_non_finite_learning_rate_inputs_are_refused(base_lr, base_batch, flag):
    # inf/nan must be refused: `plan --json` would print Infinity / NaN.
    with pytest.raises(
        ValueError, match=python_spelling(f"{flag} must be a finite positive number")
    ):
        scale_learning_rate(base_lr, base_batch, 64, "adamw")
    with pytest.raises(UsageError, match=python_spelling(flag)):
        make_plan_analytic(
            GPT2,
            get_gpu("t4"),
            TrainingSetup(),
            seq_len=256,
            global_batch=32,
            base_lr=base_lr,
            base_batch=base_batch,
        )


@pytest.mark.parametrize("optimizer", ["lion", "adafactor", "adan"])
def test_lion_adafactor_and_adan_scaling_is_said_to_have_no_source(optimizer: str) -> None:
    lr, why = scale_learning_rate(1e-4, 256, 1024, optimizer)
    assert lr == pytest.approx(2e-4)
    assert "no published" in why and "Malladi" not in why
    assert "Malladi" in scale_learning_rate(1e-4, 256, 1024, "adamw")[1]


def test_a_learning_rate_that_overflows_when_scaled_is_refused() -> None:
    with pytest.raises(UsageError, match="overflows"):
        scale_learning_rate(1e308, 16, 64, "sgd")


def test_the_lr_unit_trap_is_gone():
    """--base-batch 256 with a target in tokens was read as 256 tokens (64 x the LR,
    silently). It is 256 samples now; a base far from the target warns with the numbers."""
    kw = {"seq_len": 4096, "global_batch_tokens": 1048576, "base_lr": 3e-4}
    samples = make_plan_analytic(
        LLAMA_1B, get_gpu("h100-80gb"), TrainingSetup(), base_batch=256, **kw
    )
    assert samples.learning_rate == pytest.approx(3e-4)  # 256 x 4096 tokens: the same batch
    assert not any("far from where it was tuned" in w for w in samples.warnings)
    tokens = make_plan_analytic(
        LLAMA_1B, get_gpu("h100-80gb"), TrainingSetup(), base_batch_tokens=256, **kw
    )
    assert tokens.learning_rate == pytest.approx(3e-4 * 64)
    assert any("4.1e+03x the base batch" in w for w in tokens.warnings)
    with pytest.raises(UsageError, match="not both"):
        make_plan_analytic(
            LLAMA_1B,
            get_gpu("h100-80gb"),
            TrainingSetup(),
            base_batch=1,
            base_batch_tokens=1,
            **kw,
        )


def test_the_run_has_a_time_a_cost_and_ranked_candidates():
    """--train-tokens and --gpu-hour-price give the run's time and cost; candidates lists the
    plan, then the alternatives that fit, fastest first, with the same keys."""
    p = make_plan_analytic(
        resolve_model("llama-3.1-8b"),
        get_gpu("h100-80gb"),
        TrainingSetup(num_gpus=8),
        seq_len=4096,
        global_batch_tokens=1048576,
        train_tokens=10 * 1048576 + 1,
        gpu_hour_price=2.0,
    )
    assert p.train_steps == 11  # rounded up: the last step is whole
    assert p.train_seconds == pytest.approx(11 * p.step_seconds)
    assert p.cost_usd == pytest.approx(p.train_seconds / 3600 * 8 * 2.0)
    rows = p.to_json()["candidates"]
    assert rows[0]["chosen"] and rows[0]["step_seconds"] == p.step_seconds
    times = [r["step_seconds"] for r in rows[1:] if r["step_seconds"] is not None]
    assert times == sorted(times) and len(times) >= 2
    assert all(set(r) == set(rows[0]) for r in rows)
    # the plan once (not again among the alternatives); each row says whether it is exact
    assert [r["techniques"] for r in rows].count(rows[0]["techniques"]) == 1
    kinds = {tuple(r["techniques"]): r["exact"] for r in rows}
    assert any(kinds.values()) and not any(v for k, v in kinds.items() if "lora" in k)
    with pytest.raises(UsageError, match="gpu_hour_price"):
        make_plan_analytic(
            GPT2, get_gpu("t4"), TrainingSetup(), seq_len=256, global_batch=32, gpu_hour_price=-1.0
        )
    with pytest.raises(UsageError, match="train_tokens"):
        make_plan_analytic(
            GPT2, get_gpu("t4"), TrainingSetup(), seq_len=256, global_batch=32, train_tokens=0
        )


def test_fused_adamw_is_the_first_exact_rung():
    """Pure bf16 8B on an H100: foreach AdamW's fp32 temporary of every parameter does not
    fit beside the model; the fused kernel, which costs no time, does."""
    p = make_plan_analytic(
        resolve_model("llama-3.1-8b"),
        get_gpu("h100-80gb"),
        TrainingSetup(precision="bf16"),
        seq_len=256,
        global_batch=8,
    )
    assert [t.name for t in p.techniques] == ["fused-adamw"]
    assert p.setup.optimizer_impl == "fused" and p.fits
    assert p.to_json()["techniques"][0]["kind"] == "exact"


@pytest.mark.slow
def test_rows_the_trace_cannot_run_say_the_analytic_engine_answered(capsys, monkeypatch):
    info, t4 = resolve_model("llama-3.2-1b"), get_gpu("t4")
    rows = fit_table(info, TrainingSetup(), [t4], seq_len=2048)
    (row,) = rows
    assert any(t.name.startswith(("zero", "qlora")) for t in row.techniques)
    assert row.engine == "analytic" and row.to_json()["engine"] == "analytic"
    # the command over the T4 alone: every catalog GPU would trace the same rows again
    monkeypatch.setattr(hardware, "all_gpus", lambda: {"t4": t4})
    code, out, _ = run_cli(["gpus", "llama-3.2-1b", "--seq-len", "2048"], capsys)
    assert code == 0 and "(analytic)" in out


@pytest.mark.slow
def test_the_largest_micro_batch_does_not_depend_on_the_global_batch():
    # at micro-batch m below the per-GPU batch a plan accumulates: the largest size that fits
    # is the same for every global batch it is below
    info = resolve_model("bert-base-uncased", "classification")
    t4 = get_gpu("t4")
    sizes = {
        make_plan(
            info, t4, TrainingSetup(), seq_len=512, global_batch=g, engine="analytic"
        ).max_micro_batch
        for g in (128, 256, 512)  # above the largest size: no cap
    }
    assert len(sizes) == 1
