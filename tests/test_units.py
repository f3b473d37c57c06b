"""Byte sizes and counts: parsed from the user's text, refused when malformed, and formatted."""

import pytest

from batchfit._units import gib, human_count, parse_count, parse_size
from batchfit.errors import UsageError


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("16GiB", 16 * 2**30),
        ("500MB", 500 * 10**6),
        ("1.5 GB", 1_500_000_000),
        ("1048576", 1048576),
        ("2kib", 2048),
        (4096, 4096),
        ("24gb", 24 * 10**9),
    ],
)
def test_parse_size_units(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "16 parsecs", "-1GB", "0", "GB"])
def test_parse_size_rejects_bad_input(text):
    with pytest.raises(UsageError):
        parse_size(text)


def test_parse_count():
    assert parse_count("7B") == 7_000_000_000
    assert parse_count("350M") == 350_000_000
    with pytest.raises(UsageError):
        parse_count("0B")


def test_formatting():
    assert gib(2**30) == "1.00 GiB"
    assert human_count(8_030_261_248) == "8.03B"
    assert human_count(124_439_808) == "124.4M"
