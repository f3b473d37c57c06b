"""Resolving MODEL costs time in proportion to the answer, not to the input's magnitude."""

import time

import pytest

from batchfit.models import generic_decoder_config, resolve_model


def _hidden_by_steps(num_params: int, vocab: int = 32000) -> int:
    # The original linear walk: the reference the closed form must agree with.
    hidden = 128
    while 12 * (hidden + 128) ** 3 / 128 + 2 * vocab * (hidden + 128) <= num_params:
        hidden += 128
    return hidden


@pytest.mark.parametrize(
    "num_params", [1, 124_000_000, 7 * 10**9, 7 * 10**9 + 1, 70 * 10**9, 10**13]
)
def test_generic_hidden_size_matches_the_linear_walk(num_params):
    assert generic_decoder_config(num_params)["hidden_size"] == _hidden_by_steps(num_params)


def test_an_absurd_bare_size_resolves_at_once():
    started = time.perf_counter()
    info = resolve_model("1000000000000000000T")  # 10^30 parameters: 54 s before
    assert time.perf_counter() - started < 2.0
    assert abs(info.total_params - 10**30) / 10**30 < 0.01
