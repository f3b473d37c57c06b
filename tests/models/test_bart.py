"""BART-family configs are read: encoder_layers, encoder_attention_heads, ..."""

import json

import pytest

from batchfit.memory.estimate import estimate
from batchfit.memory.trace import estimate as _trace_estimate
from batchfit.memory.trace import hf as _hf_trace
from batchfit.models import resolve_model
from batchfit.spec import TrainingSetup
from batchfit.workload import Workload

# facebook/bart-base's config.json (shape keys and the token ids the model needs).
BART_BASE = {
    "model_type": "bart",
    "architectures": ["BartModel"],
    "d_model": 768,
    "encoder_layers": 6,
    "decoder_layers": 6,
    "encoder_attention_heads": 12,
    "decoder_attention_heads": 12,
    "encoder_ffn_dim": 3072,
    "decoder_ffn_dim": 3072,
    "vocab_size": 50265,
    "max_position_embeddings": 1024,
    "activation_function": "gelu",
    "dropout": 0.1,
    "attention_dropout": 0.1,
    "activation_dropout": 0.1,
    "pad_token_id": 1,
    "bos_token_id": 0,
    "eos_token_id": 2,
    "decoder_start_token_id": 2,
}
# facebook/mbart-large-cc25, google/pegasus-large, Helsinki-NLP/opus-mt-en-de (shape keys).
OTHERS = {
    "mbart": {
        "d_model": 1024,
        "encoder_layers": 12,
        "decoder_layers": 12,
        "encoder_attention_heads": 16,
        "decoder_attention_heads": 16,
        "encoder_ffn_dim": 4096,
        "decoder_ffn_dim": 4096,
        "vocab_size": 250027,
        "max_position_embeddings": 1024,
    },
    "pegasus": {
        "d_model": 1024,
        "encoder_layers": 16,
        "decoder_layers": 16,
        "encoder_attention_heads": 16,
        "decoder_attention_heads": 16,
        "encoder_ffn_dim": 4096,
        "decoder_ffn_dim": 4096,
        "vocab_size": 96103,
        "max_position_embeddings": 1024,
    },
    "marian": {
        "d_model": 512,
        "encoder_layers": 6,
        "decoder_layers": 6,
        "encoder_attention_heads": 8,
        "decoder_attention_heads": 8,
        "encoder_ffn_dim": 2048,
        "decoder_ffn_dim": 2048,
        "vocab_size": 58101,
        "max_position_embeddings": 512,
        "pad_token_id": 58100,
        "decoder_start_token_id": 58100,
    },
}


def _write(tmp_path, cfg):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return resolve_model(str(path), "seq2seq")


def test_bart_base_shape_is_read(tmp_path):
    arch = _write(tmp_path, BART_BASE).arch
    assert (arch.family, arch.hidden_size, arch.num_layers, arch.num_decoder_layers) == (
        "encoder-decoder",
        768,
        6,
        6,
    )
    assert (arch.num_heads, arch.intermediate_size, arch.vocab_size) == (12, 3072, 50265)
    assert not arch.gated_mlp and arch.max_positions == 1024


def test_trace_depth_sets_both_bart_stacks(tmp_path):
    cfg = _hf_trace._config(_write(tmp_path, BART_BASE), 2)
    assert (cfg.encoder_layers, cfg.decoder_layers) == (2, 2)


def test_bart_base_engines_agree(tmp_path):
    info = _write(tmp_path, BART_BASE)
    kw = {"micro_batch_size": 4, "seq_len": 256, "device": "cpu"}
    traced = estimate(info, TrainingSetup(), **kw)
    formulas = estimate(info, TrainingSetup(), engine="analytic", **kw)
    assert traced.engine == "trace" and not any("cannot run" in w for w in traced.warnings)
    assert formulas.peak_bytes == pytest.approx(traced.peak_bytes, rel=0.25)


@pytest.mark.parametrize("model_type", sorted(OTHERS))
def test_bart_family_configs_estimate(tmp_path, model_type):
    shape = OTHERS[model_type]
    info = _write(tmp_path, {"model_type": model_type, **shape})
    assert info.arch.num_layers == shape["encoder_layers"]
    assert info.arch.num_heads == shape["encoder_attention_heads"]
    assert info.arch.intermediate_size == shape["encoder_ffn_dim"]
    assert not info.arch.gated_mlp
    est = estimate(
        info, TrainingSetup(), micro_batch_size=2, seq_len=128, device="cpu", engine="analytic"
    )
    assert est.peak_bytes > est.components["weights"] > 0


def test_bart_extrapolation_matches_a_full_depth_trace(tmp_path):
    # both stacks 4 deep: two layers past the traced ones, in the encoder and the decoder
    info = _write(tmp_path, {**BART_BASE, "encoder_layers": 4, "decoder_layers": 4})
    work = Workload(micro_batch_size=2, seq_len=128, device="cpu")
    extrapolated = _trace_estimate.estimate_trace(info, TrainingSetup(), work)
    full = _trace_estimate.estimate_trace(info, TrainingSetup(), work, full_depth=True)
    assert extrapolated.peak_bytes == pytest.approx(full.peak_bytes, rel=0.005)


@pytest.mark.slow
def test_unequal_encoder_and_decoder_depths_are_traced_whole(tmp_path):
    def peak(encoder: int, decoder: int) -> tuple[int, int, int]:
        cfg = {**BART_BASE, "encoder_layers": encoder, "decoder_layers": decoder}
        path = tmp_path / f"{encoder}-{decoder}.json"
        path.write_text(json.dumps(cfg))
        info = resolve_model(str(path))
        est = estimate(
            info,
            TrainingSetup(precision="fp32"),
            micro_batch_size=2,
            seq_len=128,
            device="cpu",
            engine="trace",
        )
        return est.components["weights"], info.total_params, est.peak_bytes

    weights, params, short_decoder = peak(3, 1)
    assert weights == pytest.approx(4 * params, rel=0.001)  # the model it was asked about
    _, _, equal = peak(3, 3)
    assert short_decoder < equal
