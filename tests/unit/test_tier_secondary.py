"""kvtier's peer fetch as a secondary tier (kvtier.tier.secondary.PeerTier): two tiers, real
NIXL over DRAM and the peer protocol, rows standing in for vLLM's CPU tier."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvtier.ids import RequestKey
from kvtier.runtime import free_ports
from kvtier.tier.secondary import Found, PeerTier, PeerTierConfig
from kvtier.transfer_params import RemoteKVSource

pytest.importorskip("nixl")

ROW = 4096
BS = 16


def _tier(rows: np.ndarray, port: int | None, delta: int = 1) -> PeerTier:
    return PeerTier(rows, PeerTierConfig(capacity_bytes=64 * ROW, block_size=BS, model="m",
                                         hash_label=0, port=port, min_cached_token_delta=delta))


def _wait(t: PeerTier) -> None:
    deadline = time.monotonic() + 20
    while t.pending and time.monotonic() < deadline:
        time.sleep(0.01)


@pytest.fixture
def pair():
    rng = np.random.default_rng(0)
    a_rows = rng.integers(0, 255, size=(32, ROW), dtype=np.uint8)
    b_rows = np.zeros((32, ROW), dtype=np.uint8)
    port = free_ports(1)[0]
    a, b = _tier(a_rows, port), _tier(b_rows, None)
    yield a, b, port
    a.close()
    b.close()


KEYS = [RequestKey(1000 + i) for i in range(8)]


def _store_in_a(a: PeerTier) -> None:
    a.store(1, KEYS, list(range(8)))
    a.drain()
    assert a.finished_jobs() == [(1, True)]


def test_pull_from_a_peer_then_promote(pair) -> None:
    a, b, port = pair
    _store_in_a(a)
    src = RemoteKVSource(pod="a", host="127.0.0.1", port=port, num_tokens=8 * BS)
    # Every key the scan sees is RETRY until the step ends and the pull ran.
    assert [b.lookup("r1", k, src) for k in KEYS] == [Found.RETRY] * 8
    b.schedule_end()
    _wait(b)
    assert [b.lookup("r1", k, src) for k in KEYS] == [Found.HIT] * 8
    b.load(7, KEYS, [10 + i for i in range(8)])
    b.drain()
    assert b.finished_jobs() == [(7, True)]
    assert np.array_equal(b.rows[10:18], a.rows[0:8])


def test_no_source_is_a_miss(pair) -> None:
    a, b, _ = pair
    _store_in_a(a)
    assert b.lookup("r1", KEYS[0], None) is Found.MISS


def test_a_gain_under_the_delta_is_not_pulled() -> None:
    rng = np.random.default_rng(1)
    port = free_ports(1)[0]
    a = _tier(rng.integers(0, 255, size=(32, ROW), dtype=np.uint8), port)
    b = _tier(np.zeros((32, ROW), dtype=np.uint8), None, delta=9 * BS)
    try:
        _store_in_a(a)
        src = RemoteKVSource(pod="a", host="127.0.0.1", port=port, num_tokens=8 * BS)
        for k in KEYS:
            b.lookup("r1", k, src)
        b.schedule_end()
        _wait(b)
        assert b.lookup("r1", KEYS[0], src) is Found.MISS
        assert len(b.tier) == 0
    finally:
        a.close()
        b.close()


def test_a_dead_peer_falls_back_to_miss(pair) -> None:
    _, b, _ = pair
    src = RemoteKVSource(pod="gone", host="127.0.0.1", port=free_ports(1)[0], num_tokens=8 * BS)
    b.cfg = PeerTierConfig(capacity_bytes=64 * ROW, block_size=BS, model="m", hash_label=0,
                           peer_timeout_s=0.5)
    b.client.timeout_s = 0.5
    for k in KEYS:
        b.lookup("r1", k, src)
    b.schedule_end()
    _wait(b)
    assert b.lookup("r1", KEYS[0], src) is Found.MISS


def test_a_peer_that_hashes_differently_is_refused(pair) -> None:
    a, _, port = pair
    _store_in_a(a)
    c = PeerTier(np.zeros((32, ROW), dtype=np.uint8),
                 PeerTierConfig(capacity_bytes=64 * ROW, block_size=BS, model="m",
                                hash_label=42))
    try:
        src = RemoteKVSource(pod="a", host="127.0.0.1", port=port, num_tokens=8 * BS)
        for k in KEYS:
            c.lookup("r1", k, src)
        c.schedule_end()
        _wait(c)
        assert c.lookup("r1", KEYS[0], src) is Found.MISS
        assert c.tier.stats.snapshot()["peer_fallbacks"].get("refused") == 1
    finally:
        c.close()


def test_loading_a_key_it_does_not_hold_fails_the_job(pair) -> None:
    _, b, _ = pair
    b.load(3, [RequestKey(5)], [0])
    b.drain()
    assert b.finished_jobs() == [(3, False)]
