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

Backends raise ``BackendUnavailable`` (and only that) when they cannot be
reached; the memory backend never does.

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

from kvtier.hashing import RequestKeyHasher
from kvtier.ids import EngineBlockHash, PodId, RequestKey, Tier
from kvtier.indexer.native import NATIVE

Holder = tuple[PodId, Tier]
_MAX_PENDING_TOUCH = 256    # lookups whose LRU refresh waits for the next store
_native_walk = getattr(NATIVE, "walk", None)
_native_lookup = getattr(NATIVE, "lookup", None)   # CPython 3.11 only (reads int digits)
_native_store = getattr(NATIVE, "store", None)
_native_store_tokens = getattr(NATIVE, "store_tokens", None)
TIER_BIT = {Tier.GPU: 1, Tier.CPU: 2}
TIERS_BY_BIT = ((1, Tier.GPU), (2, Tier.CPU))


class BackendUnavailable(RuntimeError):
    """The index backend cannot be reached (Redis down, timed out, loading). Queries answer
    HTTP 503; the subscriber replays what it could not apply once the backend is back."""


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

    def ping(self) -> None:
        """Raise ``BackendUnavailable`` if the backend cannot be reached."""

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
        # (pod, tier bit) -> slot: keyed by the tier's bit, not the Tier (an Enum's hash is
        # a Python call, and ``store`` looks a slot up per event)
        self._slot: dict[tuple[PodId, int], int] = {}
        self._slot_holder: list[Holder | None] = []
        self._slot_hash: list[int] = []   # hash(holder) per slot, for the compiled lookup
        self._free_slots: list[int] = []
        self._evicted = 0
        # (keys, matched depth) of lookups since the last store: touched by ``store``
        self._pending_touch: list[tuple[Sequence[RequestKey], int]] = []

    # -- slots ---------------------------------------------------------------------

    def _bit(self, pod: PodId, tier: Tier, tb: int) -> int:
        s = self._slot.get((pod, tb))
        if s is None:
            if self._free_slots:
                s = self._free_slots.pop()
                self._slot_holder[s] = (pod, tier)
                self._slot_hash[s] = hash((pod, tier))
            else:
                s = len(self._slot_holder)
                self._slot_holder.append((pod, tier))
                self._slot_hash.append(hash((pod, tier)))
            self._slot[(pod, tb)] = s
        return 1 << s

    def _pod_bits(self, pod: PodId) -> dict[int, int]:
        """tier bit -> slot bit, for the tiers this pod has slots on."""
        out: dict[int, int] = {}
        for tb, _ in TIERS_BY_BIT:
            s = self._slot.get((pod, tb))
            if s is not None:
                out[tb] = 1 << s
        return out

    # -- writes ----------------------------------------------------------------------

    def store(self, pod: PodId, tier: Tier,
              blocks: Sequence[tuple[EngineBlockHash, RequestKey]]) -> None:
        if not blocks:
            return
        tb = 1 if tier is Tier.GPU else TIER_BIT[tier]
        with self._lock:
            if self._pending_touch:
                self._apply_touches()
            bit = self._bit(pod, tier, tb)
            m = self._maps.setdefault(pod, {})
            keys = self._keys
            if _native_store is not None and type(blocks) is list:
                i = _native_store(m, keys, blocks, tb, bit, 0)
                while i >= 0:   # an engine hash that maps to other tokens: the Python path
                    self._store_py(pod, m, blocks[i:i + 1], tb, bit)
                    i = _native_store(m, keys, blocks, tb, bit, i + 1)
            else:
                self._store_py(pod, m, blocks, tb, bit)
            self._bound(pod, m)

    def _bound(self, pod: PodId, m: dict[EngineBlockHash, int]) -> None:
        """Evict over the capacity bounds (the caller holds the lock)."""
        keys = self._keys
        while len(m) > self._max_per_pod:
            eh = next(iter(m))
            self._unset(pod, eh, m.pop(eh))
        while len(keys) > self._max_keys:
            keys.popitem(last=False)
            self._evicted += 1

    def store_tokens(self, pod: PodId, tier: Tier, hashes: Sequence[EngineBlockHash],
                     raw: bytes, hasher: RequestKeyHasher, parent: RequestKey | None,
                     n: int) -> bool:
        """``store(pod, tier, zip(hashes, keys))`` where keys are the request keys of the
        first ``n`` blocks of ``raw`` (a msgpack token array, ``fastdecode.RawTokens.raw``),
        hashed and stored in one call of the compiled helper. False (nothing done) without
        it: the caller hashes and calls ``store``."""
        st = _native_store_tokens
        if st is None:
            return False
        if n <= 0:
            return True
        tb = 1 if tier is Tier.GPU else TIER_BIT[tier]
        with self._lock:
            if self._pending_touch:
                self._apply_touches()
            s = self._slot.get((pod, tb))
            bit = self._bit(pod, tier, tb) if s is None else 1 << s
            m = self._maps.get(pod)
            fresh = m is None
            if m is None:
                m = self._maps[pod] = {}
            try:
                i, keys = st(m, self._keys, hashes, raw, hasher.block_size, hasher.seed,
                             hasher.root if parent is None else parent, n, tb, bit)
            except BaseException:   # bad tokens raise before anything is stored
                if fresh and not m:
                    del self._maps[pod]   # as ``store``, never reached, would leave it
                raise
            if i >= 0:   # an engine hash that maps to other tokens: as ``store`` goes on
                blocks = list(zip(hashes[:n], keys))
                while i >= 0:
                    self._store_py(pod, m, blocks[i:i + 1], tb, bit)
                    i = NATIVE.store(m, self._keys, blocks, tb, bit, i + 1)  # type: ignore[union-attr]
            if len(m) > self._max_per_pod or len(self._keys) > self._max_keys:
                self._bound(pod, m)
        return True

    def _store_py(self, pod: PodId, m: dict[EngineBlockHash, int],
                  blocks: Sequence[tuple[EngineBlockHash, RequestKey]], tb: int,
                  bit: int) -> None:
        """``store``'s loop (``kvtier.indexer.native``'s ``store`` in Python)."""
        keys = self._keys
        mget, kget, mte = m.get, keys.get, keys.move_to_end
        for eh, rk in blocks:
            old = mget(eh)
            if old is None:
                m[eh] = (rk << 2) | tb
            elif (old >> 2) != rk:
                # Same engine hash, different tokens: only possible after a
                # pod restart with another hash seed. Last writer wins.
                self._unset(pod, eh, old)
                m[eh] = (rk << 2) | tb
            elif not old & tb:
                m[eh] = old | tb
            cur = kget(rk)
            if cur is None:
                keys[rk] = bit
            else:
                if not cur & bit:
                    keys[rk] = cur | bit
                mte(rk)

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
            for tb, _ in TIERS_BY_BIT:
                s = self._slot.pop((pod, tb), None)
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
        if not keys:
            return {}
        with self._lock:
            if _native_lookup is not None and type(keys) is list:
                found: dict[Holder, int]
                found, deepest = _native_lookup(keys, self._keys, self._slot_holder,
                                                self._slot_hash)
                if self._touch and deepest:
                    self._touched(keys, deepest)
                return found
            if _native_walk is not None and type(keys) is list:
                levels: list[tuple[int, int]] = _native_walk(keys, self._keys)
            else:
                levels = self._walk(keys)
            if not levels:
                return {}
            # A holder dropped at depth d is one set bit of that level's mask: peel the
            # lowest bit off (one dict entry per holder, built directly: at 512 holders
            # that is most of the cost, see benchmarks/README.md).
            holders = self._slot_holder
            out: dict[Holder, int] = {}
            for d, m in levels:
                while m:
                    low = m & -m
                    h = holders[low.bit_length() - 1]
                    if h is not None:  # always: a set bit is a live slot (invariant above)
                        out[h] = d
                    m ^= low
            if self._touch:
                self._touched(keys, levels[-1][0])
            return out

    def _touched(self, keys: Sequence[RequestKey], depth: int) -> None:
        # Recency only matters when ``store`` evicts, and it applies these first: the LRU
        # order is the same as touching here, and the query path does not pay for it.
        self._pending_touch.append((keys, depth))
        if len(self._pending_touch) >= _MAX_PENDING_TOUCH:
            self._apply_touches()

    def _walk(self, keys: Sequence[RequestKey]) -> list[tuple[int, int]]:
        """``[(depth, holders that match exactly that many blocks)]``, depth ascending
        (``kvtier.indexer.native``'s ``walk`` in Python)."""
        get = self._keys.get
        active = get(keys[0], 0)
        levels: list[tuple[int, int]] = []
        if not active:
            return levels
        n = len(keys)
        for i in range(1, n):
            new = active & get(keys[i], 0)
            if new != active:
                levels.append((i, active ^ new))
                active = new
                if not active:
                    return levels
        levels.append((n, active))
        return levels

    def _apply_touches(self) -> None:
        pending, self._pending_touch = self._pending_touch, []
        keys = self._keys
        mte = keys.move_to_end
        for ks, depth in pending:
            for k in ks[:depth]:
                if k in keys:   # removed since: nothing to refresh
                    mte(k)

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

    def ping(self) -> None:
        pass

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
