"""The A/B targets evaluated from records (kvtier.ab.targets): verdicts come from intervals."""

from __future__ import annotations

import zlib

import numpy as np

from kvtier.ab.records import MemorySample, RunResult, TurnRecord, merge_repeats
from kvtier.ab.stats import Interval
from kvtier.ab.targets import evaluate, markdown, median_target, not_lower, not_worse


def _run(name: str, ttft_of, reused: int, blocks: int, seed: int, t_end: float = 60.0,
         noise: float = 0.02) -> RunResult:
    """2 conversations x 6 turns; turn i has 1000*(i+1) prompt tokens and TTFT ttft_of(i)
    times a little noise."""
    rng = np.random.default_rng(seed)
    turns = []
    for c in range(2):
        for i in range(6):
            t = ttft_of(i) * float(rng.lognormal(0.0, noise))
            r = reused if i else 0
            turns.append(TurnRecord(name, f"c{c}", i, 1000 * (i + 1), r,
                                    "p2p" if r else "none", 1000 * (i + 1) - r, t, t + 1, 0.0,
                                    5.0 * i + c))
    mem = [MemorySample(name, 0.0, blocks, 0)]
    return RunResult(name, turns, mem, {"t_end": t_end})


def _repeated(name: str, ttft_of, reused: int, blocks: int, n: int = 4, **kw) -> RunResult:
    return merge_repeats([_run(name, ttft_of, reused, blocks, seed=zlib.crc32(name.encode()) % 1000 + k, **kw)
                          for k in range(n)])


def _status(results: list[RunResult]) -> dict[str, str]:
    return {t.name: t.status for t in evaluate(results)}


def test_all_met() -> None:
    rc = _repeated("recompute", lambda i: 0.5 * (i + 1) ** 2, 0, 0)
    dt = _repeated("device-ttl", lambda i: 0.3, 800, 100)
    ad = _repeated("tiered-adaptive", lambda i: 0.28, 800, 10)
    assert _status([rc, dt, ad]) == {
        "speedup at the longest context": "met",
        "within 5% of the best single strategy": "met",
        "TTFT p90 vs the best single strategy": "met",
        "turns per minute vs the best single strategy": "met",
        "device memory vs device-ttl": "met",
        "device memory ≤ 50% of device-ttl's": "met",
        "beats every fixed strategy": "met"}


def test_all_missed() -> None:
    rc = _repeated("recompute", lambda i: 0.5 * (i + 1), 0, 0)
    dt = _repeated("device-ttl", lambda i: 0.3, 800, 100)
    bad = _repeated("tiered-adaptive", lambda i: 1.0, 100, 80, t_end=120.0)
    assert set(_status([rc, dt, bad]).values()) == {"missed"}
    assert "**missed**" in markdown(evaluate([rc, dt, bad]))


def test_identical_deployments_do_not_resolve_5_percent() -> None:
    """The situation of the small-deltas pair run: the same deployment twice, 20% turn noise."""
    hp = _repeated("host-p2p", lambda i: 0.1, 500, 0, noise=0.2)
    ad = _repeated("tiered-adaptive", lambda i: 0.1, 500, 0, noise=0.2)
    got = _status([hp, ad])
    assert got["within 5% of the best single strategy"] == "not resolved"
    assert got["TTFT p90 vs the best single strategy"] == "not resolved"
    t = {t.name: t for t in evaluate([hp, ad])}["within 5% of the best single strategy"]
    assert t.met is None and t.interval is not None
    assert t.interval["lo"] < 1.05 < t.interval["hi"]


def test_one_run_cannot_resolve_per_repeat_targets() -> None:
    dt = _run("device-ttl", lambda i: 0.3, 800, 100, seed=1)
    ad = _run("tiered-adaptive", lambda i: 0.3, 800, 0, seed=2)
    got = _status([dt, ad])
    assert got["device memory vs device-ttl"] == "not resolved"
    assert got["turns per minute vs the best single strategy"] == "not resolved"


def test_missing_strategies_are_not_evaluated() -> None:
    only = _run("tiered-adaptive", lambda i: 1.0, 500, 1, seed=0)
    assert all(t.status == "not evaluated" and t.met is None for t in evaluate([only]))


# ---------------------------------------------------------------- no tolerance ---------
def test_an_interval_wholly_below_one_is_lower_not_met() -> None:
    """host-scarce's turns/min, 0.982 [0.978, 0.999], printed "met" under a 5% tolerance."""
    iv = Interval(0.982, 0.978, 0.999, 5)
    assert not_lower(iv) is False
    assert not_lower(Interval(0.99, 0.95, 1.0, 5)) is True   # touches 1.0: not wholly below
    assert not_lower(Interval(0.99, 0.95, 1.02, 5)) is True
    assert not_lower(Interval(1.0, float("nan"), float("nan"), 1)) is None


def test_not_worse_means_the_upper_bound_is_at_most_one() -> None:
    assert not_worse(Interval(1.03, 1.01, 1.04, 50)) is False        # was "met" (≤ 1.05)
    assert not_worse(Interval(1.0, 0.97, 1.03, 50)) is None          # was "met"
    assert not_worse(Interval(0.98, 0.95, 1.0, 50)) is True
    assert not_worse(Interval(0.98, 0.95, 0.999, 50)) is True


