"""Divisors by factoring: the micro-batch must divide each GPU's share of the global batch.

Work grows with the size of the prime factors, not with ``n``: trial division by small primes,
then Miller-Rabin and Pollard's rho for what is left, so any ``n`` up to ``MAX_N`` answers in
milliseconds.
"""

from __future__ import annotations

import math
from itertools import count

MAX_N = 2**64
"""The largest number these functions factor (far above any batch people train with)."""

_SMALL_PRIMES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)
# Deterministic Miller-Rabin for n < 3.3e24 with the first twelve primes as bases
# (Sorenson and Webster 2015, "Strong pseudoprimes to twelve prime bases").
_TRIAL_LIMIT = 1000


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    for p in _SMALL_PRIMES:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for a in _SMALL_PRIMES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def _rho(n: int) -> int:
    """A non-trivial factor of the odd composite ``n`` (Pollard's rho, Brent's cycle finding)."""
    for c in count(1):
        y, r, q, g = 2, 1, 1, 1
        x = ys = y
        while g == 1:
            x = y
            for _ in range(r):
                y = (y * y + c) % n
            k = 0
            while k < r and g == 1:
                ys = y
                for _ in range(min(128, r - k)):  # one gcd per 128 steps (Brent 1980)
                    y = (y * y + c) % n
                    q = q * abs(x - y) % n
                g = math.gcd(q, n)
                k += 128
            r *= 2
        if g == n:  # the batch overshot: redo it one step at a time
            g = 1
            while g == 1:
                ys = (ys * ys + c) % n
                g = math.gcd(abs(x - ys), n)
        if g != n:
            return g
    raise AssertionError("unreachable: count() never ends")


def prime_factors(n: int) -> dict[int, int]:
    """``{prime: exponent}`` of ``1 <= n <= MAX_N``.

    Example:
        >>> prime_factors(360)
        {2: 3, 3: 2, 5: 1}
    """
    if not 1 <= n <= MAX_N:
        raise ValueError(f"can only factor 1..2**64, got {n}")
    factors: dict[int, int] = {}
    for p in (2, *range(3, _TRIAL_LIMIT, 2)):
        while n % p == 0:
            factors[p] = factors.get(p, 0) + 1
            n //= p
    stack = [n] if n > 1 else []
    while stack:
        m = stack.pop()
        if _is_prime(m):
            factors[m] = factors.get(m, 0) + 1
        else:
            d = _rho(m)
            stack += [d, m // d]
    return dict(sorted(factors.items()))


def divisors(n: int) -> list[int]:
    """Every divisor of ``n``, ascending.

    Example:
        >>> divisors(12)
        [1, 2, 3, 4, 6, 12]
    """
    out = [1]
    for p, e in prime_factors(n).items():
        out = [d * p**k for d in out for k in range(e + 1)]
    return sorted(out)


def largest_divisor_at_most(n: int, limit: int) -> int:
    """Largest divisor of ``n`` not above ``limit`` (1 if none), so accumulation stays an integer.

    Example:
        >>> largest_divisor_at_most(96, 10)
        8
    """
    return max((d for d in divisors(n) if d <= limit), default=1)


def divisors_near(n: int, around: int) -> str:
    """The three divisors of ``n`` nearest ``around``, ascending, for an error message.

    Example:
        >>> divisors_near(48, 5)
        '3, 4, 6'
    """
    nearest = sorted(divisors(n), key=lambda d: abs(d - around))[:3]
    return ", ".join(str(d) for d in sorted(nearest))
