"""kvtier.ab.stats: bootstrap intervals on known distributions, paired ratios, verdicts only
from intervals, histogram quantiles."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvtier.ab.records import _q
from kvtier.ab.stats import (
    Interval,
    at_least,
    at_most,
    bootstrap_quantiles,
    first_bucket_bound,
    histogram_quantile,
    histogram_quantile_resolved,
    median_ci,
    nearest_rank,
    paired_ratios,
    quantile_ci,
    quantile_ratio_ci,
    ratio_ci,
    verdict,
)


def test_median_interval_of_a_known_normal() -> None:
    xs = np.random.default_rng(1).normal(10.0, 1.0, 400).tolist()
    iv = median_ci(xs)
    assert iv.n == 400 and iv.lo < 10.0 < iv.hi
    # standard error of the median: 1.2533 * sigma / sqrt(n) = 0.063; 95% ~ ±0.12
    assert 0.12 < iv.hi - iv.lo < 0.4
    assert iv.lo <= iv.point <= iv.hi


def test_intervals_cover_the_true_median_about_95_percent_of_the_time() -> None:
    rng = np.random.default_rng(7)
    true_median = math.exp(0.0)  # lognormal(0, 1)
    covered = 0
    trials = 200
    for k in range(trials):
        xs = rng.lognormal(0.0, 1.0, 60).tolist()
        iv = median_ci(xs, seed=k, n_boot=1000)
        covered += iv.lo <= true_median <= iv.hi
    assert 0.88 <= covered / trials <= 0.995


def test_same_data_same_interval_and_point_is_the_nearest_rank() -> None:
    xs = [0.31, 0.12, 0.55, 0.47, 0.2, 0.9, 0.33]
    assert quantile_ci(xs, 0.9) == quantile_ci(list(xs), 0.9)
    for q in (0.5, 0.9, 0.99):
        assert quantile_ci(xs, q).point == nearest_rank(xs, q) == _q(xs, q)


def test_too_few_values_resolve_nothing() -> None:
    iv = median_ci([1.0, 2.0])
    assert iv.point in (1.0, 2.0) and not iv.defined
    assert verdict(iv) == "not resolved" and at_most(iv, 10.0) is None
    assert not median_ci([]).defined and math.isnan(median_ci([]).point)


def test_paired_ratios_pair_by_key_only() -> None:
    a = {("c", 0): 2.0, ("c", 1): 3.0, ("d", 0): 1.0}
    b = {("c", 0): 1.0, ("c", 1): 0.0, ("e", 0): 5.0}
    assert paired_ratios(a, b) == [2.0]  # (c,1) divides by zero, (d,0) has no partner


def _pairs(factor: float, noise: float, n: int, seed: int) -> tuple[dict, dict]:
    rng = np.random.default_rng(seed)
    base = rng.lognormal(0.0, 0.8, n)  # turns differ a lot; the pairing removes that
    a = {i: float(base[i] * factor * rng.lognormal(0.0, noise)) for i in range(n)}
    b = {i: float(base[i] * rng.lognormal(0.0, noise)) for i in range(n)}
    return a, b


def test_a_resolved_difference_is_faster_or_slower() -> None:
    a, b = _pairs(0.8, 0.05, 30, seed=3)
    iv = ratio_ci(paired_ratios(a, b))
    assert iv.hi < 1.0 and verdict(iv) == "faster"
    assert 0.7 < iv.point < 0.9
    iv = ratio_ci(paired_ratios(b, a))
    assert iv.lo > 1.0 and verdict(iv) == "slower"


def test_an_unresolved_difference_stays_unresolved() -> None:
    # 5% apart with 20% per-turn noise and 12 turns: the interval straddles 1
    a, b = _pairs(0.95, 0.2, 12, seed=5)
    iv = ratio_ci(paired_ratios(a, b))
    assert iv.lo < 1.0 < iv.hi
    assert verdict(iv) == "not resolved"
    assert at_most(iv, 1.05) is None


def test_unpaired_quantile_ratio() -> None:
    rng = np.random.default_rng(11)
    slow = rng.lognormal(0.0, 0.5, 200).tolist()
    fast = (rng.lognormal(0.0, 0.5, 200) / 2.0).tolist()
    iv = quantile_ratio_ci(fast, slow, 0.9)
    assert iv.lo < 0.5 < iv.hi and verdict(iv) == "faster"
    assert verdict(quantile_ratio_ci(slow, fast, 0.9)) == "slower"


def test_bounds_and_higher_is_better() -> None:
    iv = Interval(1.0, 0.96, 1.04, 20)
    assert at_most(iv, 1.05) is True and at_most(iv, 1.0) is None and at_most(iv, 0.9) is False
    assert at_least(iv, 0.95) is True and at_least(iv, 1.1) is False
    assert verdict(Interval(1.2, 1.1, 1.3, 9), lower_is_better=False) == "faster"
    assert Interval(0.1234, 0.1, 0.15, 9).fmt(1e3) == "123 [100, 150]"


def test_histogram_quantile_interpolates_in_the_bucket() -> None:
    # 100 observations uniform on (0, 1]: 10 per 0.1-wide bucket
    buckets = [(round(0.1 * k, 1), 10.0 * k) for k in range(1, 11)] + [(math.inf, 100.0)]
    assert histogram_quantile(buckets, 0.5) == pytest.approx(0.5)
    assert histogram_quantile(buckets, 0.9) == pytest.approx(0.9)
    assert histogram_quantile([(1.0, 0.0), (math.inf, 0.0)], 0.5) != \
        histogram_quantile([(1.0, 0.0), (math.inf, 0.0)], 0.5)  # NaN: empty
    # everything beyond the last finite bound: the bound is the best estimate
    assert histogram_quantile([(1.0, 0.0), (math.inf, 5.0)], 0.5) == 1.0


# ---------------------------------------------------------------- clustered bootstrap --
def test_resamples_hold_whole_conversations() -> None:
    """Conversation j has a low value j and a high value 1000 + j. A resample of whole
    conversations holds as many low values as high ones, so its median (nearest rank: index
    round(0.5 * (2m - 1)) = m - 1 of 2m sorted values) is always a low value; a resample of
    single turns draws more high values than low ones about half the time."""
    convs = [f"c{j}" for j in range(5) for _ in range(2)]
    xs = [float(j + 1000 * i) for j in range(5) for i in range(2)]
    reps = bootstrap_quantiles(xs, 0.5, convs, np.random.default_rng(0), 2000)
    assert np.all(reps < 1000)
    # negative control: the same values resampled turn by turn
    turns = bootstrap_quantiles(xs, 0.5, None, np.random.default_rng(0), 2000)
    assert np.mean(turns >= 1000) > 0.2


def test_a_resample_has_as_many_values_as_its_conversations_hold() -> None:
    """One conversation of 50 equal values and four of one value each: resampled turn by turn,
    the 50 always hold the median; resampled by conversation, "big" is left out of a third of
    the resamples ((4/5)^5) and the median falls to one of the small ones."""
    convs = ["big"] * 50 + ["a", "b", "c", "d"]
    xs = [5.0] * 50 + [1.0, 2.0, 3.0, 4.0]
    reps = bootstrap_quantiles(xs, 0.5, convs, np.random.default_rng(3), 2000)
    assert set(np.unique(reps)) <= set(xs)
    assert 0.25 < float(np.mean(reps < 5.0)) < 0.42
    turns = bootstrap_quantiles(xs, 0.5, None, np.random.default_rng(3), 2000)
    assert np.all(turns == 5.0)


def test_correlated_turns_give_a_wider_clustered_interval() -> None:
    """Turns of a conversation share its level (strong within-conversation correlation): the
    clustered interval is much wider than one that treats the 240 turns as independent."""
    rng = np.random.default_rng(5)
    level = rng.lognormal(0.0, 0.5, 30)
    convs = [f"c{j}" for j in range(30) for _ in range(8)]
    xs = [float(level[j] * rng.lognormal(0.0, 0.05)) for j in range(30) for _ in range(8)]
    by_conv = quantile_ci(xs, 0.5, clusters=convs)
    by_turn = quantile_ci(xs, 0.5)
    assert by_conv.point == by_turn.point and by_conv.clusters == 30 and by_turn.clusters == 0
    assert (by_conv.hi - by_conv.lo) > 1.8 * (by_turn.hi - by_turn.lo)
    # and the paired-ratio path (what the report's tables use) clusters alike
    r_conv = ratio_ci(xs, clusters=convs)
    assert (r_conv.lo, r_conv.hi) == (by_conv.lo, by_conv.hi)


def test_too_few_conversations_resolve_nothing() -> None:
    xs = [float(v) for v in range(40)]
    iv = quantile_ci(xs, 0.5, clusters=["a"] * 20 + ["b"] * 20)
    assert not iv.defined and iv.n == 40 and iv.clusters == 2
    assert iv.fmt() == "20 [n=40, 2 conv.]"
    assert verdict(iv) == "not resolved"


def test_clustered_quantile_matches_the_plain_one_when_every_value_is_a_cluster() -> None:
    xs = np.random.default_rng(2).lognormal(0.0, 1.0, 50).tolist()
    a = quantile_ci(xs, 0.9, clusters=list(range(50)))
    b = quantile_ci(xs, 0.9)
    assert (a.point, a.lo, a.hi) == (b.point, b.lo, b.hi)


# ---------------------------------------------------------------- first bucket ---------
def test_a_quantile_inside_the_first_bucket_is_not_a_number() -> None:
    """vLLM's queue-time histogram, first bucket le=0.3 s, every request in it: the linear
    estimate says 270 ms (the artefact the reports showed next to a mean of 0 ms)."""
    buckets = [(0.3, 40.0), (0.5, 40.0), (0.8, 40.0), (math.inf, 40.0)]
    assert histogram_quantile(buckets, 0.9) == pytest.approx(0.27)  # PromQL's estimate
    assert math.isnan(histogram_quantile_resolved(buckets, 0.9))
    assert first_bucket_bound(buckets, 0.9) == 0.3
    # past the first bucket the estimate stands
    later = [(0.3, 30.0), (0.5, 40.0), (math.inf, 40.0)]
    assert first_bucket_bound(later, 0.9) is None
    assert histogram_quantile_resolved(later, 0.9) == pytest.approx(histogram_quantile(later, 0.9))
    assert first_bucket_bound([(0.3, 0.0), (math.inf, 0.0)], 0.9) is None  # empty
