"""The prefix index: interface and the in-memory backend.

Two key spaces (see ``kvtier.ids``), as in llm-d's indexer:

- per pod, ``EngineBlockHash -> (RequestKey, tiers)``: the *mapping*. Events
  name blocks by the engine's opaque hash; ``BlockStored`` chains a new block
  from its parent's request key (found here), and ``BlockRemoved`` finds the
  request key to drop here.
- ``RequestKey -> {(pod, tier)}``: the *holders*. Lookups hash the prompt
  into request keys and walk them in order.

Invariant kept by every backend: a (pod, tier) is a holder of a key only if
that pod's mapping has an engine hash for the key with that tier. Capacity
eviction may drop a key (and so its holders) while mappings remain, never
the other way round.

Threading model: every backend is safe to call from several threads; each
call is atomic with respect to the others (the memory backend holds one lock
per call, Redis applies a call as one pipeline / script). Callers that need
per-pod ordering (the subscriber) apply one pod's events from one thread.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from kvtier.ids import EngineBlockHash, PodId, RequestKey, Tier

Holder = tuple[PodId, Tier]
TIER_BIT = {Tier.GPU: 1, Tier.CPU: 2}
TIERS_BY_BIT = ((1, Tier.GPU), (2, Tier.CPU))


@dataclass(frozen=True, slots=True)
class IndexStats:
    keys: int      # request keys with at least one holder (or not yet evicted)
    mappings: int  # engine-hash entries summed over pods
    evicted: int   # request keys dropped by the capacity bound since start


@dataclass(frozen=True, slots=True)
class MappingEntry:
    engine_hash: EngineBlockHash
    key: RequestKey
    tiers: frozenset[Tier]


@runtime_checkable
class KVIndex(Protocol):
    """What the indexer needs from a backend. Methods never raise on unknown pods/keys."""

    def store(self, pod: PodId, tier: Tier,
              blocks: Sequence[tuple[EngineBlockHash, RequestKey]]) -> None:
        """Record that ``pod`` holds these blocks on ``tier`` (idempotent)."""

    def resolve(self, pod: PodId, engine_hash: EngineBlockHash) -> RequestKey | None:
        """The request key ``pod`` stored under ``engine_hash``, if known."""

    def remove(self, pod: PodId, tier: Tier, hashes: Sequence[EngineBlockHash]) -> int:
        """Drop ``pod``'s copies on ``tier``; returns how many were known."""

    def clear_pod(self, pod: PodId) -> int:
        """Forget everything about ``pod`` (all tiers); returns mappings dropped."""

    def lookup(self, keys: Sequence[RequestKey]) -> dict[Holder, int]:
        """Longest consecutive prefix of ``keys`` (in blocks) per holder; zeros omitted."""

    def pod_entries(self, pod: PodId) -> list[MappingEntry]:
        """Every mapping entry of ``pod`` (snapshots, debugging)."""

    def stats(self) -> IndexStats: ...

    def close(self) -> None: ...


