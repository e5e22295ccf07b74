"""Statistics that can decide: bootstrap intervals, paired ratios and verdicts from intervals.

One A/B run of a strategy is a handful of turns on a shared machine; two runs of the *same*
deployment have measured 0.85–1.22× of each other (``benchmarks/AB.md``). A single median
cannot tell 5% apart, so every comparison the report makes goes through this module:

- ``quantile_ci(xs, q)``: a statistic (median, p90, ...) of one sample with its bootstrap
  interval (percentile method, ``N_BOOT`` resamples, 95% by default);
- ``paired_ratios(a, b)``: per-key ratios ``a[k] / b[k]`` over the keys both have (the A/B
  harness pairs turn *i* of conversation *c* in repeat *r* of strategy A with the same turn of
  strategy B: same prompt, same place in the trace, same round of the rotated sweep), and
  ``ratio_ci`` their median with its bootstrap interval;
- ``quantile_ratio_ci(a, b, q)``: the ratio of two samples' quantiles (e.g. TTFT p90), the two
  resampled independently (quantiles of unpaired samples);
- ``verdict(iv)``: "faster" when the whole interval of a time ratio is below 1, "slower" when
  it is above, "not resolved" otherwise -- never from the point estimate; ``at_most`` /
  ``at_least`` decide a bound the same way (``True`` / ``False`` / ``None`` = not resolved).

Quantiles are nearest-rank (``index = round(q * (n - 1))`` of the sorted sample), the same
rule as the report's summary table, so an interval's point is the table's number. Resampling
is seeded (``numpy.random.default_rng(seed)``): the same data give the same interval on every
machine. Fewer than ``MIN_N`` values give an interval with NaN ends, which resolves nothing.
The bootstrap treats turns as independent; turns of one conversation are not quite (they share
a stack and a history), so the intervals are if anything narrower than the truth -- a reason
to run ``--repeats`` and not to read "not resolved" as "equal".

``histogram_quantile`` estimates a quantile from Prometheus histogram buckets (linear inside
the bucket, like PromQL's ``histogram_quantile``) for the engines' own latency histograms.

Threading model: pure functions over immutable values.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Literal

import numpy as np

N_BOOT = 4000
LEVEL = 0.95
MIN_N = 3
SEED = 0

Verdict = Literal["faster", "slower", "not resolved"]
VERDICTS: tuple[Verdict, ...] = ("faster", "slower", "not resolved")


@dataclass(frozen=True)
class Interval:
    """A point estimate with its bootstrap interval (``lo``/``hi`` NaN: too few values)."""

    point: float
    lo: float
    hi: float
    n: int
    level: float = LEVEL

    @property
    def defined(self) -> bool:
        return not (math.isnan(self.lo) or math.isnan(self.hi))

    def fmt(self, scale: float = 1.0, digits: int = 0, unit: str = "") -> str:
        """``"123 [110, 140]"`` (``scale`` multiplies, e.g. 1e3 for seconds -> ms)."""
        if math.isnan(self.point):
            return "–"
        p = f"{self.point * scale:,.{digits}f}{unit}"
        if not self.defined:
            return f"{p} [n={self.n}]"
        return f"{p} [{self.lo * scale:,.{digits}f}, {self.hi * scale:,.{digits}f}]{unit}"

    def to_dict(self) -> dict:
        return asdict(self)


NAN_INTERVAL = Interval(float("nan"), float("nan"), float("nan"), 0)


def _rank(n: int, q: float) -> int:
    return min(n - 1, max(0, int(round(q * (n - 1)))))


def nearest_rank(xs: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``xs`` by nearest rank (NaN for an empty sample)."""
    if not xs:
        return float("nan")
    return float(sorted(xs)[_rank(len(xs), q)])


def _boot_quantiles(x: np.ndarray, q: float, rng: np.random.Generator, n_boot: int) -> np.ndarray:
    idx = rng.integers(0, len(x), size=(n_boot, len(x)))
    return np.sort(x[idx], axis=1)[:, _rank(len(x), q)]


def _bounds(boot: np.ndarray, level: float) -> tuple[float, float]:
    a = (1.0 - level) / 2.0
    lo, hi = np.quantile(boot, [a, 1.0 - a])
    return float(lo), float(hi)


