"""The tier's Prometheus endpoint over real HTTP: values read at scrape time."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from kvtier.ab.live.scrape import metric
from kvtier.ids import RequestKey
from kvtier.runtime import free_ports
from kvtier.tier.manager import HostTier
from kvtier.tier.metrics import TierCollector, TierMetricsServer

pytestmark = pytest.mark.integration
SLOT = 1024


class Clock:
    t = 100.0

    def __call__(self) -> float:
        return self.t


def scrape(url: str) -> str:
    return httpx.get(url, timeout=10).text


def val(page: str, name: str, **labels: str) -> float:
    """The sample of this pod and model with ``labels``; KeyError when it is not exposed."""
    return metric(page, name, {"pod": "prefill-0", "model": "tiny", **labels}, required=True)


Served = tuple[HostTier, Clock, TierMetricsServer]


@pytest.fixture
def served() -> Iterator[Served]:
    clock = Clock()
    tier = HostTier(8, SLOT, clock=clock)
    server = TierMetricsServer(
        TierCollector(tier.stats.snapshot, SLOT, tier.capacity_bytes, "prefill-0", "tiny"),
        free_ports(1)[0])
    yield tier, clock, server
    server.close()


def test_retention_and_traffic_are_exposed(served: Served) -> None:
    tier, clock, server = served
    keys = [RequestKey(i) for i in range(1, 5)]
    job = tier.prepare_store(keys)
    assert job is not None
    tier.complete_store(job.job_id, True)
    s = scrape(server.url)
    assert val(s, "kvtier_tier_blocks_held") == 4
    assert val(s, "kvtier_tier_bytes_held") == 4 * SLOT
    assert val(s, "kvtier_tier_capacity_bytes") == 8 * SLOT
    assert val(s, "kvtier_tier_bytes_moved_total", path="store") == 4 * SLOT
    assert val(s, "kvtier_tier_byte_seconds_held_total") == 0

    clock.t += 10  # held 4 blocks for 10 s: read at scrape time, no sampler thread
    s = scrape(server.url)
    assert val(s, "kvtier_tier_block_seconds_held_total") == pytest.approx(40)
    assert val(s, "kvtier_tier_byte_seconds_held_total") == pytest.approx(40 * SLOT)

    assert tier.lookup_prefix(keys[:2] + [RequestKey(99)]) == 2
    load = tier.prepare_load(keys[:2])
    assert load is not None
    tier.complete_load(load.job_id, True)
    tier.evict(keys[3:])
    tier.stats.record_fallback("unreachable")
    clock.t += 5
    s = scrape(server.url)
    assert val(s, "kvtier_tier_hit_blocks_total") == 2
    assert val(s, "kvtier_tier_miss_lookups_total") == 1
    assert val(s, "kvtier_tier_bytes_moved_total", path="load") == 2 * SLOT
    assert val(s, "kvtier_tier_bytes_moved_total", path="peer_in") == 0
    assert val(s, "kvtier_tier_evictions_total") == 1
    assert val(s, "kvtier_tier_blocks_held") == 3
    assert val(s, "kvtier_tier_peer_fallbacks_total", reason="unreachable") == 1
    assert val(s, "kvtier_tier_block_seconds_held_total") == pytest.approx(40 + 15)

    assert val(s, "kvtier_tier_peer_fetches_total") == 0
    tier.stats.record_peer_fetch({"hold": 0.002, "read": 0.010, "release": 0.0001})
    tier.stats.record_peer_fetch({"handshake": 0.5, "hold": 0.004})
    s = scrape(server.url)
    assert val(s, "kvtier_tier_peer_fetches_total") == 2
    assert val(s, "kvtier_tier_peer_fetch_seconds_total", phase="handshake") == 0.5
    assert val(s, "kvtier_tier_peer_fetch_seconds_total", phase="hold") == pytest.approx(0.006)
    assert val(s, "kvtier_tier_peer_fetch_seconds_total", phase="read") == 0.010
    assert val(s, "kvtier_tier_peer_fetch_seconds_total", phase="release") == 0.0001
    with pytest.raises(ValueError, match="unknown peer fetch phases"):
        tier.stats.record_peer_fetch({"lunch": 1.0})


def test_close_frees_the_port(served: Served) -> None:
    import socket

    _, _, server = served
    port = server.server.server_port
    server.close()
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", port))  # would raise EADDRINUSE if the server still listened
    finally:
        s.close()
    server.close()  # idempotent: the fixture closes again


def test_the_ab_runner_reads_peer_fetches_from_each_tier_page(served: Served) -> None:
    import httpx

    from kvtier.ab.live.runner import peer_fetches

    tier, _, server = served
    tier.stats.record_peer_fetch({"hold": 0.002, "read": 0.010, "release": 0.0001})
    base = server.url.removesuffix("/metrics")
    with httpx.Client() as c:
        got = peer_fetches(c, [("prefill-0", base), ("gone", "http://127.0.0.1:9")])
    assert set(got) == {"prefill-0"}  # an unreadable page is left out, not zero
    assert got["prefill-0"] == pytest.approx({"fetches": 1, "handshake": 0.0, "hold": 0.002,
                                              "read": 0.010, "release": 0.0001})
