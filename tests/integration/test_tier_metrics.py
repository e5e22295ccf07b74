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
