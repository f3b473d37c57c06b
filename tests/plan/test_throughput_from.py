"""``plan --throughput-from PROBE.json``: a real probe's measured steps replace the step-time
model's, and a probe of something else is refused, and an
implausible one is named.

The probe runs for real, on this machine's CPU, on a tiny GPT-2. ``plan`` plans for a catalog
GPU (``--gpu``) and refuses a CPU probe, so the matching cases copy the real probe's file and
change only the fields that say where it ran (``device``, ``gpu``, ``gpu_name``) to a T4's: the
trials, the model, the setup and the sequence length stay what really ran. The figures are then
CPU seconds put against a T4's prediction (a factor far from 1), which is what these tests
check: that the plan's step time is the measured one, and how it is derived elsewhere.
"""

import json

import pytest

from batchfit.errors import UsageError
from batchfit.hardware import get_gpu
from batchfit.models import resolve_model
from batchfit.plan import make_plan
from batchfit.plan._throughput import ProbeFile, _implausible, bind, catalog_gpu, read_probe
from batchfit.spec import TrainingSetup
from batchfit.speed import step_time
from tests._cli import run_captured, run_cli

TINY = {
    "model_type": "gpt2",
    "n_layer": 2,
    "n_embd": 64,
    "n_head": 4,
    "vocab_size": 512,
    "n_positions": 256,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "architectures": ["GPT2LMHeadModel"],
}
SEQ = "64"


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    """A real CPU probe of the tiny model (fp32, micro-batches up to 4): (config, its JSON)."""
    root = tmp_path_factory.mktemp("probe")
    cfg = root / "config.json"
    cfg.write_text(json.dumps(TINY))
    args = ["probe", str(cfg), "--seq-len", SEQ, "--device", "cpu", "--precision", "fp32"]
    args += ["--max-micro-batch", "4", "--steps-per-trial", "2", "--json"]
    # in this process: the probe runs its real steps in a child of its own, on one thread (the
    # suite's workers already share the cores: two threads there wait on each other's turns,
    # 2.4 s a step of this model against 0.04 s on one)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")
        code, out, err = run_captured(args)
    assert not code, err
    return cfg, json.loads(out)


def _on_t4(tmp_path, data, **changes):
    """The real probe's file as if it had run on a T4: only where it ran is changed."""
    moved = {**data, "device": "cuda", "gpu": "t4", "gpu_name": "Tesla T4", **changes}
    path = tmp_path / "probe_t4.json"
    path.write_text(json.dumps(moved))
    return path


def _plan(cfg, probe, *extra):
    return [
        "plan",
        str(cfg),
        "--gpu",
        "t4",
        "--precision",
        "fp32",
        "--seq-len",
        SEQ,
        "--engine",
        "analytic",
        *(["--throughput-from", str(probe)] if probe else []),
        *extra,
    ]


def _timed(data):
    return {t["micro_batch_size"]: t["samples_per_s"] for t in data["trials"] if t["ok"]}


@pytest.mark.slow
def test_probe_json_says_what_it_measured(probed):
    cfg, data = probed
    assert data["model"] == str(cfg) and data["device"] == "cpu" and data["seq_len"] == 64
    assert data["gpu"] is None and data["gpu_name"] is None  # a CPU run
    assert data["setup"]["precision"] == "fp32" and data["setup"]["grad_ckpt"] is False
    assert 4 in _timed(data)


@pytest.mark.slow
def test_plan_at_a_measured_size_takes_the_measured_step(probed, tmp_path, capsys):
    cfg, data = probed
    probe = _on_t4(tmp_path, data)
    code, out, err = run_cli(
        [*_plan(cfg, probe, "--global-batch", "4", "-b", "4"), "--json"], capsys
    )
    assert code == 0, err
    plan = json.loads(out)
    measured = 4 / _timed(data)[4]  # seconds of one real step at micro-batch 4
    assert plan["micro_batch_size"] == 4 and plan["grad_accum_steps"] == 1
    assert plan["step_seconds"] == pytest.approx(measured, rel=1e-9)
    assert plan["throughput_source"].startswith("measured: micro-batch 4 ran at")
    assert plan["candidates"][0]["step_seconds"] == pytest.approx(measured, rel=1e-9)
    # the alternatives get the same correction, and each says so
    timed = [a for a in plan["alternatives"] if a["step_seconds"]]
    assert timed and all("probe_t4.json" in a["throughput_source"] for a in timed)


