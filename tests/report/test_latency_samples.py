"""LatencySamples: exact percentiles while few, a bounded histogram within 0.5% once many."""
import random

import pytest

from pagedrun.report import latency
from pagedrun.report.latency import LatencySamples, exact_percentiles


def _lognormal(n: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    return [rng.lognormvariate(-4.0, 1.5) for _ in range(n)]


def test_exact_while_few_matches_linear_interpolation():
    xs = _lognormal(1000, 0)
    s = LatencySamples()
    s.extend(xs)
    assert s.is_exact and len(s) == 1000
    assert s.percentiles() == exact_percentiles(xs)
    assert LatencySamples().percentiles() == {"p50": None, "p90": None, "p99": None}


@pytest.mark.parametrize("seed", [1, 2])
def test_histogram_within_half_a_percent_and_bounded(monkeypatch, seed):
    monkeypatch.setattr(latency, "EXACT_LIMIT", 500)
    xs = _lognormal(20_000, seed) + [0.0, 1e-9, 5e5]  # a zero, one below the first bucket, one far out
    s = LatencySamples()
    s.extend(xs)
    assert not s.is_exact and len(s) == len(xs)
    size = len(s.counts)
    s.extend(_lognormal(5_000, seed + 10))  # more samples, same memory
    assert len(s.counts) == size and s.exact is None
    xs += _lognormal(5_000, seed + 10)
    ordered = sorted(xs)
    for p, got in s.percentiles((1, 50, 90, 99, 100)).items():
        rank = int((len(xs) - 1) * int(p[1:]) / 100)
        assert got == pytest.approx(ordered[rank], rel=0.0051), p
