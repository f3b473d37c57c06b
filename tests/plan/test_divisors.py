"""Divisors by factoring: exact, and fast whatever the size of the batch."""

from __future__ import annotations

import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchfit.errors import UsageError
from batchfit.hardware import get_gpu
from batchfit.models import resolve_model
from batchfit.plan import make_plan
from batchfit.plan._divisors import (
    MAX_N,
    divisors,
    divisors_near,
    largest_divisor_at_most,
    prime_factors,
)
from batchfit.spec import TrainingSetup

LARGE_PRIME = 999_999_999_999_999_989  # the largest prime below 10**18
SEMIPRIME = 4_294_967_279 * 4_294_967_291  # two primes near 2**32: the hardest case for rho
BIG = [10**11, 2**60, LARGE_PRIME, 1_000_000_007, SEMIPRIME, 10**18 - 1, MAX_N]


@given(st.integers(1, 5000))
def test_divisors_match_the_definition(n: int) -> None:
    assert divisors(n) == [d for d in range(1, n + 1) if n % d == 0]


@given(st.integers(1, 3000), st.integers(-5, 3100))
def test_largest_divisor_and_nearest_match_the_definition(n: int, limit: int) -> None:
    below = [d for d in range(1, n + 1) if n % d == 0 and d <= limit]
    assert largest_divisor_at_most(n, limit) == (below[-1] if below else 1)
    everything = [d for d in range(1, n + 1) if n % d == 0]
    nearest = sorted(sorted(everything, key=lambda d: abs(d - limit))[:3])
    assert divisors_near(n, limit) == ", ".join(map(str, nearest))


@pytest.mark.parametrize("n", BIG)
def test_huge_numbers_factor_in_milliseconds(n: int) -> None:
    start = time.perf_counter()
    factors = prime_factors(n)
    near = divisors_near(n, 2)
    largest = largest_divisor_at_most(n, 1000)
    elapsed = time.perf_counter() - start
    product = 1
    for p, e in factors.items():
        assert all(p % q for q in range(2, min(p, 10**4)) if q * q <= p)
        product *= p**e
    assert product == n
    assert n % largest == 0 and largest <= 1000
    assert all(n % int(d) == 0 for d in near.split(", "))
    assert elapsed < 1.0  # the search over every integer took 34 s for 10**9+7, forever for 10**11


def test_known_factorisations() -> None:
    assert prime_factors(2**60) == {2: 60}
    assert prime_factors(10**11) == {2: 11, 5: 11}
    assert prime_factors(LARGE_PRIME) == {LARGE_PRIME: 1}
    assert prime_factors(SEMIPRIME) == {4_294_967_279: 1, 4_294_967_291: 1}
    assert divisors_near(LARGE_PRIME, 2) == f"1, {LARGE_PRIME}"
    assert largest_divisor_at_most(2**60, 1000) == 512
    with pytest.raises(ValueError, match="factor"):
        prime_factors(MAX_N + 1)


@pytest.mark.parametrize(
    ("global_batch", "hint"),
    [(1_000_000_007, "try 1, 1000000007$"), (10**11, "try 4, 5, 8$"), (2**60, "try 2, 4, 8$")],
)
def test_plan_with_a_huge_batch_answers_at_once(global_batch: int, hint: str) -> None:
    start = time.perf_counter()
    with pytest.raises(UsageError, match=hint):
        make_plan(
            resolve_model("gpt2"),
            get_gpu("a100-80gb"),
            TrainingSetup(),
            seq_len=256,
            global_batch=global_batch,
            micro_batch_size=6,
        )
    assert time.perf_counter() - start < 2.0


def test_plan_past_the_factoring_limit_is_refused() -> None:
    with pytest.raises(UsageError, match="past what batchfit plans"):
        make_plan(
            resolve_model("gpt2"),
            get_gpu("a100-80gb"),
            TrainingSetup(),
            seq_len=1,
            global_batch_tokens=10**30,
        )
