"""Instance choice: KV-aware, then least in-flight, then round-robin; ejection."""

from __future__ import annotations

from kvtier.ids import PodId, Role
from kvtier.router.config import InstanceConfig
from kvtier.router.pool import InstancePool


def pool(n=3) -> InstancePool:
    p = [InstanceConfig(name=PodId(f"p{i}"), url=f"http://h:{i + 1}", role=Role.PREFILL)
         for i in range(n)]
    d = [InstanceConfig(name=PodId("d0"), url="http://h:9", role=Role.DECODE)]
    return InstancePool(p, d, eject_after_failures=2)


def test_longest_cached_prefix_wins_over_load():
    pl = pool()
    pl.prefill[2].in_flight = 5
    got = pl.choose(pl.prefill, {PodId("p2"): 64, PodId("p1"): 32})
    assert got.name == "p2"


def test_least_in_flight_then_round_robin():
    pl = pool()
    pl.prefill[0].in_flight = 1
    picks = {pl.choose(pl.prefill).name for _ in range(4)}
    assert picks == {"p1", "p2"}


def test_round_robin_spreads_idle_instances():
    pl = pool()
    assert {pl.choose(pl.prefill).name for _ in range(3)} == {"p0", "p1", "p2"}


def test_ejected_and_excluded_are_skipped_and_readmitted():
    pl = pool()
    pl.mark_failed(pl.prefill[0])
    assert pl.prefill[0].healthy  # one failure is not enough
    pl.mark_failed(pl.prefill[0])
    pl.mark_failed(pl.prefill[1], hard=True)  # refused connection: at once
    assert not pl.prefill[0].healthy and not pl.prefill[1].healthy
    assert {pl.choose(pl.prefill).name for _ in range(4)} == {"p2"}
    assert pl.choose(pl.prefill, exclude={PodId("p2")}) is not None  # all down: try anyway
    assert pl.choose(pl.prefill, exclude={PodId("p0"), PodId("p1"), PodId("p2")}) is None
    pl.mark_ok(pl.prefill[0])
    assert pl.prefill[0].healthy and pl.prefill[0].failures == 0


def test_busy_counts_in_flight():
    pl = pool()
    with pl.busy(pl.decode[0]):
        assert pl.decode[0].in_flight == 1
    assert pl.decode[0].in_flight == 0