@pytest.mark.slow
def test_accumulation_and_unmeasured_sizes_are_derived_and_said(probed, tmp_path, capsys):
    cfg, data = probed
    probe = _on_t4(tmp_path, data)
    measured = 4 / _timed(data)[4]
    code, out, err = run_cli(
        [*_plan(cfg, probe, "--global-batch", "8", "-b", "4"), "--json"], capsys
    )
    assert code == 0, err
    two = json.loads(out)
    # two micro-steps and one update: more than one measured step, less than two
    assert measured < two["step_seconds"] < 2 * measured
    code, out, err = run_cli(
        [*_plan(cfg, probe, "--global-batch", "8", "-b", "8"), "--json"], capsys
    )
    assert code == 0, err
    eight = json.loads(out)
    assert (
        "measured/predicted at micro-batch 4, the nearest the probe timed"
        in (eight["throughput_source"])
    )
    # without the probe the same plan is the model's alone, a factor away
    code, out, _ = run_cli([*_plan(cfg, None, "--global-batch", "8", "-b", "8"), "--json"], capsys)
    model = json.loads(out)
    assert model["throughput_source"] is None
    factor = float(eight["throughput_source"].split("the model x ")[1].split()[0])
    assert eight["step_seconds"] == pytest.approx(factor * model["step_seconds"], rel=1e-2)


@pytest.mark.slow
def test_human_output_names_the_probe(probed, tmp_path, capsys):
    cfg, data = probed
    probe = _on_t4(tmp_path, data)
    code, out, err = run_cli(_plan(cfg, probe, "--global-batch", "4", "-b", "4"), capsys)
    assert code == 0, err
    assert "--throughput-from: measured: micro-batch 4" in " ".join(out.split())


@pytest.mark.slow
@pytest.mark.parametrize(
    ("edit", "extra", "needle"),
    [
        ({"device": "cpu", "gpu": None, "gpu_name": None}, [], "measured on the CPU"),
        ({}, ["--gpu", "a10"], "measured on t4 (Tesla T4), this plan is for a10"),
        ({"gpu": None, "gpu_name": "Mystery GPU"}, [], "'Mystery GPU'"),
        ({}, ["--precision", "auto"], "--precision fp32 (probe) vs amp-fp16 (plan)"),
        ({}, ["--grad-ckpt"], "--grad-ckpt off (probe) vs on (plan)"),
        ({}, ["--method", "lora"], "--method full (probe) vs lora (plan)"),
        ({}, ["--seq-len", "32"], "sequence length 64, this plan 32"),
        ({"model": "gpt2"}, [], "measured gpt2, not"),
        ({"setup": None}, [], "an older batchfit probe"),
        ({"trials": [{"micro_batch_size": 4, "ok": False, "samples_per_s": None}]}, [], "timed no"),
    ],
)
def test_a_probe_of_something_else_is_refused(probed, tmp_path, capsys, edit, extra, needle):
    cfg, data = probed
    probe = _on_t4(tmp_path, data, **edit)
    code, out, err = run_cli([*_plan(cfg, probe, "--global-batch", "4"), *extra], capsys)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and needle in err, err


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (None, "cannot read"),
        ("not json {", "is not JSON"),
        ('{"peak_bytes": 1, "micro_batch_size": 4}', "not a probe's output"),
        ("[1, 2]", "not a probe's output"),
    ],
)
def test_a_file_that_is_not_a_probe_is_refused(tmp_path, capsys, content, needle):
    path = tmp_path / "probe.json"
    if content is not None:
        path.write_text(content)
    args = ["plan", "gpt2", "--gpu", "t4", "--seq-len", "64", "--global-batch", "4"]
    code, out, err = run_cli([*args, "--throughput-from", str(path)], capsys)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and needle in err, err
    with pytest.raises(UsageError, match=needle):
        read_probe(path)


