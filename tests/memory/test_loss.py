"""The loss and dtype conventions: ``--loss chunked|fused``, ``--lora-dtype``,
``--frozen-dtype``. The losses must compute what the full loss computes (value and gradients),
and their dry run must allocate what the real CPU step allocates."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from batchfit.errors import UsageError
from batchfit.hardware import get_gpu
from batchfit.memory.estimate import estimate
from batchfit.memory.trace import dry_run as trace
from batchfit.memory.trace import hf as _hf_trace
from batchfit.memory.trace.tracker import cpu_bf16_gemm_scratch
from batchfit.models import resolve_model
from batchfit.spec import TrainingSetup, parse_loss
from tests._cli import run_cli
from tests._tiny import TINY_VIT
from tests.memory._dry_vs_real import assert_dry_run_matches_real

pytestmark = pytest.mark.slow

# Tiny Llama with a wide vocabulary, so the loss's buffers are what moves the peak.
WIDE_VOCAB_LLAMA = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 176,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 8192,
    "max_position_embeddings": 512,
}


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """The model of the file's tests, at one path: a dry run is cached under the model's path,
    so an estimate the tests repeat (the full loss's peak, compared with each) is traced once."""
    path = tmp_path_factory.mktemp("wide") / "config.json"
    path.write_text(json.dumps(WIDE_VOCAB_LLAMA))
    return resolve_model(str(path))


# the real steps' size: 62 rows of logits, 62 chunks of one row for the fused loss (a
# vocabulary 128 times the width) where its dry run keeps 4
MICRO, SEQ = 2, 32


def _parts(info, setup, micro=MICRO, seq=SEQ):
    setup = setup.resolved(device="cpu", bf16_supported=True)
    return _hf_trace.step_parts(info, setup, micro=micro, seq=seq, emulate_cuda=False)


def _loss_and_grads(info, setup):
    torch.manual_seed(0)
    parts = _parts(info, setup)
    torch.manual_seed(1)
    batch = parts.make_batch()
    out = trace._call(parts.model, batch)
    loss = parts.loss_of(out, batch)
    loss.backward()
    grads = {
        name.removeprefix("net."): p.grad.clone()
        for name, p in parts.model.named_parameters()
        if p.grad is not None
    }
    return loss.detach(), grads


@pytest.fixture(scope="module")
def full(wide):
    """The full loss of ``wide`` and its gradients (fp32, the same seeded step): what each
    other loss must compute."""
    return _loss_and_grads(wide, TrainingSetup(precision="fp32"))


@pytest.mark.parametrize("loss", ["chunked", "chunked:3", "chunked:20t", "fused"])
@pytest.mark.parametrize("loop", ["trainer", "keep-outputs"])
def test_the_loss_and_its_gradients_equal_the_full_loss(wide, full, loss, loop):
    kind, chunks, tokens = parse_loss(loss)
    full_loss, full_grads = full
    setup = TrainingSetup(
        precision="fp32", loss=kind, loss_chunks=chunks, loss_chunk_tokens=tokens, loop=loop
    )
    got_loss, got_grads = _loss_and_grads(wide, setup)
    torch.testing.assert_close(got_loss, full_loss, rtol=1e-5, atol=1e-5)
    assert got_grads.keys() == full_grads.keys()
    for name, grad in full_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_a_fused_loss_on_a_tied_head_sums_both_gradients(tmp_path):
    cfg = {**WIDE_VOCAB_LLAMA, "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    info = resolve_model(str(tmp_path / "config.json"))
    _, full = _loss_and_grads(info, TrainingSetup(precision="fp32"))
    _, fused = _loss_and_grads(info, TrainingSetup(precision="fp32", loss="fused"))
    torch.testing.assert_close(
        fused["model.embed_tokens.weight"], full["model.embed_tokens.weight"]
    )


SETUPS = [
    TrainingSetup(precision="fp32", loss="chunked"),
    TrainingSetup(precision="fp32", loss="chunked", loop="keep-outputs"),
    TrainingSetup(precision="fp32", loss="fused"),
    TrainingSetup(precision="amp-bf16", loss="fused"),
    pytest.param(
        TrainingSetup(precision="amp-bf16", loss="chunked", grad_ckpt=True),
        # On an AVX2-only CPU (no oneDNN bf16) the head's backward under the chunked loss
        # allocates differently from the dry run's fp32-scratch emulation: a known CPU-only gap,
        # reported on every run here until the emulation covers it (GPU estimates are unaffected)
        marks=pytest.mark.xfail(cpu_bf16_gemm_scratch(), reason="AVX2-only CPU bf16 scratch"),
    ),
    TrainingSetup(method="lora", precision="bf16", lora_dtype="bf16"),
    TrainingSetup(method="lora", precision="amp-bf16", frozen_dtype="fp32"),
]


@pytest.mark.parametrize("setup", SETUPS, ids=repr)
def test_dry_run_matches_real_cpu_tensors(wide, setup):
    # The same step on real CPU tensors and on fake tensors allocates the same storages.
    assert_dry_run_matches_real(wide, setup, micro=MICRO, seq=SEQ)


def _peak(info, engine, **kw):
    setup = TrainingSetup(precision="amp-bf16", **kw)
    est = estimate(
        info,
        setup,
        micro_batch_size=4,
        seq_len=256,
        device="cuda",
        gpu=get_gpu("a100-80gb"),
        engine=engine,
    )
    return est.peak_bytes


@pytest.mark.parametrize("engine", ["trace", "analytic"])
def test_chunked_and_fused_losses_hold_less_than_the_full_loss(wide, engine):
    full = _peak(wide, engine)
    chunked = _peak(wide, engine, loss="chunked")
    fused = _peak(wide, engine, loss="fused")
    assert fused < chunked < full
    # a loop that keeps the outputs holds the chunks' logits; the fused loss makes none
    assert _peak(wide, engine, loss="chunked", loop="keep-outputs") > chunked
    assert _peak(wide, engine, loss="fused", loop="keep-outputs") == fused


@pytest.mark.parametrize("loss", ["chunked", "fused"])
def test_the_analytic_saving_agrees_with_the_trace(wide, loss):
    # what the loss saves against the full loss, by formulas and by the dry run
    by_trace = _peak(wide, "trace") - _peak(wide, "trace", loss=loss)
    by_formula = _peak(wide, "analytic") - _peak(wide, "analytic", loss=loss)
    assert by_formula == pytest.approx(by_trace, rel=0.15)


def test_a_dry_run_of_the_fused_loss_skips_identical_chunks_and_gives_the_same_figures(
    tmp_path, monkeypatch
):
    from batchfit.memory.trace import _lm_loss
    from batchfit.memory.trace.estimate import estimate_trace
    from batchfit.workload import Workload

    monkeypatch.setenv("BATCHFIT_NO_CACHE", "1")
    # 129 rows over a vocabulary 128 times the width: chunks of 2, 65 of them, the last shorter
    assert len(_lm_loss._chunk_starts(129, 2, fake=False)) == 65
    assert _lm_loss._chunk_starts(129, 2, fake=True) == [0, 2, 126, 128]
    # the dry runs compared: 17 rows over a vocabulary 16 times the width, chunks of 2 again,
    # 9 of them, the last shorter, the middle 5 skipped (a dry run of every chunk runs each
    # chunk's ops: 65 chunks at the wide vocabulary's 129 rows took most of this test)
    assert len(_lm_loss._chunk_starts(17, 2, fake=False)) == 9
    assert _lm_loss._chunk_starts(17, 2, fake=True) == [0, 2, 14, 16]
    (tmp_path / "config.json").write_text(json.dumps({**WIDE_VOCAB_LLAMA, "vocab_size": 1024}))
    model = resolve_model(str(tmp_path / "config.json"))
    setup = TrainingSetup(loss="fused", precision="amp-bf16")
    work = Workload(micro_batch_size=1, seq_len=18, gpu=get_gpu("a100-40gb"), grad_accum_steps=2)

    def figures():
        est = estimate_trace(model, setup, work)
        return est.peak_bytes, est.reserved_bytes, est.extras["moments"]

    cut = figures()
    monkeypatch.setattr(_lm_loss, "KEPT_FAKE_CHUNKS", 10**6)
    assert figures() == cut


@pytest.mark.parametrize("engine", ["trace", "analytic"])
def test_adapter_and_frozen_dtypes_move_the_weights(wide, engine):
    info = wide

    def weights(**kw):
        setup = TrainingSetup(method="lora", precision="amp-bf16", **kw)
        est = estimate(
            info,
            setup,
            micro_batch_size=1,
            seq_len=128,
            device="cuda",
            gpu=get_gpu("a100-80gb"),
            engine=engine,
        )
        return est.components["weights"], est.trainable_params

    base, trainable = weights()
    bf16_adapters, _ = weights(lora_dtype="bf16")
    assert base - bf16_adapters == pytest.approx(2 * trainable, rel=0.01)
    fp32_base, _ = weights(frozen_dtype="fp32")
    assert fp32_base - base == pytest.approx(2 * info.total_params, rel=0.01)


def test_classification_refuses_a_vocabulary_loss():
    with pytest.raises(UsageError, match="loss full"):
        estimate(
            resolve_model("bert-base-uncased", "classification"),
            TrainingSetup(loss="fused"),
            micro_batch_size=1,
            seq_len=64,
            device="cpu",
            engine="analytic",
        )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--loss", "sparse"], "--loss 'sparse' is not one of"),
        (["--loss", "chunked:0"], "N in chunked:N"),
        (["--loss", "fused:4"], "is not one of"),
        (["--lora-dtype", "int8", "--method", "lora"], "--lora-dtype 'int8' is not one of"),
        (["--frozen-dtype", "bf16"], "need --method lora or qlora"),
    ],
)
def test_bad_loss_and_dtype_options_are_one_line(args, message, capsys):
    code, out, err = run_cli(
        ["estimate", "gpt2", "-b", "1", "-s", "64", "--engine", "analytic", *args], capsys
    )
    assert code == 2 and not out
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_the_cli_passes_the_loss_through(capsys):
    code, out, _ = run_cli(
        ["estimate", "gpt2", "-b", "8", "-s", "1024", "--engine", "analytic", "--json"], capsys
    )
    full = json.loads(out)
    code, out, _ = run_cli(
        [
            "estimate",
            "gpt2",
            "-b",
            "8",
            "-s",
            "1024",
            "--engine",
            "analytic",
            "--loss",
            "chunked:4",
            "--json",
        ],
        capsys,
    )
    assert code == 0
    chunked = json.loads(out)
    assert chunked["setup"]["loss"] == "chunked" and chunked["setup"]["loss_chunks"] == 4
    assert chunked["peak_bytes"] < full["peak_bytes"]


