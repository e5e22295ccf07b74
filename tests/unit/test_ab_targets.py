"""The A/B targets evaluated from records (kvtier.ab.targets): verdicts follow the numbers."""

from __future__ import annotations

from kvtier.ab.records import MemorySample, RunResult, TurnRecord
from kvtier.ab.targets import evaluate, markdown


def _run(name, ttfts, reused, blocks):
    turns = [TurnRecord(name, "c", i, 1000 * (i + 1), reused if i else 0, "p2p" if i else "none",
                        1000 * (i + 1) - (reused if i else 0), t, t + 1, 0.0, 10.0 * i)
             for i, t in enumerate(ttfts)]
    mem = [MemorySample(name, 0.0, blocks, 0)]
    return RunResult(name, turns, mem, {"t_end": 10.0})


def test_all_met_and_all_missed():
    rc = _run("recompute", [1, 2, 10], 0, 0)
    dt = _run("device-ttl", [1, 1.0, 1.5], 800, 100)
    good = _run("tiered-adaptive", [1, 1.0, 1.5], 800, 10)
    got = {t.name: t.met for t in evaluate([rc, dt, good])}
    assert got == {"speedup at the longest context": True,
                   "within 5% of the best single strategy": True,
                   "device memory vs device-ttl": True}
    bad = _run("tiered-adaptive", [3, 3.0, 3.0], 100, 80)
    got = {t.name: t.met for t in evaluate([rc, dt, bad])}
    assert set(got.values()) == {False}
    assert "**missed**" in markdown(evaluate([rc, dt, bad]))


def test_missing_strategies_are_not_evaluated():
    only = _run("tiered-adaptive", [1, 1.0], 500, 1)
    assert all(t.met is None for t in evaluate([only]))
