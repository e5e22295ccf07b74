"""The tier contract: one suite, run over every tier implementation."""

from __future__ import annotations

import pytest

from kvtier.ids import RequestKey
from kvtier.tier.faults import FaultyTier
from kvtier.tier.manager import BlockMeta, HostTier, LookupResult, TierEventKind

SLOT = 1024


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _host(n, clock):
    return HostTier(n, SLOT, lease_s=5.0, clock=clock)


def _faulty(n, clock):
    return FaultyTier(HostTier(n, SLOT, lease_s=5.0, clock=clock))


IMPLS = {"host": _host, "faulty-unarmed": _faulty}


@pytest.fixture(params=sorted(IMPLS))
def make(request):
    clock = FakeClock()

    def build(n):
        return IMPLS[request.param](n, clock)

    build.clock = clock
    return build


def K(*xs):
    return [RequestKey(x) for x in xs]


def store(t, keys):
    job = t.prepare_store(keys)
    assert job is not None
    t.complete_store(job.job_id, True)
    return job


def test_empty_tier_misses(make):
    t = make(4)
    assert t.lookup(RequestKey(1)) is LookupResult.MISS
    assert t.lookup_prefix(K(1, 2)) == 0
    assert t.prepare_load(K(1)) is None
    assert t.capacity_bytes == 4 * SLOT


def test_two_phase_store_pending_then_hit(make):
    t = make(4)
    job = t.prepare_store(K(1, 2))
    assert len(set(job.slots)) == 2
    assert t.lookup(RequestKey(1)) is LookupResult.HIT_PENDING
    assert t.prepare_load(K(1)) is None  # not loadable while pending
    t.complete_store(job.job_id, True)
    assert t.lookup(RequestKey(1)) is LookupResult.HIT
    assert t.lookup_prefix(K(1, 2, 3)) == 2
    assert t.slot_of(RequestKey(2)) == job.slots[1]


def test_failed_store_frees_slots(make):
    t = make(2)
    job = t.prepare_store(K(1, 2))
    t.complete_store(job.job_id, False)
    assert t.lookup(RequestKey(1)) is LookupResult.MISS
    store(t, K(3, 4))  # both slots usable again


def test_store_skips_present_blocks(make):
    t = make(4)
    store(t, K(1, 2))
    job = t.prepare_store(K(1, 2, 3))
    assert job.keys == tuple(K(3)) and job.skipped == tuple(K(1, 2))
    t.complete_store(job.job_id, True)
    again = t.prepare_store(K(1, 2, 3))
    assert again is not None and again.keys == () and len(again.skipped) == 3
    t.complete_store(again.job_id, True)  # empty job completes harmlessly
    assert t.stats.stores_skipped == 5


def test_lru_eviction_order_and_events(make):
    t = make(2)
    store(t, K(1))
    store(t, K(2))
    assert t.lookup_prefix(K(1)) == 1  # touch 1: 2 is now LRU
    store(t, K(3))
    assert t.lookup(RequestKey(2)) is LookupResult.MISS
    assert t.lookup(RequestKey(1)) is LookupResult.HIT
    kinds = [(e.kind, e.keys) for e in t.take_events()]
    assert (TierEventKind.REMOVED, (RequestKey(2),)) in kinds
    assert kinds[-1] == (TierEventKind.STORED, (RequestKey(3),))
    assert t.take_events() == []


def test_pinned_slot_survives_eviction_until_unpin(make):
    t = make(1)
    first = store(t, K(1))
    load = t.prepare_load(K(1))
    assert load.slots == first.slots
    # The only slot is pinned: it is evicted from the index but not reusable.
    assert t.prepare_store(K(2)) is None
    assert t.lookup(RequestKey(1)) is LookupResult.MISS
    t.complete_load(load.job_id, True)
    job = t.prepare_store(K(2))
    assert job is not None and job.slots == first.slots


def test_full_tier_of_pending_returns_none(make):
    t = make(2)
    t.prepare_store(K(1, 2))
    assert t.prepare_store(K(3)) is None
    assert t.stats.stores_refused == 1


def test_partial_store_keeps_prefix(make):
    t = make(2)
    job = t.prepare_store(K(1, 2, 3))
    assert job.keys == tuple(K(1, 2))


def test_lease_expiry_unpins(make):
    t = make(1)
    store(t, K(1))
    load = t.prepare_load(K(1))
    t.evict(K(1))
    assert t.prepare_store(K(2)) is None  # slot still pinned
    make.clock.t += 10
    assert t.expire_leases() == [load.job_id]
    assert t.prepare_store(K(2)) is not None


def test_accounting(make):
    t = make(4)
    store(t, K(1, 2))
    make.clock.t += 10
    snap = t.stats.snapshot()
    assert snap["blocks_held"] == 2 and snap["bytes_held"] == 2 * SLOT
    assert snap["block_seconds_held"] == pytest.approx(20.0)
    load = t.prepare_load(K(1, 2))
    t.complete_load(load.job_id, True, path="peer_out")
    t.lookup_prefix(K(1, 9))
    snap = t.stats.snapshot()
    assert snap["bytes_moved"]["store"] == 2 * SLOT
    assert snap["bytes_moved"]["peer_out"] == 2 * SLOT
    assert snap["hits"] == 1 and snap["misses"] == 1


def test_clear_and_metadata_in_events(make):
    t = make(4)
    meta = BlockMeta(token_ids=(1, 2, 3), engine_hash=None)
    job = t.prepare_store(K(7), [meta])
    t.complete_store(job.job_id, True)
    ev = t.take_events()
    assert ev[0].metas == (meta,)
    t.clear()
    assert t.lookup(RequestKey(7)) is LookupResult.MISS
    assert t.take_events()[-1].kind is TierEventKind.CLEARED
    assert t.stats.blocks_held == 0


def test_complete_is_idempotent(make):
    t = make(2)
    job = store(t, K(1))
    t.complete_store(job.job_id, True)
    load = t.prepare_load(K(1))
    t.complete_load(load.job_id, True)
    t.complete_load(load.job_id, True)
    assert t.prepare_store(K(2)) is not None
    assert t.lookup(RequestKey(1)) is LookupResult.HIT
