"""The host tier's manager: which RequestKey lives in which slot, LRU, pins.

Roles (after vLLM's offloading Spec/Manager/Worker split):

- ``HostPool`` (kvtier.tier.pool): the bytes. Knows nothing about keys.
- ``HostTier`` (this module): the Manager. Bookkeeping only, no I/O: maps
  ``RequestKey`` -> slot, keeps LRU order (cachetools), byte capacity,
  refcount pins, and hands out slot numbers in two-phase jobs. Whoever moves
  the bytes (the connector's worker half, or a peer's NIXL READ) reports back
  with ``complete_*``.
- ``StoreJob`` / ``LoadJob``: the opaque handles that travel between them.

Entry states::

    prepare_store -> PENDING --complete_store(True)--> READY --evict--> gone
                        \\--complete_store(False)--> gone
    READY --prepare_load--> READY, pinned (refcount) --complete_load--> unpinned

A READY entry chosen for eviction while pinned leaves the index at once (it
is no longer found, a BlockRemoved event is emitted) but its slot is freed
only when the last pin is released, so a transfer in flight never reads a
slot that is being overwritten. Pins are leases: ``expire_leases(now)``
fails load jobs older than ``lease_s`` (a peer that died never confirms).

Outcomes are values: lookups return ``LookupResult``; ``prepare_store`` returns
None when the tier has no free or evictable slot; ``prepare_load`` returns
None when a key is not READY.

Threading model: single-threaded. The caller (the connector's scheduler half,
or the peer server, which share one lock) serialises every call.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

from cachetools import LRUCache

from kvtier.ids import EngineBlockHash, RequestKey
from kvtier.tier.accounting import TierStats


class LookupResult(str, Enum):
    MISS = "miss"
    HIT = "hit"
    HIT_PENDING = "hit_pending"  # being stored; not loadable yet


@dataclass(frozen=True)
class BlockMeta:
    """What the tier remembers about a block besides its key (for events)."""

    token_ids: tuple[int, ...] = ()
    engine_hash: EngineBlockHash | None = None
    parent_key: RequestKey | None = None
    parent_engine_hash: EngineBlockHash | None = None


@dataclass
class _Entry:
    key: RequestKey
    slot: int
    meta: BlockMeta
    pins: int = 0
    evicted: bool = False


@dataclass(frozen=True)
class StoreJob:
    job_id: int
    keys: tuple[RequestKey, ...]
    slots: tuple[int, ...]
    skipped: tuple[RequestKey, ...] = ()  # already present (READY or PENDING)


@dataclass(frozen=True)
class LoadJob:
    job_id: int
    keys: tuple[RequestKey, ...]
    slots: tuple[int, ...]
    deadline: float = 0.0


class TierEventKind(str, Enum):
    STORED = "stored"
    REMOVED = "removed"
    CLEARED = "cleared"


@dataclass(frozen=True)
class TierEvent:
    kind: TierEventKind
    keys: tuple[RequestKey, ...] = ()
    metas: tuple[BlockMeta, ...] = ()


class TierManager(Protocol):
    """The interface every tier manager implements (see tests/unit/test_tier_contract.py)."""

    @property
    def slot_bytes(self) -> int: ...
    @property
    def capacity_bytes(self) -> int: ...
    @property
    def stats(self) -> TierStats: ...
    def lookup(self, key: RequestKey) -> LookupResult: ...
    def lookup_prefix(self, keys: Sequence[RequestKey]) -> int: ...
    def prepare_store(self, keys: Sequence[RequestKey],
                      metas: Sequence[BlockMeta] | None = None) -> StoreJob | None: ...
    def complete_store(self, job_id: int, success: bool) -> None: ...
    def prepare_load(self, keys: Sequence[RequestKey]) -> LoadJob | None: ...
    def complete_load(self, job_id: int, success: bool, path: str = "load") -> None: ...
    def expire_leases(self, now: float | None = None) -> list[int]: ...
    def slot_of(self, key: RequestKey) -> int | None: ...
    def evict(self, keys: Iterable[RequestKey]) -> int: ...
    def clear(self) -> None: ...
    def take_events(self) -> list[TierEvent]: ...


@dataclass
class HostTier:
    """LRU host tier over ``num_slots`` slots of ``slot_bytes`` each."""

    num_slots: int
    slot_bytes_: int
    lease_s: float = 30.0
    clock: Callable[[], float] = time.monotonic
    _ready: LRUCache = field(init=False, repr=False)
    _pending: dict[RequestKey, _Entry] = field(init=False, default_factory=dict)
    _free: list[int] = field(init=False, default_factory=list)
    _store_jobs: dict[int, list[_Entry]] = field(init=False, default_factory=dict)
    _load_jobs: dict[int, tuple[LoadJob, list[_Entry]]] = field(init=False, default_factory=dict)
    _events: list[TierEvent] = field(init=False, default_factory=list)
    _ids: itertools.count = field(init=False, default_factory=lambda: itertools.count(1))
    _stats: TierStats = field(init=False)

    def __post_init__(self) -> None:
        if self.num_slots <= 0:
            raise ValueError(f"num_slots must be positive, got {self.num_slots}")
        # maxsize = num_slots: the cache never evicts on its own; the tier
        # evicts explicitly so it can honour pins.
        self._ready = LRUCache(maxsize=self.num_slots)
        self._free = list(range(self.num_slots - 1, -1, -1))
        self._stats = TierStats(self.slot_bytes_, clock=self.clock)

    @classmethod
    def with_capacity(cls, capacity_bytes: int, slot_bytes: int, **kw: Any) -> HostTier:
        n = capacity_bytes // slot_bytes
        if n <= 0:
            raise ValueError(
                f"capacity {capacity_bytes} B holds no block of {slot_bytes} B; raise cpu_bytes_to_use")
        return cls(n, slot_bytes, **kw)

    # -- read side ---------------------------------------------------------
    @property
    def slot_bytes(self) -> int:
        return self.slot_bytes_

    @property
    def capacity_bytes(self) -> int:
        return self.num_slots * self.slot_bytes_

    @property
    def stats(self) -> TierStats:
        return self._stats

    def __len__(self) -> int:
        return len(self._ready)

    def lookup(self, key: RequestKey) -> LookupResult:
        if key in self._ready:
            return LookupResult.HIT
        if key in self._pending:
            return LookupResult.HIT_PENDING
        return LookupResult.MISS

    def lookup_prefix(self, keys: Sequence[RequestKey]) -> int:
        """Number of leading keys that are READY; touches them in LRU order."""
        n = 0
        for k in keys:
            if self._ready.get(k) is None:
                break
            n += 1
        self._stats.hits += n
        if n < len(keys):
            self._stats.misses += 1
        return n

    def slot_of(self, key: RequestKey) -> int | None:
        e = self._ready.get(key)
        return None if e is None else e.slot

    # -- store -------------------------------------------------------------
    def prepare_store(self, keys: Sequence[RequestKey],
                      metas: Sequence[BlockMeta] | None = None) -> StoreJob | None:
        """Reserve slots for the keys not yet present, in order.

        Stops at the first key it cannot place (a stored prefix is useful, a
        stored suffix is not). Returns None when nothing new could be placed
        although something was new (tier full of pinned/pending blocks), and an
        empty job when every key was already present.
        """
        if metas is not None and len(metas) != len(keys):
            raise ValueError("metas must match keys")
        new: list[_Entry] = []
        skipped: list[RequestKey] = []
        wanted = 0
        seen: set[RequestKey] = set()
        for i, k in enumerate(keys):
            if k in self._ready or k in self._pending or k in seen:
                skipped.append(k)
                continue
            wanted += 1
            slot = self._alloc_slot()
            if slot is None:
                self._stats.stores_refused += sum(
                    1 for k2 in keys[i:] if self.lookup(k2) is LookupResult.MISS)
                break
            seen.add(k)
            e = _Entry(k, slot, metas[i] if metas is not None else BlockMeta())
            self._pending[k] = e
            new.append(e)
        self._stats.stores_skipped += len(skipped)
        if wanted and not new:
            return None
        job_id = next(self._ids)
        if new:
            self._store_jobs[job_id] = new
        return StoreJob(job_id, tuple(e.key for e in new), tuple(e.slot for e in new),
                        tuple(skipped))

    def complete_store(self, job_id: int, success: bool) -> None:
        entries = self._store_jobs.pop(job_id, None)
        if entries is None:
            return  # empty job, or already completed: idempotent
        stored = []
        for e in entries:
            del self._pending[e.key]
            if success:
                self._ready[e.key] = e
                stored.append(e)
            else:
                self._free.append(e.slot)
        if stored:
            self._stats.held_changed(len(stored))
            self._stats.record_move("store", len(stored) * self.slot_bytes_)
            self._events.append(TierEvent(TierEventKind.STORED, tuple(e.key for e in stored),
                                          tuple(e.meta for e in stored)))

    # -- load --------------------------------------------------------------
    def prepare_load(self, keys: Sequence[RequestKey]) -> LoadJob | None:
        """Pin every key for reading; None if any is not READY."""
        entries = []
        for k in keys:
            e = self._ready.get(k)
            if e is None:
                return None
            entries.append(e)
        for e in entries:
            e.pins += 1
        job = LoadJob(next(self._ids), tuple(keys), tuple(e.slot for e in entries),
                      self.clock() + self.lease_s)
        self._load_jobs[job.job_id] = (job, entries)
        return job

    def complete_load(self, job_id: int, success: bool, path: str = "load") -> None:
        item = self._load_jobs.pop(job_id, None)
        if item is None:
            return
        job, entries = item
        for e in entries:
            e.pins -= 1
            if e.pins == 0 and e.evicted:
                self._free.append(e.slot)
        if success:
            self._stats.record_move(path, len(entries) * self.slot_bytes_)

    def expire_leases(self, now: float | None = None) -> list[int]:
        now = self.clock() if now is None else now
        expired = [jid for jid, (job, _) in self._load_jobs.items() if job.deadline <= now]
        for jid in expired:
            self.complete_load(jid, success=False)
        return expired

    # -- eviction ----------------------------------------------------------
    def _alloc_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        # Evict READY entries in LRU order until one frees a slot now; pinned
        # victims leave the index but keep their slot until unpinned.
        while self._ready:
            _, e = self._ready.popitem()
            self._remove(e)
            if e.pins == 0:
                return e.slot
            e.evicted = True
        return None

    def _remove(self, e: _Entry) -> None:
        self._stats.held_changed(-1)
        self._stats.evictions += 1
        self._events.append(TierEvent(TierEventKind.REMOVED, (e.key,), (e.meta,)))

    def evict(self, keys: Iterable[RequestKey]) -> int:
        """Drop specific keys (fault injection, explicit invalidation)."""
        n = 0
        for k in keys:
            e = self._ready.pop(k, None)
            if e is None:
                continue
            self._remove(e)
            if e.pins == 0:
                self._free.append(e.slot)
            else:
                e.evicted = True
            n += 1
        return n

    def clear(self) -> None:
        """Forget every READY block (pinned slots are freed on unpin)."""
        entries = list(self._ready.values())
        self._ready.clear()
        for e in entries:
            if e.pins == 0:
                self._free.append(e.slot)
            else:
                e.evicted = True
        if entries:
            self._stats.held_changed(-len(entries))
        self._events.append(TierEvent(TierEventKind.CLEARED))

    def take_events(self) -> list[TierEvent]:
        out, self._events = self._events, []
        return out