# --- framework presets -------------------------------------------------------------------


def test_every_preset_value_is_a_valid_setup_and_cites_its_source():
    from batchfit.frameworks import FRAMEWORKS, PRESETS, with_framework

    assert set(PRESETS) == set(FRAMEWORKS)
    for name, preset in PRESETS.items():
        assert preset.sources and all(":" in source for source in preset.sources), name
        for method in ("full", "lora"):
            setup = with_framework(TrainingSetup(method=method), name)
            assert setup.framework == name
            assert setup.loop == preset.values["loop"]


@pytest.mark.parametrize(
    ("framework", "expected"),
    [
        (
            "torchtune",
            {"loss": "chunked", "loss_chunks": 8, "loop": "trainer", "lora_dtype": "bf16"},
        ),
        ("litgpt", {"loss": "chunked", "loss_chunk_tokens": 128, "loop": "keep-outputs"}),
        ("lightning", {"frozen_dtype": "fp32", "loop": "trainer", "loss": "full"}),
        ("accelerate", {"loop": "keep-outputs", "optimizer_impl": "auto"}),
        ("hf-trainer", {"optimizer_impl": "fused", "lora_dtype": "fp32"}),
    ],
)
def test_the_cli_applies_a_preset_and_explicit_options_win(framework, expected, capsys):
    common = ["estimate", "llama-3.2-1b", "-b", "1", "-s", "256", "--gpu", "a100-80gb"]
    common += ["--engine", "analytic", "--method", "lora", "--json"]
    code, out, err = run_cli([*common, "--framework", framework], capsys)
    assert code == 0, err
    setup = json.loads(out)["setup"]
    assert setup["framework"] == framework
    assert {k: setup[k] for k in expected} == expected
    code, out, err = run_cli(
        [*common, "--framework", framework, "--loop", "keep-outputs", "--loss", "fused"], capsys
    )
    setup = json.loads(out)["setup"]
    assert (setup["loop"], setup["loss"], setup["loss_chunk_tokens"]) == (
        "keep-outputs",
        "fused",
        None,
    )