def quantile_ci(xs: Sequence[float], q: float = 0.5, *, seed: int = SEED, n_boot: int = N_BOOT,
                level: float = LEVEL) -> Interval:
    """The ``q`` quantile of ``xs`` with its bootstrap interval."""
    vals = [float(v) for v in xs if math.isfinite(v)]
    point = nearest_rank(vals, q)
    if len(vals) < MIN_N:
        return Interval(point, float("nan"), float("nan"), len(vals), level)
    rng = np.random.default_rng(seed)
    lo, hi = _bounds(_boot_quantiles(np.asarray(vals), q, rng, n_boot), level)
    return Interval(point, lo, hi, len(vals), level)


def median_ci(xs: Sequence[float], *, seed: int = SEED, n_boot: int = N_BOOT,
              level: float = LEVEL) -> Interval:
    return quantile_ci(xs, 0.5, seed=seed, n_boot=n_boot, level=level)


def paired_ratios(a: Mapping[Hashable, float], b: Mapping[Hashable, float]) -> list[float]:
    """``a[k] / b[k]`` for every key both have with finite values and ``b[k] > 0``, in key
    order of ``a``."""
    out = []
    for k, va in a.items():
        vb = b.get(k)
        if vb is None or not (math.isfinite(va) and math.isfinite(vb)) or vb <= 0:
            continue
        out.append(va / vb)
    return out


def ratio_ci(ratios: Sequence[float], *, seed: int = SEED, n_boot: int = N_BOOT,
             level: float = LEVEL) -> Interval:
    """Median of paired ratios with its bootstrap interval."""
    return quantile_ci(ratios, 0.5, seed=seed, n_boot=n_boot, level=level)


def quantile_ratio_ci(a: Sequence[float], b: Sequence[float], q: float = 0.5, *,
                      seed: int = SEED, n_boot: int = N_BOOT, level: float = LEVEL) -> Interval:
    """``quantile(a, q) / quantile(b, q)``, each sample resampled on its own."""
    xa = [float(v) for v in a if math.isfinite(v)]
    xb = [float(v) for v in b if math.isfinite(v)]
    pb = nearest_rank(xb, q)
    point = nearest_rank(xa, q) / pb if xb and pb > 0 else float("nan")
    n = min(len(xa), len(xb))
    if n < MIN_N or math.isnan(point):
        return Interval(point, float("nan"), float("nan"), n, level)
    rng = np.random.default_rng(seed)
    qa = _boot_quantiles(np.asarray(xa), q, rng, n_boot)
    qb = _boot_quantiles(np.asarray(xb), q, rng, n_boot)
    ok = qb > 0
    lo, hi = _bounds(qa[ok] / qb[ok], level)
    return Interval(point, lo, hi, n, level)


# ---------------------------------------------------------------- verdicts ------------
def verdict(iv: Interval, *, lower_is_better: bool = True, at: float = 1.0) -> Verdict:
    """From the interval of a ratio A/B: "faster" (A better) when it lies entirely on the
    better side of ``at``, "slower" when entirely on the other, else "not resolved"."""
    if not iv.defined:
        return "not resolved"
    if iv.hi < at:
        return "faster" if lower_is_better else "slower"
    if iv.lo > at:
        return "slower" if lower_is_better else "faster"
    return "not resolved"


def at_most(iv: Interval, bound: float) -> bool | None:
    """True when the whole interval is ≤ ``bound``, False when it is entirely above, else
    None (not resolved)."""
    if not iv.defined:
        return None
    if iv.hi <= bound:
        return True
    if iv.lo > bound:
        return False
    return None


def at_least(iv: Interval, bound: float) -> bool | None:
    """True when the whole interval is ≥ ``bound``, False when entirely below, else None."""
    if not iv.defined:
        return None
    if iv.lo >= bound:
        return True
    if iv.hi < bound:
        return False
    return None


# ---------------------------------------------------------------- histograms ----------
def histogram_quantile(buckets: Sequence[tuple[float, float]], q: float) -> float:
    """The ``q`` quantile from cumulative Prometheus buckets ``[(le, count), ...]`` (``le``
    may be ``inf``), linear inside the bucket it falls in; NaN when the histogram is empty.
    A quantile in the ``+Inf`` bucket is the largest finite bound."""
    bs = sorted(buckets)
    if not bs or bs[-1][1] <= 0:
        return float("nan")
    total = bs[-1][1]
    rank = q * total
    prev_le, prev_c = 0.0, 0.0
    for le, c in bs:
        if c >= rank:
            if math.isinf(le):
                return prev_le
            if c == prev_c:
                return le
            return prev_le + (le - prev_le) * (rank - prev_c) / (c - prev_c)
        prev_le, prev_c = (le if math.isfinite(le) else prev_le), c
    return prev_le
