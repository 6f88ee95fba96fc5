"""The benchmark scripts' interval of a median of per-round ratios (benchmarks/roundstats.py):
distribution-free, at least the coverage asked, and the narrowest such pair of order
statistics."""

from __future__ import annotations

import importlib.util
from math import comb
from pathlib import Path

import numpy as np
import pytest

_spec = importlib.util.spec_from_file_location(
    "roundstats", Path(__file__).resolve().parents[1] / "benchmarks" / "roundstats.py")
roundstats = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(roundstats)


def _below(n: int, j: int) -> float:
    """P(B ≤ j − 1), B ~ Binomial(n, ½)."""
    return sum(comb(n, i) for i in range(j)) / 2 ** n


@pytest.mark.parametrize("level", [0.9, 0.95, 0.99])
def test_the_interval_is_the_narrowest_pair_of_order_statistics_with_the_coverage(level):
    for n in range(1, 80):
        x = np.random.default_rng(n).permutation(n) + 100.0  # order statistics 100 … 99 + n
        got = roundstats.median_ci(x, level)
        # coverage of (x₍ⱼ₎, x₍ₙ₊₁₋ⱼ₎) is 1 − 2·P(B ≤ j − 1); j as large as it allows
        ok = [j for j in range(1, n // 2 + 2) if 1 - 2 * _below(n, j) >= level]
        if not ok:
            assert got is None, n
            continue
        j = max(ok)
        assert got == (100.0 + j - 1, 100.0 + n - j), n
        assert got[0] <= np.median(x) <= got[1]


def test_known_intervals_and_bad_levels():
    assert roundstats.median_ci(range(1, 11)) == (2.0, 9.0)  # n = 10: the textbook (x₂, x₉)
    assert roundstats.median_ci(range(1, 6)) is None  # 5 rounds: no 95 % interval exists
    assert roundstats.median_ci(range(1, 7)) == (1.0, 6.0)
    for bad in (0, 1, 1.5, -0.1):
        with pytest.raises(ValueError, match="level must be in"):
            roundstats.median_ci([1.0] * 10, bad)
