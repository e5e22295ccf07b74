"""The A/B targets evaluated from records (kvtier.ab.targets): verdicts come from intervals."""

from __future__ import annotations

import zlib

import numpy as np

from kvtier.ab.records import MemorySample, RunResult, TurnRecord, merge_repeats
from kvtier.ab.targets import evaluate, markdown


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
        "device memory vs device-ttl": "met"}


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
