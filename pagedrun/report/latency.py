"""A run's latencies in bounded memory: exact while few, a log-bucket histogram once many.

The report gives p50/p90/p99 of the time to first token, the gaps between tokens and the end-to-end
time. Kept as 8-byte doubles, the gaps alone grow by 8 bytes per output token: a 200,000-request job
of 256-token answers would hold 400 MB of them. So the first EXACT_LIMIT samples are kept as they
are (percentiles then exactly as before: linear interpolation, numpy's default), and past that every
sample goes into a histogram of buckets 1% wide on a log scale, 1e-7 s to 9e5 s: about 24 KB
whatever the run's length. A percentile from the histogram is its bucket's geometric middle, within
0.5% of a sample that lies in the bucket, clamped to the smallest and largest samples seen (kept
exactly); the report says which kind each figure is.
"""
from __future__ import annotations

import math
from array import array
from collections.abc import Iterable

EXACT_LIMIT = 1 << 16  # samples kept as they are: 512 KiB
_LOW = 1e-7  # seconds: the first bucket's lower edge; anything below (and 0) falls in bucket 0
_RATIO = 1.01
_LOG_RATIO = math.log(_RATIO)
_BUCKETS = 3000  # 1e-7 * 1.01 ** 3000 is about 9e5 s


class LatencySamples:
    """append / extend like an array of seconds; `percentiles` for the report."""

    def __init__(self) -> None:
        self.exact: array | None = array("d")  # None once the histogram has taken over
        self.counts: array | None = None
        self.count = 0
        self.min = math.inf
        self.max = -math.inf

    def append(self, x: float) -> None:
        self.count += 1
        self.min, self.max = min(self.min, x), max(self.max, x)
        if self.exact is not None:
            self.exact.append(x)
            if len(self.exact) > EXACT_LIMIT:
                self._to_histogram()
        else:
            self.counts[_bucket(x)] += 1

    def extend(self, xs: Iterable[float]) -> None:
        for x in xs:
            self.append(x)

    def __len__(self) -> int:
        return self.count

    @property
    def is_exact(self) -> bool:
        return self.exact is not None

    def _to_histogram(self) -> None:
        self.counts = array("Q", bytes(8 * _BUCKETS))
        for x in self.exact:
            self.counts[_bucket(x)] += 1
        self.exact = None

    def percentiles(self, ps: tuple[int, ...] = (50, 90, 99)) -> dict[str, float | None]:
        if self.exact is not None:
            return exact_percentiles(self.exact, ps)
        out: dict[str, float | None] = {}
        for p in ps:
            rank = int((self.count - 1) * p / 100)  # the sample at or below the interpolation point
            seen = 0
            for i, c in enumerate(self.counts):
                seen += c
                if seen > rank:
                    break
            middle = _LOW * _RATIO ** (i - 0.5) if i else 0.0  # bucket i: [LOW r^(i-1), LOW r^i)
            out[f"p{p}"] = min(max(middle, self.min), self.max)
        return out


def exact_percentiles(xs: Iterable[float], ps: tuple[int, ...] = (50, 90, 99)) -> dict[str, float | None]:
    """Linear-interpolated percentiles (numpy's default method); None for no samples."""
    xs = sorted(xs)
    out: dict[str, float | None] = {}
    for p in ps:
        if not xs:
            out[f"p{p}"] = None
            continue
        k = (len(xs) - 1) * p / 100
        lo = int(k)
        hi = min(lo + 1, len(xs) - 1)
        out[f"p{p}"] = xs[lo] + (xs[hi] - xs[lo]) * (k - lo)
    return out


def _bucket(x: float) -> int:
    if not x > _LOW:  # 0, negative (a clock step) or NaN: the first bucket
        return 0
    return min(_BUCKETS - 1, 1 + int(math.log(x / _LOW) / _LOG_RATIO))
