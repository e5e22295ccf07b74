"""Fault injection for tiers, as a wrapper (STYLE rule 9), never inside the tier.

``FaultyTier`` forwards every call to an inner tier and, when a fault is
armed, makes the next matching call misbehave the way a real source does:

- ``evict_after_lookup``: the keys a lookup just found are evicted before the
  caller can pin them (source evicts between lookup and fetch);
- ``fail_next_load``: the next ``prepare_load`` returns None (pin refused).

With nothing armed it is the inner tier, and the tier contract suite runs over
it to prove that.

Threading model: same as the inner tier (caller serialises).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvtier.ids import RequestKey
from kvtier.tier.accounting import TierStats
from kvtier.tier.manager import BlockMeta, LoadJob, LookupResult, StoreJob, TierEvent, TierManager


@dataclass
class FaultyTier:
    inner: TierManager
    evict_after_lookup: bool = False
    fail_next_load: bool = False

    @property
    def slot_bytes(self) -> int:
        return self.inner.slot_bytes

    @property
    def capacity_bytes(self) -> int:
        return self.inner.capacity_bytes

    @property
    def stats(self) -> TierStats:
        return self.inner.stats

    def lookup(self, key: RequestKey) -> LookupResult:
        return self.inner.lookup(key)

    def lookup_prefix(self, keys: Sequence[RequestKey]) -> int:
        n = self.inner.lookup_prefix(keys)
        if self.evict_after_lookup and n:
            self.evict_after_lookup = False
            self.inner.evict(keys[:n])
        return n

    def prepare_store(self, keys: Sequence[RequestKey],
                      metas: Sequence[BlockMeta] | None = None) -> StoreJob | None:
        return self.inner.prepare_store(keys, metas)

    def complete_store(self, job_id: int, success: bool) -> None:
        self.inner.complete_store(job_id, success)

    def prepare_load(self, keys: Sequence[RequestKey]) -> LoadJob | None:
        if self.fail_next_load:
            self.fail_next_load = False
            return None
        return self.inner.prepare_load(keys)

    def complete_load(self, job_id: int, success: bool, path: str = "load") -> None:
        self.inner.complete_load(job_id, success, path)

    def expire_leases(self, now: float | None = None) -> list[int]:
        return self.inner.expire_leases(now)

    def evict(self, keys: Iterable[RequestKey]) -> int:
        return self.inner.evict(keys)

    def slot_of(self, key: RequestKey) -> int | None:
        return self.inner.slot_of(key)

    def clear(self) -> None:
        self.inner.clear()

    def take_events(self) -> list[TierEvent]:
        return self.inner.take_events()