def test_pure_bf16_frameworks_resolve_auto_precision_to_bf16():
    for framework, precision in (
        ("torchtune", "bf16"),
        ("litgpt", "bf16"),
        ("lightning", "amp-bf16"),
    ):
        setup = TrainingSetup(framework=framework)  # type: ignore[arg-type]
        assert setup.resolved(device="cuda", bf16_supported=True).precision == precision
        assert setup.resolved(device="cpu", bf16_supported=True).precision == "fp32"


def test_unknown_framework_is_one_line(capsys):
    code, _out, err = run_cli(
        ["estimate", "gpt2", "-b", "1", "-s", "64", "--engine", "analytic", "--framework", "keras"],
        capsys,
    )
    assert code == 2 and "--framework 'keras' is not one of" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("engine", ["trace", "analytic"])
def test_cast_outputs_are_held_in_fp32_by_a_keep_outputs_loop(wide, engine):
    # accelerate's convert_outputs_to_fp32: the loop holds an fp32 copy of the logits, not the
    # bf16 ones (2 more bytes per logit)
    plain = _peak(wide, engine, loop="keep-outputs")
    cast = _peak(wide, engine, loop="keep-outputs", framework="accelerate")
    logits = 4 * 256 * WIDE_VOCAB_LLAMA["vocab_size"]
    assert cast - plain == pytest.approx(2 * logits, rel=0.15)


