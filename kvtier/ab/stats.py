"""Statistics that can decide: clustered bootstrap intervals, paired ratios, verdicts from
intervals.

One A/B run of a strategy is a handful of conversations on a shared machine, and turns of one
conversation are not independent. A single median cannot tell 5% apart, so every comparison
the report makes goes through this module:

- ``quantile_ci(xs, q, clusters=...)``: a statistic (median, p90, ...) of one sample with its
  bootstrap interval (percentile method, ``N_BOOT`` resamples, 95% by default);
- ``paired(a, b)`` / ``paired_ratios(a, b)``: per-key ratios ``a[k] / b[k]`` over the keys
  both have (the A/B harness pairs turn *i* of conversation *c* in repeat *r* of strategy A
  with the same turn of strategy B: same prompt, same place in the trace, same round of the
  rotated sweep), and ``ratio_ci`` their median with its bootstrap interval;
- ``quantile_ratio_ci(a, b, q)``: the ratio of two samples' quantiles (e.g. TTFT p90), the two
  resampled independently (quantiles of unpaired samples);
- ``verdict(iv)``: "faster" when the whole interval of a time ratio is below 1, "slower" when
  it is above, "not resolved" otherwise -- never from the point estimate; ``at_most`` /
  ``at_least`` decide a bound the same way (``True`` / ``False`` / ``None`` = not resolved).

**Clusters.** Turns of one conversation are not independent (they share a stack, a history and
a growing context), so a bootstrap that resamples turns makes intervals too narrow. Given
``clusters`` (one label per value: the records' ``conversation_id``, which names one
conversation of one repeat), ``bootstrap_quantiles`` resamples whole clusters with replacement
and takes the statistic over every value of the clusters drawn (a clustered bootstrap);
``MIN_N`` then counts clusters. Without ``clusters`` each value is its own cluster: right for
per-repeat values (repeats are separate runs of the stack).

Quantiles are nearest-rank (``index = round(q * (n - 1))`` of the sorted sample), the same
rule as the report's summary table, so an interval's point is the table's number. Resampling
is seeded (``numpy.random.default_rng(seed)``): the same data give the same interval on every
machine, and a committed report regenerates byte for byte. Fewer than ``MIN_N`` clusters give
an interval with NaN ends, which resolves nothing.

``histogram_quantile`` estimates a quantile from Prometheus histogram buckets (linear inside
the bucket, like PromQL's ``histogram_quantile``); ``histogram_quantile_resolved`` is what the
report uses: NaN where the quantile falls inside the first bucket (linear interpolation between
0 and that bucket's bound is an artefact, not a measurement), and ``first_bucket_bound`` gives
the bound to print instead ("< 300 ms").

Threading model: pure functions over immutable values.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Literal, TypeVar

import numpy as np

N_BOOT = 4000
LEVEL = 0.95
MIN_N = 3
SEED = 0
K = TypeVar("K", bound=Hashable)

Verdict = Literal["faster", "slower", "not resolved"]
VERDICTS: tuple[Verdict, ...] = ("faster", "slower", "not resolved")


@dataclass(frozen=True)
class Interval:
    """A point estimate with its bootstrap interval (``lo``/``hi`` NaN: too few values).
    ``clusters``: how many clusters (conversations) were resampled, 0 when values were."""

    point: float
    lo: float
    hi: float
    n: int
    level: float = LEVEL
    clusters: int = 0

    @property
    def defined(self) -> bool:
        return not (math.isnan(self.lo) or math.isnan(self.hi))

    def fmt(self, scale: float = 1.0, digits: int = 0, unit: str = "") -> str:
        """``"123 [110, 140]"`` (``scale`` multiplies, e.g. 1e3 for seconds -> ms)."""
        if math.isnan(self.point):
            return "–"
        p = f"{self.point * scale:,.{digits}f}{unit}"
        if not self.defined:
            return f"{p} [n={self.n}" + (f", {self.clusters} conv." if self.clusters else "") + "]"
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


def _finite(xs: Sequence[float], clusters: Sequence[Hashable] | None
            ) -> tuple[list[float], list[Hashable]]:
    """The finite values and their cluster labels (each value its own cluster by default)."""
    if clusters is not None and len(clusters) != len(xs):
        raise ValueError(f"{len(clusters)} cluster labels for {len(xs)} values")
    labels: Sequence[Hashable] = clusters if clusters is not None else range(len(xs))
    keep = [(float(v), c) for v, c in zip(xs, labels) if math.isfinite(v)]
    return [v for v, _ in keep], [c for _, c in keep]


def cluster_counts(k: int, rng: np.random.Generator, n_boot: int) -> np.ndarray:
    """``(n_boot, k)``: how many times each of ``k`` clusters is drawn in each resample (``k``
    draws with replacement)."""
    draws = rng.integers(0, k, size=(n_boot, k)) + k * np.arange(n_boot)[:, None]
    counts = np.bincount(draws.ravel(), minlength=n_boot * k).reshape(n_boot, k)
    return counts.astype(np.int32)  # half the memory traffic of the cumulative sums below


def bootstrap_quantiles(xs: Sequence[float], q: float, clusters: Sequence[Hashable] | None,
                        rng: np.random.Generator, n_boot: int = N_BOOT) -> np.ndarray:
    """The nearest-rank ``q`` quantile of ``n_boot`` resamples of ``xs``: each resample draws
    whole clusters with replacement and keeps every value of each cluster drawn (as often as
    the cluster was drawn). Without ``clusters`` each value is its own cluster. ``xs`` must be
    finite."""
    vals = np.asarray(xs, dtype=float)
    labels: Sequence[Hashable] = clusters if clusters is not None else range(len(vals))
    ids: dict[Hashable, int] = {}
    of = np.asarray([ids.setdefault(c, len(ids)) for c in labels], dtype=np.int64)
    counts = cluster_counts(len(ids), rng, n_boot)
    order = np.argsort(vals, kind="stable")
    weights = counts[:, of[order]]                 # (n_boot, n): copies of each sorted value
    cum = np.cumsum(weights, axis=1, dtype=np.int32)
    total = cum[:, -1]
    rank = np.rint(q * (total - 1)).astype(np.int64)  # round half to even, as ``_rank``
    pos = np.argmax(cum > rank[:, None], axis=1)
    return vals[order][pos]


def _bounds(boot: np.ndarray, level: float) -> tuple[float, float]:
    a = (1.0 - level) / 2.0
    lo, hi = np.quantile(boot, [a, 1.0 - a])
    return float(lo), float(hi)


def _n_clusters(clusters: Sequence[Hashable] | None, vals: list[float],
                labels: list[Hashable]) -> tuple[int, int]:
    """(clusters resampled, the count ``MIN_N`` applies to)."""
    k = len(set(labels))
    return (k, k) if clusters is not None else (0, len(vals))


def quantile_ci(xs: Sequence[float], q: float = 0.5, *,
                clusters: Sequence[Hashable] | None = None, seed: int = SEED,
                n_boot: int = N_BOOT, level: float = LEVEL) -> Interval:
    """The ``q`` quantile of ``xs`` with its bootstrap interval (clustered by ``clusters``)."""
    vals, labels = _finite(xs, clusters)
    point = nearest_rank(vals, q)
    shown, units = _n_clusters(clusters, vals, labels)
    if units < MIN_N:
        return Interval(point, float("nan"), float("nan"), len(vals), level, shown)
    rng = np.random.default_rng(seed)
    lo, hi = _bounds(bootstrap_quantiles(vals, q, labels, rng, n_boot), level)
    return Interval(point, lo, hi, len(vals), level, shown)


def median_ci(xs: Sequence[float], *, clusters: Sequence[Hashable] | None = None,
              seed: int = SEED, n_boot: int = N_BOOT, level: float = LEVEL) -> Interval:
    return quantile_ci(xs, 0.5, clusters=clusters, seed=seed, n_boot=n_boot, level=level)


def paired(a: Mapping[K, float], b: Mapping[K, float]) -> tuple[list[K], list[float]]:
    """The keys and ratios ``a[k] / b[k]`` for every key both have with finite values and
    ``b[k] > 0``, in key order of ``a``."""
    keys: list[K] = []
    out: list[float] = []
    for k, va in a.items():
        vb = b.get(k)
        if vb is None or not (math.isfinite(va) and math.isfinite(vb)) or vb <= 0:
            continue
        keys.append(k)
        out.append(va / vb)
    return keys, out


def paired_ratios(a: Mapping[Hashable, float], b: Mapping[Hashable, float]) -> list[float]:
    """The ratios of ``paired(a, b)``."""
    return paired(a, b)[1]


def ratio_ci(ratios: Sequence[float], *, clusters: Sequence[Hashable] | None = None,
             seed: int = SEED, n_boot: int = N_BOOT, level: float = LEVEL) -> Interval:
    """Median of paired ratios with its bootstrap interval (clustered by ``clusters``)."""
    return quantile_ci(ratios, 0.5, clusters=clusters, seed=seed, n_boot=n_boot, level=level)


def quantile_ratio_ci(a: Sequence[float], b: Sequence[float], q: float = 0.5, *,
                      clusters_a: Sequence[Hashable] | None = None,
                      clusters_b: Sequence[Hashable] | None = None, seed: int = SEED,
                      n_boot: int = N_BOOT, level: float = LEVEL) -> Interval:
    """``quantile(a, q) / quantile(b, q)``, each sample resampled on its own (by its clusters
    when given)."""
    xa, la = _finite(a, clusters_a)
    xb, lb = _finite(b, clusters_b)
    pb = nearest_rank(xb, q)
    point = nearest_rank(xa, q) / pb if xb and pb > 0 else float("nan")
    n = min(len(xa), len(xb))
    ka, ua = _n_clusters(clusters_a, xa, la)
    kb, ub = _n_clusters(clusters_b, xb, lb)
    shown = min(ka, kb)
    if min(ua, ub) < MIN_N or math.isnan(point):
        return Interval(point, float("nan"), float("nan"), n, level, shown)
    rng = np.random.default_rng(seed)
    qa = bootstrap_quantiles(xa, q, la, rng, n_boot)
    qb = bootstrap_quantiles(xb, q, lb, rng, n_boot)
    ok = qb > 0
    lo, hi = _bounds(qa[ok] / qb[ok], level)
    return Interval(point, lo, hi, n, level, shown)


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


def first_bucket_bound(buckets: Sequence[tuple[float, float]], q: float) -> float | None:
    """The first bucket's upper bound when the ``q`` quantile falls inside the first bucket
    (the histogram only says "below this bound"), else None."""
    bs = sorted(buckets)
    if not bs or bs[-1][1] <= 0 or math.isinf(bs[0][0]):
        return None
    return bs[0][0] if bs[0][1] >= q * bs[-1][1] else None


def histogram_quantile_resolved(buckets: Sequence[tuple[float, float]], q: float) -> float:
    """``histogram_quantile``, but NaN where the quantile falls inside the first bucket: there
    the histogram says only "below the first bound" (``first_bucket_bound``), and the linear
    interpolation from 0 would be an artefact (vLLM's queue-time histogram: "270 ms" for a
    p90 under its first bound of 0.3 s, next to a mean of 0 ms)."""
    if first_bucket_bound(buckets, q) is not None:
        return float("nan")
    return histogram_quantile(buckets, q)
