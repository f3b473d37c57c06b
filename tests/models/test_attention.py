"""--attention auto resolves to what the model class supports (DeBERTa has no SDPA)."""

import json

import pytest
import torch

from batchfit.errors import UsageError
from batchfit.memory.estimate import estimate
from batchfit.memory.trace import dry_run as trace
from batchfit.memory.trace import hf as _hf_trace
from batchfit.models import ENCODER_DECODER_TYPES, ENCODER_TYPES, catalog_names, resolve_model
from batchfit.models._arch import (
    ATTENTION_FREE_TYPES,
    LEARNED_POSITION_TYPES,
    NO_SDPA_TYPES,
    RMSNORM_TYPES,
)
from batchfit.spec import TrainingSetup
from tests._cli import run_cli
from tests._tiny import TINY_DEBERTA_V3


@pytest.fixture
def deberta(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_DEBERTA_V3))
    return str(path)


@pytest.mark.parametrize("task", ["masked-lm", "classification"])
def test_deberta_traces_with_auto_attention_as_eager(deberta, task):
    info = resolve_model(deberta, task)
    est = estimate(info, TrainingSetup(), micro_batch_size=2, seq_len=64, device="cpu")
    assert est.engine == "trace" and est.setup.attention == "eager"
    assert not any("cannot run" in w for w in est.warnings)


def test_deberta_analytic_reports_eager(deberta):
    info = resolve_model(deberta)
    est = estimate(
        info, TrainingSetup(), micro_batch_size=2, seq_len=64, device="cpu", engine="analytic"
    )
    assert est.setup.attention == "eager"


def test_explicit_sdpa_on_deberta_is_a_usage_error(deberta, capsys):
    with pytest.raises(UsageError, match="attention eager"):
        estimate(
            resolve_model(deberta),
            TrainingSetup(attention="sdpa"),
            micro_batch_size=2,
            seq_len=64,
            device="cpu",
            engine="analytic",
        )
    code, _, err = run_cli(
        ["estimate", deberta, "-b", "2", "-s", "64", "--device", "cpu", "--attention", "sdpa"],
        capsys,
    )
    assert code == 2 and "--attention eager" in err and len(err.strip().splitlines()) == 1


def test_probe_step_on_deberta_runs_eager(deberta):
    # The probe builds from TrainingSetup.resolved(), where auto is already "sdpa".
    info = resolve_model(deberta)
    setup = TrainingSetup(precision="fp32").resolved(device="cpu", bf16_supported=True)
    assert setup.attention == "sdpa"
    parts = _hf_trace.step_parts(info, setup, micro=2, seq=16, emulate_cuda=False)
    with trace.quiet():
        loss = parts.model(**parts.make_batch()).loss
    loss.backward()
    assert torch.isfinite(loss)


def test_gpt2_keeps_sdpa():
    assert resolve_model("gpt2").resolve_attention("auto") == "sdpa"
    assert resolve_model("gpt2").resolve_attention("eager") == "eager"


@pytest.mark.slow
def test_no_sdpa_types_match_transformers_classes():
    # The analytic engine reads NO_SDPA_TYPES without importing transformers; here each type
    # it names, and each type batchfit knows, is checked against the model class's attribute.
    import transformers
    from transformers.models.auto import modeling_auto

    catalog_types = {resolve_model(name).arch.model_type for name in catalog_names()}
    known = catalog_types | ENCODER_TYPES | ENCODER_DECODER_TYPES | LEARNED_POSITION_TYPES
    known |= RMSNORM_TYPES | NO_SDPA_TYPES
    checked = 0
    # convolutional image models have no attention to implement: their flag says nothing
    known -= ATTENTION_FREE_TYPES
    for model_type in sorted(known):
        class_name = modeling_auto.MODEL_MAPPING_NAMES.get(
            model_type
        ) or modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
        if class_name is None:  # no model class: nothing to check, and not claimed
            assert model_type not in NO_SDPA_TYPES, model_type
            continue
        if isinstance(class_name, tuple | list):
            class_name = class_name[0]
        cls = getattr(transformers, class_name)
        assert (model_type in NO_SDPA_TYPES) == (not cls._supports_sdpa), model_type
        checked += 1
    assert checked > len(NO_SDPA_TYPES)