class MemoryIndex:
    """In-process backend: dicts and bitmasks, bounded by ``max_keys`` (LRU).

    Each (pod, tier) gets a slot; a key's holders are an int bitmask of
    slots, so the prefix walk is one dict lookup and one AND per block. A
    slot is reused only after its pod was cleared, which (by the invariant
    above) leaves no stale bits behind. Lookups refresh the recency of the
    keys they matched when ``touch_on_lookup`` (the LRU is over use, not only
    over writes: a hot system prompt must not age out).
    """

    def __init__(self, max_keys: int = 2_000_000, max_blocks_per_pod: int = 1_000_000,
                 touch_on_lookup: bool = True) -> None:
        if max_keys <= 0 or max_blocks_per_pod <= 0:
            raise ValueError("capacities must be positive")
        self._max_keys = max_keys
        self._max_per_pod = max_blocks_per_pod
        self._touch = touch_on_lookup
        self._lock = threading.Lock()
        self._keys: OrderedDict[RequestKey, int] = OrderedDict()  # -> holder bitmask
        # pod -> {engine hash: request_key << 2 | tier bits}
        self._maps: dict[PodId, dict[EngineBlockHash, int]] = {}
        self._slot: dict[Holder, int] = {}
        self._slot_holder: list[Holder | None] = []
        self._free_slots: list[int] = []
        self._evicted = 0

    # -- slots ---------------------------------------------------------------------

    def _bit(self, pod: PodId, tier: Tier) -> int:
        s = self._slot.get((pod, tier))
        if s is None:
            if self._free_slots:
                s = self._free_slots.pop()
                self._slot_holder[s] = (pod, tier)
            else:
                s = len(self._slot_holder)
                self._slot_holder.append((pod, tier))
            self._slot[(pod, tier)] = s
        return 1 << s

    def _pod_bits(self, pod: PodId) -> dict[int, int]:
        """tier bit -> slot bit, for the tiers this pod has slots on."""
        out: dict[int, int] = {}
        for tb, tier in TIERS_BY_BIT:
            s = self._slot.get((pod, tier))
            if s is not None:
                out[tb] = 1 << s
        return out

    # -- writes ----------------------------------------------------------------------

    def store(self, pod: PodId, tier: Tier,
              blocks: Sequence[tuple[EngineBlockHash, RequestKey]]) -> None:
        if not blocks:
            return
        tb = TIER_BIT[tier]
        with self._lock:
            bit = self._bit(pod, tier)
            m = self._maps.setdefault(pod, {})
            keys = self._keys
            for eh, rk in blocks:
                old = m.get(eh)
                if old is not None and (old >> 2) != rk:
                    # Same engine hash, different tokens: only possible after a
                    # pod restart with another hash seed. Last writer wins.
                    self._unset(pod, eh, old)
                    old = None
                m[eh] = (rk << 2) | ((old & 3) if old is not None else 0) | tb
                cur = keys.get(rk)
                if cur is None:
                    keys[rk] = bit
                else:
                    keys[rk] = cur | bit
                    keys.move_to_end(rk)
            while len(m) > self._max_per_pod:
                eh = next(iter(m))
                self._unset(pod, eh, m.pop(eh))
            while len(keys) > self._max_keys:
                keys.popitem(last=False)
                self._evicted += 1

    def _unset(self, pod: PodId, eh: EngineBlockHash, packed: int, tiers: int = 3) -> None:
        """Clear ``pod``'s holder bits (for ``tiers``) on the key of one mapping entry."""
        rk = RequestKey(packed >> 2)
        cur = self._keys.get(rk)
        if cur is None:
            return
        for tb, bit in self._pod_bits(pod).items():
            if tb & tiers & packed:
                cur &= ~bit
        if cur:
            self._keys[rk] = cur
        else:
            del self._keys[rk]

    def remove(self, pod: PodId, tier: Tier, hashes: Sequence[EngineBlockHash]) -> int:
        tb = TIER_BIT[tier]
        n = 0
        with self._lock:
            m = self._maps.get(pod)
            if not m:
                return 0
            for eh in hashes:
                packed = m.get(eh)
                if packed is None or not packed & tb:
                    continue
                n += 1
                self._unset(pod, eh, packed, tb)
                rest = packed & ~tb
                if rest & 3:
                    m[eh] = rest
                else:
                    del m[eh]
        return n

    def clear_pod(self, pod: PodId) -> int:
        with self._lock:
            m = self._maps.pop(pod, None) or {}
            for eh, packed in m.items():
                self._unset(pod, eh, packed)
            for tier in Tier:
                s = self._slot.pop((pod, tier), None)
                if s is not None:
                    self._slot_holder[s] = None
                    self._free_slots.append(s)
            return len(m)

    # -- reads -------------------------------------------------------------------------

    def resolve(self, pod: PodId, engine_hash: EngineBlockHash) -> RequestKey | None:
        m = self._maps.get(pod)
        if m is None:
            return None
        packed = m.get(engine_hash)
        return None if packed is None else RequestKey(packed >> 2)

    def lookup(self, keys: Sequence[RequestKey]) -> dict[Holder, int]:
        n = len(keys)
        if n == 0:
            return {}
        with self._lock:
            get = self._keys.get
            active = get(keys[0], 0)
            if not active:
                return {}
            depth: dict[int, int] = {}  # slot bit -> matched blocks
            i = 1
            while i < n:
                new = active & get(keys[i], 0)
                if new != active:
                    dropped = active ^ new
                    while dropped:
                        low = dropped & -dropped
                        depth[low] = i
                        dropped ^= low
                    active = new
                    if not active:
                        break
                i += 1
            while active:
                low = active & -active
                depth[low] = n
                active ^= low
            if self._touch:
                mte = self._keys.move_to_end
                for k in keys[: max(depth.values())]:
                    mte(k)
            holders = self._slot_holder
            out: dict[Holder, int] = {}
            for b, d in depth.items():
                h = holders[b.bit_length() - 1]
                if h is not None:  # always: a set bit is a live slot (invariant above)
                    out[h] = d
            return out

    def pod_entries(self, pod: PodId) -> list[MappingEntry]:
        with self._lock:
            m = dict(self._maps.get(pod, {}))
        return [
            MappingEntry(eh, RequestKey(p >> 2),
                         frozenset(t for tb, t in TIERS_BY_BIT if p & tb))
            for eh, p in m.items()
        ]

    def pods(self) -> list[PodId]:
        with self._lock:
            return list(self._maps)

    def stats(self) -> IndexStats:
        with self._lock:
            return IndexStats(keys=len(self._keys),
                              mappings=sum(len(m) for m in self._maps.values()),
                              evicted=self._evicted)

    def close(self) -> None:
        pass


def restore_entries(index: KVIndex, pod: PodId, entries: Iterable[MappingEntry]) -> int:
    """Re-store snapshot entries into ``index``; returns how many."""
    by_tier: dict[Tier, list[tuple[EngineBlockHash, RequestKey]]] = {t: [] for t in Tier}
    n = 0
    for e in entries:
        n += 1
        for t in e.tiers:
            by_tier[t].append((e.engine_hash, e.key))
    for t, blocks in by_tier.items():
        index.store(pod, t, blocks)
    return n
