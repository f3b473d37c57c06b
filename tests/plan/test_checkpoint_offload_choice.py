"""Checkpointing as a dial in the planner, offload in the time ranking on
several GPUs, and one rule per row in ``batchfit gpus``."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest

from batchfit.hardware import get_gpu
from batchfit.models import resolve_model
from batchfit.plan import OFFLOAD_MARGIN, make_plan
from batchfit.plan import _ladder as ladder_module
from batchfit.spec import TrainingSetup
from tests._cli import run_cli

MODEL = "llama-3.1-8b"
TOKENS = 1048576


@pytest.fixture(autouse=True)
def _a_loop_that_selects_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    """No --framework follows HF Trainer, whose switch wraps every layer; the dial's choice is
    tested here for a run that can checkpoint a chosen set of layers (as torchtune's)."""
    import batchfit.presets as presets

    monkeypatch.setattr(presets, "DEFAULT", replace(presets.DEFAULT, selects_ckpt_layers=True))


def _on(model: str, gpu: str, seq_len: int, setup: TrainingSetup, **target: int):
    """The analytic plan of ``model`` on ``gpu`` for a global batch (``target``)."""
    info = resolve_model(model)
    return make_plan(info, get_gpu(gpu), setup, seq_len=seq_len, engine="analytic", **target)


def _plan(num_gpus: int = 1, **setup: object):
    s = TrainingSetup(num_gpus=num_gpus, **setup)  # type: ignore[arg-type]
    return _on(MODEL, "h100-80gb", 2048, s, global_batch_tokens=TOKENS)


def _mistral_v100():
    # fp32 Adam on a 32 GB V100: full checkpointing needs offload and runs 64 x 1 at ~239 s;
    # every 4th layer fits 1 x 16 at ~198 s, and with the parameters offloaded too no
    # checkpointing at all fits 1 x 16 at ~184 s by the time model
    setup = TrainingSetup(precision="fp32", optimizer="adam")
    return _on("mistral-7b", "v100-32gb", 2048, setup, global_batch=16)


PARTIAL = ["mistral-7b", "--gpu", "a10g", "--num-gpus", "4", "-s", "512"]


def _partial(**setup: object):
    # 7B on 4 A10Gs under ZeRO-2 + optimizer offload, 128 sequences of 512: every layer runs
    # 16 x 2 at ~23.2 s; every 4th layer 2 x 16 at ~20.6 s, over 5% faster; none needs 1 x 32
    s = TrainingSetup(num_gpus=4, **setup)  # type: ignore[arg-type]
    return _on("mistral-7b", "a10g", 512, s, global_batch=128)


def test_the_planner_checkpoints_fewer_layers_when_that_is_faster():
    p = _partial()
    names = [t.name for t in p.techniques]
    assert "gradient-checkpointing" not in names
    partial = [t for t in p.techniques if t.name.startswith("gradient-checkpointing-every-")]
    assert len(partial) == 1 and partial[0].kind == "exact"
    every = p.setup.grad_ckpt_every
    layers = resolve_model("mistral-7b").arch.num_layers
    assert every in ladder_module.PARTIAL_CKPT_EVERY
    assert partial[0].name == f"gradient-checkpointing-every-{every}"
    assert f"({layers // every} of {layers})" in partial[0].why
    assert any(f"every {ladder_module.ordinal(every)} layer" in w for w in p.warnings)
    # full checkpointing stays among the alternatives, timed, and slower than the choice
    full = [a for a in p.alternatives if "gradient-checkpointing" in {t.name for t in a.techniques}]
    assert full and all(a.step_seconds for a in full if a.max_micro_batch)
    chosen = [a for a in p.alternatives if a.techniques == p.techniques]
    assert chosen and chosen[0].step_seconds is not None
    exact = [a for a in full if all(t.kind == "exact" for t in a.techniques)]
    best_full = min(a.step_seconds or 0 for a in exact if a.max_micro_batch)
    assert chosen[0].step_seconds < best_full


def test_checkpointing_goes_when_offload_made_room_and_that_is_faster():
    # the ladder's offload rungs keep checkpointing on; the dial also tries none
    v100 = _mistral_v100()
    assert not v100.setup.grad_ckpt and v100.micro_batch_size == 1
    assert "offload-optimizer+params" in {t.name for t in v100.techniques}
    full = [
        a
        for a in v100.alternatives
        if "gradient-checkpointing" in {t.name for t in a.techniques}
        and a.step_seconds
        and all(t.kind == "exact" for t in a.techniques)
    ]
    chosen = [a for a in v100.alternatives if a.techniques == v100.techniques]
    assert chosen and full
    assert chosen[0].step_seconds < min(a.step_seconds or 0 for a in full)


def test_offload_accumulation_is_paid_per_micro_step():
    # 8B on one H100 under ZeRO-2 + optimizer offload: without checkpointing 4 x 128 fits,
    # but DeepSpeed accumulates the gradients in CPU RAM, down and up in each of the 127
    # micro-steps; every layer at 64 x 8 stays faster (~149 s)
    p = _plan()
    assert p.setup.grad_ckpt and p.setup.offload == "optimizer"
    assert (p.micro_batch_size, p.grad_accum_steps) == (64, 8)
    from batchfit.memory.formulas.analytic import resolve_setup
    from batchfit.speed import step_time

    info, gpu = resolve_model(MODEL), get_gpu("h100-80gb")
    bare = resolve_setup(info, replace(p.setup, grad_ckpt=False), "cuda", gpu)
    t = step_time(info, bare, gpu, micro_batch_size=4, seq_len=2048)
    assert t is not None and t.offload_accum_seconds > 0
    assert t.step_seconds(128) == pytest.approx(
        t.micro_seconds * 128 + t.offload_accum_seconds * 127 + t.optimizer_seconds
    )
    assert p.step_seconds is not None and t.step_seconds(128) > p.step_seconds


def _qwen_a10g():
    # 1.7B on 2 A10Gs, 2M tokens of 2048: every 4th layer at 1 x 512 against every layer at
    # 8 x 64, about 7% faster by the time model
    return _on("qwen3-1.7b", "a10g", 2048, TrainingSetup(num_gpus=2), global_batch_tokens=2097152)


def test_many_micro_steps_must_win_by_the_tolerance(monkeypatch):
    import batchfit.plan as plan_module

    p = _qwen_a10g()
    assert p.setup.grad_ckpt_every and p.grad_accum_steps > plan_module.MAX_QUIET_ACCUM
    # asked to win by 10%, hundreds of micro-steps lose to every layer's fewer
    monkeypatch.setattr(plan_module._ladder, "TIME_TOLERANCE", 0.10)
    p = _qwen_a10g()
    assert p.grad_accum_steps <= plan_module.MAX_QUIET_ACCUM


def test_fewer_layers_are_not_taken_when_they_are_slower():
    # 1B on 8 A100-40s: every layer at 48 x 1; every 2nd layer needs a smaller micro-batch,
    # which loses more to utilisation than it saves in recompute
    eight = TrainingSetup(num_gpus=8)
    p = _on("llama-3.2-1b", "a100-40gb", 2048, eight, global_batch_tokens=786432)
    assert "gradient-checkpointing" in [t.name for t in p.techniques]
    assert p.setup.grad_ckpt and p.setup.grad_ckpt_every is None


def test_a_framework_that_cannot_select_layers_checkpoints_all_or_none():
    # HF Trainer's switch wraps every layer: every 4th is not offered, none still is (1 x 32)
    p = _partial(framework="hf-trainer")
    assert p.setup.grad_ckpt_every is None
    assert not any(t.name.startswith("gradient-checkpointing-every") for t in p.techniques)
    (dial,) = [w for w in p.warnings if w.startswith("checkpointing tried as a dial")]
    assert "every 4th" not in dial and "none" in dial
    # every K-th layer is offered instead, with the code it needs, never chosen
    offered = [a for a in p.alternatives if any(t.needs for t in a.techniques)]
    assert offered and all(a.setup.grad_ckpt_every for a in offered)
    assert all(t.needs.startswith("code: ") for a in offered for t in a.techniques if t.needs)


def test_a_faster_option_within_the_tolerance_is_named():
    # 12B on 4 H100s: every 3rd layer at 1 x 24 is 1.4% faster than every layer at 8 x 3;
    # within 5% the larger micro-batch is taken, and the note gives both
    s = TrainingSetup(num_gpus=4)
    p = _on("mistral-nemo-12b", "h100-80gb", 4096, s, global_batch=96)
    assert p.setup.grad_ckpt and p.setup.grad_ckpt_every is None and p.micro_batch_size == 8
    (dial,) = [w for w in p.warnings if w.startswith("checkpointing tried as a dial")]
    assert "every 3rd layer" in dial and "taken: every layer" in dial and "within 5%" in dial


def test_the_user_s_own_checkpointing_is_kept():
    p = _plan(grad_ckpt=True)
    assert p.setup.grad_ckpt_every is None


def test_the_plan_json_and_its_estimate_line_carry_the_layers(capsys):
    args = ["plan", *PARTIAL, "--global-batch"]
    code, out, err = run_cli([*args, "128", "--engine", "analytic", "--json"], capsys)
    assert code == 0, err
    data = json.loads(out)
    names = [t["name"] for t in data["techniques"]]
    every = data["setup"]["grad_ckpt_every"]
    assert every in ladder_module.PARTIAL_CKPT_EVERY
    assert f"gradient-checkpointing-every-{every}" in names
    code, out, err = run_cli([*args, "128", "--engine", "analytic"], capsys)
    assert code == 0, err
    assert f"--grad-ckpt-every {every}" in out.replace("\n", " ")


def test_offload_competes_on_several_gpus_but_needs_the_margin():
    # 8B on 2 H100s: ZeRO-2 + offload is predicted ~10% faster than ZeRO-3 + checkpointing,
    # under the margin: not chosen, and one note names both times
    p = _plan(num_gpus=2)
    names = {t.name for t in p.techniques}
    assert "offload-optimizer" not in names and "offload-optimizer+params" not in names
    notes = [w for w in p.warnings if "CPU offload wins only" in w]
    assert len(notes) == 1
    assert f"{OFFLOAD_MARGIN:.0%}" in notes[0] and "s/step" in notes[0]
    # the time it names for the plan's choice is the plan's own
    assert p.step_seconds is not None
    assert f"against {p.step_seconds:.3g} s/step for the plan's choice" in notes[0]


def test_the_offload_note_prints_two_different_times_at_seconds_scale(monkeypatch):
    # the same choice at 1/100 of the time (a small model's seconds): whole seconds printed
    # "2 s/step against 2 s/step"
    from batchfit.plan._target import _Target

    seconds = _Target.step_seconds
    monkeypatch.setattr(_Target, "step_seconds", lambda *a: seconds(*a) / 100)
    (note,) = [w for w in _plan(num_gpus=2).warnings if "CPU offload wins only" in w]
    faster, chosen = re.findall(r"([\d.]+) s/step", note)
    assert float(faster) < float(chosen)


def test_offload_wins_when_it_is_faster_by_the_margin(monkeypatch):
    import batchfit.plan as plan_module

    monkeypatch.setattr(plan_module._ladder, "OFFLOAD_MARGIN", 0.0)
    p = _plan(num_gpus=2)
    assert "offload-optimizer" in {t.name for t in p.techniques}
    assert not [w for w in p.warnings if "CPU offload wins only" in w]


def test_one_gpu_alternatives_show_the_offload_time():
    p = _plan()
    offloaded = [a for a in p.alternatives if "offload-optimizer" in {t.name for t in a.techniques}]
    assert offloaded and all(a.step_seconds for a in offloaded if a.max_micro_batch)


@pytest.mark.parametrize("every", [2, 3, 4])
def test_partial_ckpt_technique_sets_the_setup(every):
    tech = ladder_module.partial_ckpt(every, 32)
    s = tech(TrainingSetup())
    assert s.grad_ckpt and s.grad_ckpt_every == every


def _rows(gpus: tuple[str, ...], setup: TrainingSetup | None = None):
    from batchfit.plan import fit_table

    info = resolve_model(MODEL)
    specs = [get_gpu(g) for g in gpus]
    setup = setup or TrainingSetup()
    return fit_table(info, setup, specs, seq_len=2048, engine="analytic")


def test_gpus_rows_follow_one_rule_and_the_larger_card_is_not_slower():
    # before: the H200 row took micro-batch 1 with no checkpointing (43 h / 1B tokens) while
    # the H100 row took checkpointing + offload at 65 (39.5 h): the 80 GB card looked faster
    h100, h200 = _rows(("h100-80gb", "h200"))
    assert h200.seconds_per_billion_tokens is not None
    assert h100.seconds_per_billion_tokens is not None
    assert h200.seconds_per_billion_tokens <= h100.seconds_per_billion_tokens
    assert h200.max_micro_batch > 1
    assert {t.name for t in h200.techniques} >= {"fused-adamw", "gradient-checkpointing"}
    for row in (h100, h200):
        data = row.to_json()
        assert data["choice"] == "fastest exact"
        assert "fastest exact option" in data["rule"]
        assert all(t["kind"] == "exact" for t in data["techniques"])


def test_gpus_row_takes_changing_rungs_only_when_nothing_exact_fits():
    # torchtune's single-device recipes offload nothing: 8B in full on an A100 does not fit
    (a100,) = _rows(("a100-40gb",), TrainingSetup(framework="torchtune"))
    assert a100.max_micro_batch > 0
    assert a100.choice == "changes training: nothing exact fits"
    assert any(t.kind != "exact" for t in a100.techniques)


def test_gpus_output_states_the_rule(capsys):
    code, out, err = run_cli(["gpus", "gpt2", "--seq-len", "512", "--engine", "analytic"], capsys)
    assert code == 0, err
    text = " ".join(out.split())
    assert "each row: the fastest exact option by the time model" in text
    assert "as given" in text  # gpt2 fits as given: the row names that


def test_the_estimate_line_of_a_partial_plan_reproduces_its_figures(capsys):
    args = [*PARTIAL, "--engine", "analytic", "--json"]
    code, out, err = run_cli(["plan", *args, "--global-batch", "128"], capsys)
    assert code == 0, err
    plan = json.loads(out)
    setup = plan["setup"]
    assert setup["grad_ckpt_every"] in ladder_module.PARTIAL_CKPT_EVERY
    flags = ["--grad-ckpt-every", str(setup["grad_ckpt_every"]), "--loss", setup["loss"]]
    flags += ["--sharding", setup["sharding"], "--offload", setup["offload"]]
    micro, accum = plan["micro_batch_size"], plan["grad_accum_steps"]
    code, out, err = run_cli(
        ["estimate", *args, "-b", str(micro), "--grad-accum", str(accum), *flags], capsys
    )
    assert code == 0, err
    est = json.loads(out)
    assert est["device_total_bytes"] == plan["device_total_bytes"]
    assert est["step_seconds"] == pytest.approx(plan["step_seconds"])


@pytest.mark.parametrize(
    "kind, says",
    [
        ("hf", "activation_checkpointing wraps every layer"),
        ("accelerate", "cannot switch on"),  # ZeRO-3 under accelerate: no switch to name
        ("deepspeed", "a DeepSpeed config cannot switch on"),
        ("lightning", "Lightning's Trainer cannot switch on"),
    ],
)
def test_an_export_of_a_partial_plan_says_once_how_to_checkpoint_the_layers(kind, says):
    from batchfit.export import export_caveats

    p = _partial()
    every = p.setup.grad_ckpt_every
    assert every
    about = [c for c in export_caveats(p, kind) if "checkpoint" in c]
    assert len(about) == 1, about  # one line, not two that disagree
    assert says in about[0] and f"every {ladder_module.ordinal(every)} layer" in about[0]
    fsdp = replace(p, setup=replace(p.setup, sharding="fsdp"))
    (line,) = [c for c in export_caveats(fsdp, "accelerate") if "checkpoint" in c]
    assert "fsdp_activation_checkpointing wraps every layer" in line


def test_the_offload_note_compares_with_the_choice_not_the_fastest_option():
    """The plain setup (1.00 s) is taken over fused AdamW (0.99 s: within the time model's
    resolution, the simpler); an offload at 0.95 s (not past the margin) gets a note that
    names the chosen 1.00 s, the time the plan prints."""
    from batchfit.plan._choice import _widest
    from batchfit.plan._ladder import FUSED_ADAMW, Technique
    from batchfit.plan._value import Alternative

    offload = Technique(
        "offload-optimizer",
        "exact",
        "",
        lambda s: replace(s, sharding="zero2", offload="optimizer"),
    )
    plain = TrainingSetup()
    fused, offloaded = FUSED_ADAMW(plain), offload(plain)
    times = {plain: 1.00, fused: 0.99, offloaded: 0.95}

    class Target:
        def timed_micro(self, largest: int, wanted: int | None) -> int:
            return largest

        def step_seconds(self, setup: TrainingSetup, micro: int) -> float:
            return times[setup]

        def confirmed(self, alt: Alternative) -> Alternative:
            return alt

    base = Alternative((), plain, 8, 1 << 30)
    options = [Alternative((FUSED_ADAMW,), fused, 8, 1 << 30)]
    options.append(Alternative((offload,), offloaded, 8, 1 << 30))
    fit = _widest(Target(), base, options, None)  # type: ignore[arg-type]
    assert fit is not None and fit.setup == plain
    (note,) = [n for n in fit.notes if "CPU offload wins only" in n]
    assert "predicted at 0.95 s/step against 1 s/step for the plan's choice" in note