def test_median_target_is_the_issue_s_bound_and_point() -> None:
    assert median_target(Interval(0.99, 0.95, 1.04, 50)) is True
    assert median_target(Interval(1.02, 0.99, 1.04, 50)) is None     # point above 1.0
    assert median_target(Interval(1.02, 1.01, 1.04, 50)) is False    # wholly slower than the best
    assert median_target(Interval(0.99, 0.95, 1.06, 50)) is None     # upper bound above 1.05


def test_throughput_2_percent_lower_in_every_repeat_is_missed() -> None:
    best = _repeated("host-p2p", lambda i: 0.3, 800, 0)
    ad = _repeated("tiered-adaptive", lambda i: 0.3, 800, 0, t_end=61.1)  # 0.982x turns/min
    t = {t.name: t for t in evaluate([best, ad])}["turns per minute vs the best single strategy"]
    assert t.status == "missed" and "(lower)" in t.value
    assert t.interval is not None and t.interval["hi"] < 1.0


def test_reuse_3_percent_lower_in_every_repeat_misses_the_memory_share() -> None:
    dt = _repeated("device-ttl", lambda i: 0.3, 800, 100)
    ad = _repeated("tiered-adaptive", lambda i: 0.3, 776, 10)  # 97% of device-ttl's reuse
    got = _status([dt, ad])
    assert got["device memory vs device-ttl"] == "met"
    assert got["device memory ≤ 50% of device-ttl's"] == "missed"


def test_p90_3_percent_slower_is_missed_not_met() -> None:
    best = _repeated("host-p2p", lambda i: 0.3, 800, 0, noise=0.001)
    ad = _repeated("tiered-adaptive", lambda i: 0.309, 800, 0, noise=0.001)
    got = _status([best, ad])
    assert got["TTFT p90 vs the best single strategy"] == "missed"
    assert got["within 5% of the best single strategy"] == "missed"


def test_a_run_whose_fixed_strategy_failed_does_not_judge_against_the_rest() -> None:
    """A host-scarce run lost device-ttl (the best fixed strategy of the run before); judged
    against the best of those left, tiered-adaptive's median read "met". With a fixed strategy
    failed, the best single strategy is unknown: those targets are not evaluated."""
    rc = _repeated("recompute", lambda i: 0.5 * (i + 1) ** 2, 0, 0)
    ad = _repeated("tiered-adaptive", lambda i: 0.28, 800, 10)
    assert _status([rc, ad])["within 5% of the best single strategy"] == "met"
    out = {t.name: t for t in evaluate([rc, ad], failed=["device-ttl"])}
    for name in ("within 5% of the best single strategy", "TTFT p90 vs the best single strategy",
                 "turns per minute vs the best single strategy"):
        assert out[name].status == "not evaluated"
        assert "device-ttl failed" in out[name].value
    # tiered-adaptive itself failing leaves nothing to judge: its targets say so already
    assert evaluate([rc], failed=["tiered-adaptive"])[1].status == "not evaluated"


def test_beats_every_fixed_strategy_on_either_metric() -> None:
    """Issue 30's third "Done when": against each fixed strategy, TTFT wholly lower or turns/min
    wholly higher; the closest fixed strategy decides and is named."""
    name = "beats every fixed strategy"
    rc = _repeated("recompute", lambda i: 0.5 * (i + 1), 0, 0)
    dt = _repeated("device-ttl", lambda i: 0.3, 800, 100)
    # faster than both on TTFT, same turns/min: met by TTFT
    fast = _repeated("tiered-adaptive", lambda i: 0.25, 800, 10)
    t = {t.name: t for t in evaluate([rc, dt, fast])}[name]
    assert t.status == "met" and "of device-ttl" in t.value and "closest of 2 fixed" in t.value
    # as fast as device-ttl but more turns per minute than both: met by turns/min
    busy = _repeated("tiered-adaptive", lambda i: 0.3, 800, 10, t_end=50.0)
    t = {t.name: t for t in evaluate([rc, dt, busy])}[name]
    assert t.status == "met" and "turns/min 1.200" in t.value, t.value
    # as fast as device-ttl, same turns/min: neither metric decides
    tie = _repeated("tiered-adaptive", lambda i: 0.3, 800, 10)
    assert {t.name: t for t in evaluate([rc, dt, tie])}[name].status == "not resolved"
    # slower than device-ttl and fewer turns per minute: missed
    slow = _repeated("tiered-adaptive", lambda i: 0.4, 800, 10, t_end=80.0)
    assert {t.name: t for t in evaluate([rc, dt, slow])}[name].status == "missed"
    # two repeats: turns/min cannot decide, and a slower TTFT alone is not a miss
    two = _repeated("tiered-adaptive", lambda i: 0.4, 800, 10, n=2, t_end=80.0)
    t = {t.name: t for t in evaluate([_repeated("device-ttl", lambda i: 0.3, 800, 100, n=2),
                                      two])}[name]
    assert t.status == "not resolved" and "not decidable" in t.value, t