def test_litgpt_chunks_of_tokens_trace_like_a_real_step(wide, full):
    setup = TrainingSetup(
        precision="bf16",
        framework="litgpt",
        loop="keep-outputs",
        loss="chunked",
        loss_chunk_tokens=16,
    )
    # at 2 x 64: at 2 x 32 this CPU's bf16 head backward (no oneDNN bf16) takes another path
    # than the dry run's emulation of it
    assert_dry_run_matches_real(wide, setup, micro=2, seq=64)
    loss, _ = _loss_and_grads(wide, replace(setup, precision="fp32"))
    torch.testing.assert_close(loss, full[0], rtol=1e-5, atol=1e-5)


def test_one_chunk_is_the_full_loss_and_token_chunks_count_as_the_loop_splits(capsys):
    def peak(*flags: str) -> int:
        args = ["estimate", "llama-3.2-1b", "--gpu", "a100-80gb", "-s", "2048", "-b", "4"]
        code, out, err = run_cli([*args, "--engine", "analytic", "--json", *flags], capsys)
        assert code == 0, err
        return int(json.loads(out)["peak_bytes"])

    assert peak("--loss", "chunked:1") == peak("--loss", "full")
    # the trainer loop splits the micro-batch's 8192 tokens: chunks of 2048 tokens are 4 chunks
    assert peak("--loss", "chunked:2048t") == peak("--loss", "chunked:4")
    # a loop that keeps the outputs splits each sequence: 2048-token chunks of a 2048 sequence
    # are one chunk, the full loss's terms
    keep = ["--loop", "keep-outputs"]
    assert peak("--loss", "chunked:2048t", *keep) == peak("--loss", "full", *keep)


def test_an_explicit_full_loss_is_kept_by_the_planner(capsys):
    args = ["plan", "llama-3.1-8b", "--gpu", "a100-40gb", "--global-batch", "64", "-s", "4096"]
    code, out, _ = run_cli([*args, "--engine", "analytic", "--json"], capsys)
    assert code == 0 and "fused-loss" in [t["name"] for t in json.loads(out)["techniques"]]
    code, out, _ = run_cli([*args, "--engine", "analytic", "--json", "--loss", "full"], capsys)
    plan = json.loads(out)
    assert code == 0 and plan["setup"]["loss"] == "full"
    assert "fused-loss" not in [t["name"] for t in plan["techniques"]]
    assert not any("Liger" in w for w in plan["warnings"])


def test_qlora_on_the_cpu_computes_in_bf16_by_default():
    setup = TrainingSetup(method="qlora").resolved(device="cpu", bf16_supported=True)
    assert setup.precision == "amp-bf16"


def test_a_language_framework_preset_keeps_a_classifier_loss_full(tmp_path, capsys):
    # an image classifier (TINY_VIT: ViT-Base's kind, 2 layers of width 64), traced whole
    (tmp_path / "config.json").write_text(json.dumps(TINY_VIT))
    args = ["estimate", str(tmp_path / "config.json"), "-b", "2", "--gpu", "a100-40gb"]
    args += ["--framework", "litgpt", "--engine", "trace", "--json"]
    code, _, err = run_cli(args, capsys)
    assert code == 0, err
    code, _, err = run_cli([*args[:-1], "--loss", "chunked"], capsys)  # asked for: refused
    assert code == 2 and "use --loss full" in err