@pytest.mark.parametrize(
    ("torch_name", "total_gib", "catalog"),
    [
        ("NVIDIA H100 80GB HBM3", 79.1, "h100-80gb"),
        ("NVIDIA H100 PCIe", 79.1, "h100-pcie"),
        ("NVIDIA H100 NVL", 93.1, "h100-nvl"),
        ("NVIDIA A100-SXM4-80GB", 79.1, "a100-80gb"),
        ("NVIDIA A100-PCIE-40GB", 39.4, "a100-40gb"),
        ("Tesla V100-SXM2-32GB", 31.7, "v100-32gb"),
        ("Tesla T4", 14.6, "t4"),
        ("NVIDIA A10G", 22.1, "a10g"),
        ("NVIDIA A10", 22.1, "a10"),
        ("NVIDIA L40S", 44.4, "l40s"),
        ("NVIDIA GeForce RTX 4090", 23.6, "rtx-4090"),
        ("NVIDIA RTX A6000", 47.5, "rtx-a6000"),
        ("AMD Instinct MI300X", 191.5, "mi300x"),
        ("NVIDIA H200", 139.8, "h200"),
        ("NVIDIA A100 Graphics Device", 79.1, "a100-80gb"),  # the family, by memory
        ("NVIDIA GeForce GTX 1080", 7.9, None),
    ],
)
def test_the_probe_names_its_gpu_as_the_catalog_does(torch_name, total_gib, catalog):
    assert catalog_gpu(torch_name, int(total_gib * 2**30)) == catalog


def _probe(factor: float) -> tuple[ProbeFile, object, object, TrainingSetup]:
    """A probe of GPT-2 on a T4 whose steps are ``factor`` x the step-time model's compute."""
    from batchfit.memory.formulas.analytic import resolve_setup

    model, gpu, setup = resolve_model("gpt2"), get_gpu("t4"), TrainingSetup()
    theirs = resolve_setup(model, setup, "cuda", gpu)
    seconds = {}
    for n in (4, 8):
        t = step_time(model, theirs, gpu, micro_batch_size=n, seq_len=256)
        assert t is not None
        compute = t.step_seconds(1) - t.comm_micro_seconds - t.comm_step_seconds
        seconds[n] = factor * (compute - t.offload_seconds)
    probe = ProbeFile(
        path="probe.json",
        model="gpt2",
        device="cuda",
        gpu="t4",
        gpu_name="Tesla T4",
        seq_len=256,
        setup=setup,
        step_seconds=seconds,
        samples_per_s={n: n / s for n, s in seconds.items()},
    )
    return probe, model, gpu, setup


def test_a_plausible_probe_binds_without_a_warning():
    probe, model, gpu, setup = _probe(1.3)
    measured, note = bind(probe, model, gpu, setup, 256)
    assert measured is not None and note is None


@pytest.mark.parametrize("factor", [0.01, 0.15, 8.0])
def test_an_implausible_probe_is_named(factor):
    probe, model, gpu, setup = _probe(factor)
    measured, note = bind(probe, model, gpu, setup, 256)
    assert measured is not None  # still used, as asked
    assert note is not None and "\n" not in note
    assert f"{factor:.3g} x the model's predicted time" in note
    assert "edited" in note and "something else" in note


def test_over_the_peak_is_named_even_within_the_factor_bound():
    # factor 0.5 alone is plausible; a step faster than the GPU's peak is not
    assert _implausible("p", {4: 0.5, 8: 0.6}, {4: 0.6, 8: 0.7}) is None
    note = _implausible("p", {4: 0.5, 8: 0.6}, {4: 0.6, 8: 1.2})
    assert note is not None and "micro-batch 8" in note and "implied MFU 120%" in note


def test_the_plan_carries_the_warning():
    probe, model, gpu, setup = _probe(0.01)
    plan = make_plan(
        model, gpu, setup, seq_len=256, global_batch=16, throughput_from=probe, engine="analytic"
    )
    assert any("x the model's predicted time" in w for w in plan.warnings)
