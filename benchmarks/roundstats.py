"""Statistics of interleaved benchmark rounds (imported by the ``bench_*.py`` scripts, which run
from this folder).

Whole runs on a shared machine drift and jump by more than a change moves them, so the scripts
interleave the settings and take each round's ratio to the same round's base run. How sure a
median of those ratios is comes from :func:`median_ci`: a distribution-free interval — it
assumes only that the rounds' ratios are independent draws of one distribution, not that they
are normal (they are not: a busy machine adds long upper tails)."""

from __future__ import annotations

from math import comb
from typing import Sequence


def median_ci(values: Sequence[float], level: float = 0.95) -> tuple[float, float] | None:
    """A confidence interval of the median of ``values`` with coverage at least ``level``:
    the order statistics (x₍ⱼ₎, x₍ₙ₊₁₋ⱼ₎) for the largest j with P(B ≤ j − 1) ≤ (1 − level)/2,
    B ~ Binomial(n, ½) (the number of draws below the true median). None when there are too
    few values for any such interval (n < 6 at 95 %)."""
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), not {level}")
    x = sorted(float(v) for v in values)
    n = len(x)
    tail, cdf, j = (1 - level) / 2, 0.0, 0
    for i in range(n + 1):
        p = comb(n, i) / 2 ** n
        if cdf + p > tail:
            break
        cdf, j = cdf + p, i + 1
    return None if j == 0 else (x[j - 1], x[n - j])
