"""Depth extrapolation per peak moment: equal to full-depth traces where the peak
moves, and monotone in the micro-batch and the sequence length."""

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchfit.memory.trace import estimate as _trace_estimate
from batchfit.models import resolve_model
from batchfit.spec import TrainingSetup
from batchfit.workload import Workload

pytestmark = pytest.mark.slow

# 8 wide layers, short sequences: up to micro-batch 9 the peak is the end of backward
# (every gradient held, the embeddings' last), beyond it the start of backward.
DEEP_GPT2 = {
    "model_type": "gpt2",
    "n_layer": 8,
    "n_embd": 256,
    "n_head": 4,
    "vocab_size": 8192,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "n_positions": 512,
    "architectures": ["GPT2LMHeadModel"],
}


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    path = tmp_path_factory.mktemp("deep") / "config.json"
    path.write_text(json.dumps(DEEP_GPT2))
    return resolve_model(str(path))


def _traced(info, setup, micro, seq, full, accum=1):
    result = _trace_estimate._estimate_traced(
        info,
        setup.resolved(device="cpu", bf16_supported=True),
        Workload(micro_batch_size=micro, seq_len=seq, device="cpu", grad_accum_steps=accum),
        full_depth=full,
    )
    return result.peak_bytes, result.extras["peak_moment"]


@pytest.mark.parametrize("loop", ["trainer", "keep-outputs"])
def test_extrapolated_equals_full_depth_around_the_phase_change(deep, loop):
    setup = TrainingSetup(precision="fp32", loop=loop)
    moments = set()
    # the peak moment changes between 9 and 10 (at 4 it is 9's, at 16 10's, in both loops):
    # each side's moment extrapolated where the other takes over
    for micro in (9, 10):
        extrapolated, moment = _traced(deep, setup, micro, 16, full=False)
        full, full_moment = _traced(deep, setup, micro, 16, full=True)
        assert extrapolated == pytest.approx(full, rel=0.005), micro
        assert moment == full_moment
        moments.add(moment)
    assert len(moments) > 1  # the sweep crosses a change of the peak moment


def test_later_micro_steps_hold_the_gradients(deep):
    # With accumulation the second micro-step runs with the first one's gradients held.
    # (micro-batch 10 without accumulation is the phase sweep's: one dry run for both)
    setup = TrainingSetup(precision="fp32")
    extrapolated, moment = _traced(deep, setup, 10, 16, full=False, accum=2)
    assert extrapolated == pytest.approx(
        _traced(deep, setup, 10, 16, full=True, accum=2)[0], rel=0.005
    )
    assert "gradients held" in moment
    assert extrapolated > _traced(deep, setup, 10, 16, full=False)[0]


@settings(
    max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    micro=st.integers(1, 12),
    seq=st.sampled_from([8, 16, 32, 64]),
    setup=st.sampled_from(
        [
            TrainingSetup(precision="fp32"),
            TrainingSetup(precision="fp32", loop="keep-outputs"),
            TrainingSetup(precision="amp-bf16", grad_ckpt=True),
            TrainingSetup(precision="fp32", optimizer="sgd"),
        ]
    ),
)
def test_estimate_is_monotone_in_micro_batch_and_sequence(deep, micro, seq, setup):
    here = _traced(deep, setup, micro, seq, full=False)[0]
    assert _traced(deep, setup, micro + 1, seq, full=False)[0] >= here
    assert _traced(deep, setup, micro, seq + 16, full=False)[0] >= here
