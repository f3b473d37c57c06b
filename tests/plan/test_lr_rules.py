"""The LR follows the batch with Malladi et al.'s β/ε adjustments offered,
and stops growing at the critical batch when one is known."""

from __future__ import annotations

import json
import math

import pytest

from batchfit.errors import UsageError
from batchfit.hardware import get_gpu
from batchfit.models import resolve_model
from batchfit.plan import make_plan
from batchfit.plan._lr_scaling import adam_adjustment, follow_batch, parse_betas
from batchfit.spec import TrainingSetup
from tests._cli import run_cli

GPT2 = resolve_model("gpt2")
PLAN = ["plan", "gpt2", "--gpu", "a100-40gb", "-s", "1024", "--engine", "analytic"]


def _plan(**kwargs):
    setup = TrainingSetup(optimizer=kwargs.pop("optimizer", "adamw"))
    return make_plan(GPT2, get_gpu("a100-40gb"), setup, seq_len=1024, engine="analytic", **kwargs)


def test_malladi_rule_by_hand():
    # kappa = 4: 1-0.9 -> 0.4, 1-0.999 -> 0.004, 1e-8 -> 1e-8 / 2
    a = adam_adjustment(4.0)
    assert a.betas == (0.6, 0.996) and a.eps == pytest.approx(5e-9)
    # a smaller batch moves the betas towards 1 and grows eps
    b = adam_adjustment(0.5, (0.9, 0.95), 1e-6)
    assert b.betas == pytest.approx((0.95, 0.975)) and b.eps == pytest.approx(1e-6 * 2**0.5)


@pytest.mark.parametrize(("factor", "applicable"), [(9.99, True), (10.0, False), (64.0, False)])
def test_malladi_rule_inapplicable_when_beta_would_reach_zero(factor, applicable):
    a = adam_adjustment(factor)
    assert a.applicable is applicable
    if not applicable:
        assert a.betas is None and a.eps is None and "does not apply" in a.text()


def test_beta2_alone_can_break_the_rule():
    # beta1 0 (RMSprop-like) stays valid; beta2 0.9 at 16x does not
    assert adam_adjustment(16.0, (0.0, 0.9), 1e-8).betas is None


def test_plan_offers_adam_settings_in_json_and_text(capsys):
    p = _plan(global_batch=64, base_lr=1e-4, base_batch=16)
    assert p.learning_rate == pytest.approx(2e-4)
    data = json.loads(json.dumps(p.to_json()))
    adam = data["lr_scaling"]["adam"]
    assert adam["betas"] == [0.6, 0.996] and adam["eps"] == pytest.approx(5e-9)
    assert adam["base_betas"] == [0.9, 0.999] and adam["applicable"] is True
    code, out, _ = run_cli(
        [*PLAN, "--global-batch", "64", "--base-lr", "1e-4", "--base-batch", "16"], capsys
    )
    assert code == 0 and "betas=(0.6, 0.996), eps=5e-09" in out


def test_sgd_gets_no_adam_settings_and_no_lr_has_none():
    p = _plan(global_batch=64, base_lr=0.1, base_batch=16, optimizer="sgd-momentum")
    assert p.learning_rate == pytest.approx(0.4)
    assert p.to_json()["lr_scaling"]["adam"] is None
    assert _plan(global_batch=64).to_json()["lr_scaling"] is None


def test_base_betas_flag_moves_the_offer(capsys):
    code, out, _ = run_cli(
        [
            *PLAN,
            "--global-batch",
            "32",
            "--base-lr",
            "3e-4",
            "--base-batch",
            "16",
            "--base-betas",
            "0.9,0.95",
            "--base-eps",
            "1e-6",
            "--json",
        ],
        capsys,
    )
    assert code == 0
    adam = json.loads(out)["lr_scaling"]["adam"]
    assert adam["betas"] == [0.8, 0.9] and adam["eps"] == pytest.approx(1e-6 / math.sqrt(2))


def test_inapplicable_rule_is_said_in_the_plan(capsys):
    code, out, _ = run_cli(
        [*PLAN, "--global-batch", "512", "--base-lr", "1e-4", "--base-batch", "16"], capsys
    )
    assert code == 0 and "does not apply" in out and "32 x 0.1 >= 1" in out


def test_critical_batch_caps_the_lr():
    # 16 -> 64 samples, critical 32: the LR follows 16 -> 32 only (sqrt 2, not 2)
    p = _plan(global_batch=64, base_lr=1e-4, base_batch=16, critical_batch=32)
    assert p.learning_rate == pytest.approx(1e-4 * math.sqrt(2))
    s = p.to_json()["lr_scaling"]
    assert s["capped"] and s["factor"] == 4 and s["applied_factor"] == 2
    assert s["adam"]["betas"] == [0.8, 0.998]  # the adjustment follows the capped factor
    assert any("past the critical batch" in w for w in p.warnings)
    assert "sqrt(32/16)" in (p.lr_rule or "")


def test_critical_batch_in_tokens_is_converted():
    same = _plan(global_batch=64, base_lr=1e-4, base_batch=16, critical_batch_tokens=32 * 1024)
    assert same.learning_rate == pytest.approx(1e-4 * math.sqrt(2))
    assert same.to_json()["lr_scaling"]["critical_batch"] == 32


def test_below_the_critical_batch_nothing_changes():
    p = _plan(global_batch=64, base_lr=1e-4, base_batch=16, critical_batch=1000)
    assert p.learning_rate == pytest.approx(2e-4) and not p.to_json()["lr_scaling"]["capped"]
    assert not any("critical" in w for w in p.warnings)


def test_both_past_the_critical_batch_keeps_the_base_lr():
    s, _ = follow_batch(
        3e-4, (512, "samples"), (2048, "samples"), 1024, "adamw", critical=(256, "samples")
    )
    assert s is not None and s.learning_rate == pytest.approx(3e-4) and s.adam is None


def test_critical_batch_without_base_lr_only_warns():
    p = _plan(global_batch=64, critical_batch=32)
    assert p.learning_rate is None and any("past the critical batch" in w for w in p.warnings)


def test_parse_betas():
    assert parse_betas("0.9,0.95") == (0.9, 0.95)


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--base-betas", "0.9"], "--base-betas"),
        (["--base-betas", "0.9,1.0"], "--base-betas"),
        (["--base-betas", "a,b"], "--base-betas"),
        (["--base-eps", "0"], "--base-eps"),
        (["--base-eps", "-1e-8"], "--base-eps"),
        (["--critical-batch", "0"], "--critical-batch"),
        (["--critical-batch-tokens", "-5"], "--critical-batch-tokens"),
        (["--critical-batch", "8", "--critical-batch-tokens", "8192"], "not both"),
    ],
)
def test_bad_lr_options_exit_2_one_line(capsys, extra, needle):
    code, out, err = run_cli(
        [*PLAN, "--global-batch", "64", "--base-lr", "1e-4", "--base-batch", "16", *extra],
        capsys,
    )
    assert code == 2 and needle in err and out == ""
    assert len(err.strip().splitlines()) == 1, err


def test_betas_without_base_lr_exit_2(capsys):
    code, _, err = run_cli([*PLAN, "--global-batch", "64", "--base-betas", "0.9,0.95"], capsys)
    assert code == 2 and "--base-lr" in err


def test_base_betas_refused_before_planning():
    with pytest.raises(UsageError, match="base_betas"):
        _plan(global_batch=64, base_lr=1e-4, base_batch=16, base_betas=(1.2, 0.9))
