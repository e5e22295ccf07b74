"""Conversation store and prefix proof: which retained KV a new turn may reuse.

After a turn, the decode node (bidirectional NixlConnector) keeps the turn's KV
(prompt + generated tokens) pinned for ``decoder_kv_blocks_ttl`` and returns
``kv_transfer_params`` naming those blocks. The router keeps, per
(tenant, conversation):

- the decode node's ``NixlParams``,
- the exact token ids that KV covers (``covered``) and their digest,
- an expiry on the router's own monotonic clock.

On the next turn ``take()`` hands the entry out once (single-use: the blocks are
freed by the first reader), and ``prove_prefix()`` checks the new prompt's token
ids against ``covered``. Only a proven common prefix is reused, trimmed to
whole blocks; anything else is dropped, because vLLM would load KV computed for
different tokens (vLLM issue #43094).

A request that names no conversation finds one by content (``find``): every retained
entry is indexed, per tenant, by the chained digest of each of its whole blocks (one
16-byte BLAKE2b per block, chained like the engines' prefix hashes); a prompt is hashed
once, block by block, and its longest boundary that hits an entry names the candidate,
which ``prove_prefix`` then checks token by token like a named one.

The store itself is cachetools' ``TLRUCache`` (each entry expires at its own
``expires_at``, least recently stored goes first, sized in bytes) plus an entry
count cap; it remembers which conversations expired so ``take`` can say so.
An entry that leaves untaken (the entry or byte cap, its expiry, a newer turn of its
conversation stored over it) is handed to ``on_evict``: nobody will offer its blocks
again, so the router releases their decode lease (``Retention.evicted``) instead of
renewing it until the hold ends. A take or a dead pod's discard is not an eviction.

Backends: ``ConversationBackend`` is what the router uses (async ``a*`` methods, and
``put_soon``, the write after an answer that nothing waits for, so one contract covers this
in-process store and ``redis_store.RedisStore``, shared by routers and workers);
``ConversationStore`` is the ``memory`` backend and keeps its synchronous methods.
``open_store`` builds the one a config names.

Threading model: one asyncio event loop owns a store; methods never await and
are not thread-safe. Expired entries are purged lazily on every access.
"""

from __future__ import annotations

import hashlib
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, cast

import numpy as np
from cachetools import LRUCache, TLRUCache

from kvtier.hashing import token_digest
from kvtier.ids import ConversationId, Outcome, PodId
from kvtier.transfer_params import NixlParams

# What an entry really costs in this process, measured with tracemalloc (2,000 entries of
# 256 and of 4,096 tokens, block size 32: 6.4 KB and 68 KB each): ~2.3 KB fixed (params model,
# keys, digest, cache bookkeeping) plus ~16 B per covered token (the uint32 ids, the block-id
# list, the per-block digest index). The older figure (ids + 512 B) undercounted ~4x.
_ENTRY_OVERHEAD_BYTES = 2400
_BYTES_PER_TOKEN = 16
_CANDIDATES = 8  # entries ``find`` checks per block boundary (newest first)


@dataclass(frozen=True)
class RetainedKV:
    """What one decode node holds for a conversation after a turn."""

    conversation: ConversationId
    tenant: str
    decode_pod: PodId
    params: NixlParams
    covered: np.ndarray  # uint32 token ids the retained KV was computed for
    digest: str
    expires_at: float  # router monotonic clock
    prompt_len: int = 0  # how many of ``covered`` were the turn's prompt (0: unknown)

    @classmethod
    def build(cls, conversation: ConversationId, tenant: str, decode_pod: PodId,
              params: NixlParams, token_ids: Sequence[int], expires_at: float,
              prompt_len: int = 0) -> RetainedKV:
        # D computed KV for remote_num_tokens tokens (the last sampled token never
        # went through the model); cover exactly those.
        n = len(token_ids)
        if params.remote_num_tokens is not None:
            n = min(n, params.remote_num_tokens)
        covered = np.asarray(token_ids[:n], dtype=np.uint32)
        return cls(conversation, tenant, decode_pod, params, covered,
                   token_digest(_as_ids(covered)), expires_at, min(prompt_len, n))

    @property
    def nbytes(self) -> int:
        return _ENTRY_OVERHEAD_BYTES + len(self.covered) * _BYTES_PER_TOKEN


@dataclass(frozen=True)
class StoreStats:
    backend: str
    entries: int
    nbytes: int | None  # None: the backend does not account bytes (Redis: its maxmemory)
    evicted: int = 0    # so far, by the entry or byte cap
    expired: int = 0    # so far, past their expiry


class ConversationBackend(Protocol):
    """A conversation store as the router uses it; every method is a coroutine and never
    raises for the backend's own trouble: an unavailable backend (``ok`` False) stores
    nothing and finds nothing, and the turn is served without reuse."""

    name: str

    @property
    def ok(self) -> bool: ...

    @property
    def error(self) -> str | None: ...

    def may_hold(self) -> bool:
        """False only when the store is known to be empty (lets the router skip a
        tokenization)."""
        ...

    async def aput(self, entry: RetainedKV) -> bool:
        """Store ``entry`` (replacing its conversation's older one); True once stored."""
        ...

    def put_soon(self, entry: RetainedKV) -> bool:
        """Store ``entry`` without waiting for a remote backend: False when refused at once
        (too large, already expired, the backend known down); True when stored or written
        (the write under way: its failure is counted, logged and handed to ``on_evict``).
        What the router calls after a turn, so the answer never waits for the store."""
        ...

    async def atake(self, tenant: str,
                    conversation: ConversationId) -> tuple[RetainedKV | None, bool]: ...

    async def afind(self, tenant: str, prompt_ids: Sequence[int]) -> ConversationId | None: ...

    async def adiscard_pod(self, pod: PodId) -> int: ...

    async def astats(self) -> StoreStats: ...

    async def aclose(self) -> None: ...


@dataclass(frozen=True)
class ReuseDecision:
    outcome: Outcome
    params: NixlParams | None  # what to hand the prefill (None: nothing)
    reused_tokens: int  # tokens of D's KV the prefill may read


def prove_prefix(retained: RetainedKV, prompt_ids: Sequence[int], block_size: int) -> ReuseDecision:
    """Check ``prompt_ids`` starts with the retained ids; trim or drop otherwise."""
    covered = retained.covered
    n = len(covered)
    if n == 0 or not retained.params.has_remote_blocks:
        return ReuseDecision(Outcome.STALE, None, 0)
    prompt = np.asarray(prompt_ids, dtype=np.int64)
    if len(prompt) >= n and np.array_equal(prompt[:n], covered) \
            and token_digest(_as_ids(prompt[:n])) == retained.digest:
        if len(prompt) > n:
            return ReuseDecision(Outcome.FULL, retained.params, n)
        # The new prompt IS the covered sequence (nothing new to compute): the
        # engine must still run the last token, so keep whole blocks before it.
        common = n - 1
    else:
        common = _common_prefix(covered, prompt)
    trimmed = retained.params.trimmed(common, block_size)
    if trimmed is None:
        return ReuseDecision(Outcome.STALE, None, 0)
    return ReuseDecision(Outcome.TRIMMED, trimmed, trimmed.remote_num_tokens or 0)


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.nonzero(a[:n].astype(np.int64) != b[:n])[0]
    return int(diff[0]) if len(diff) else n


def _as_ids(a: np.ndarray) -> Sequence[int]:
    # token_digest packs any sequence of ints, arrays included; only its annotation is narrower.
    return cast(Sequence[int], a)


_Key = tuple[str, ConversationId]


def _expiry(_key: _Key, entry: RetainedKV, _now: float) -> float:
    return entry.expires_at


def _size(entry: RetainedKV) -> int:
    return entry.nbytes


class _Entries(TLRUCache[_Key, RetainedKV]):
    """cachetools' TLRU cache counting what it evicts and expires.

    cachetools purges expired entries on every write and on every read of ``len`` or
    ``currsize`` (the gauges read both), so which call drops an entry is an accident;
    ``expired_keys`` remembers the keys it dropped so ``take`` can still tell the client's
    next turn "expired" rather than "nothing retained"."""

    def __init__(self, max_entries: int, max_bytes: int, clock: Callable[[], float],
                 on_drop: Callable[[_Key, RetainedKV], None]) -> None:
        super().__init__(max_bytes, _expiry, clock, _size)
        self.on_drop = on_drop
        # Bounded like the entries: a key is forgotten after max_entries later expiries.
        self.expired_keys: LRUCache[_Key, bool] = LRUCache(max_entries)
        self.evicted = 0
        self.expired = 0

    def expire(self, time: float | None = None) -> list[tuple[_Key, RetainedKV]]:
        gone = super().expire(time)
        self.expired += len(gone)
        for key, entry in gone:
            self.expired_keys[key] = True
            self.on_drop(key, entry)
        return gone

    def popitem(self) -> tuple[_Key, RetainedKV]:
        # cachetools evicts through popitem, and only the store calls it otherwise.
        item = super().popitem()
        self.evicted += 1
        self.on_drop(*item)
        return item


class ConversationStore:
    """Single-use, TTL'd, LRU, memory-capped map (tenant, conversation) -> RetainedKV.

    The ``memory`` ``ConversationBackend`` (the ``a*`` methods) of one process."""

    name = "memory"
    ok = True
    error: str | None = None

    def __init__(self, max_entries: int, max_bytes: int,
                 clock: Callable[[], float] = time.monotonic, block_size: int = 32,
                 on_evict: Callable[[RetainedKV], None] = lambda _e: None) -> None:
        """``on_evict(entry)`` hears every entry that leaves untaken (module docstring); it
        runs inside the store's update, so it must only schedule work and never raise."""
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.block_size = block_size
        self.on_evict = on_evict
        self._entries = _Entries(max_entries, max_bytes, clock, self._evicted)
        # (tenant, chained block digest) -> keys of the entries with that prefix, oldest first
        self._index: dict[tuple[str, bytes], dict[_Key, None]] = {}
        self._hashes: dict[_Key, list[bytes]] = {}

    def _evicted(self, key: _Key, entry: RetainedKV) -> None:
        self._unindex(key)
        self.on_evict(entry)

    def _unindex(self, key: _Key) -> None:
        for h in self._hashes.pop(key, ()):
            keys = self._index.get((key[0], h))
            if keys is not None:
                keys.pop(key, None)
                if not keys:
                    del self._index[(key[0], h)]

    def find(self, tenant: str, prompt_ids: Sequence[int]) -> ConversationId | None:
        """The conversation of ``tenant`` whose retained ids share the longest whole-block
        prefix with ``prompt_ids`` (a candidate: prove it before use); None if none does.

        Only a continuation counts: the new prompt must repeat the retained turn's whole
        prompt (token for token; what follows may diverge anywhere in the answer, as chat
        history resent as text does). Two conversations that share only a system prompt
        never take each other's KV. At most ``_CANDIDATES`` entries are checked per block
        boundary, newest first."""
        if not self._index:
            return None
        hashes = block_hashes(prompt_ids, self.block_size)
        if not hashes:
            return None
        prompt = np.asarray(prompt_ids, dtype=np.int64)
        entries = self._entries
        for i in range(len(hashes) - 1, -1, -1):
            matched = (i + 1) * self.block_size
            keys = self._index.get((tenant, hashes[i]))
            if not keys:
                continue
            # newest first, without copying the set (a shared system prompt's first blocks
            # index every conversation: 2.6 ms per boundary at 100k entries as a list copy)
            for key in itertools.islice(reversed(keys), _CANDIDATES):
                entry = entries.get(key)
                if entry is None or entry.prompt_len > len(prompt):
                    continue
                n = entry.prompt_len
                if n <= matched or np.array_equal(prompt[matched:n], entry.covered[matched:n]):
                    return key[1]
        return None

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return int(self._entries.currsize)

    @property
    def evicted(self) -> int:
        """Entries pushed out by the entry or byte cap."""
        return self._entries.evicted

    @property
    def expired(self) -> int:
        """Entries dropped past their expiry."""
        return self._entries.expired

    def put(self, entry: RetainedKV) -> bool:
        """Store (replacing any older entry); False if it alone exceeds the byte cap (or
        has already expired)."""
        if entry.nbytes > self.max_bytes:
            return False
        key = (entry.tenant, entry.conversation)
        entries = self._entries
        with entries.timer:  # one instant for the whole update
            entries.expire()
            old = entries.pop(key, None)
            self._unindex(key)
            if old is not None and old.params.remote_request_id != \
                    entry.params.remote_request_id:
                self.on_evict(old)  # a newer turn of the conversation replaces it
            entries.expired_keys.pop(key, None)
            # The byte cap is the cache's own; the entry cap is this loop.
            while len(entries) >= self.max_entries:
                entries.popitem()
            entries[key] = entry
            if key not in entries:
                return False
            hashes = block_hashes(_as_ids(entry.covered), self.block_size)
            self._hashes[key] = hashes
            for h in hashes:
                self._index.setdefault((entry.tenant, h), {})[key] = None
            return True

    def take(self, tenant: str, conversation: ConversationId) -> tuple[RetainedKV | None, bool]:
        """Remove and return the entry: (entry, expired). Single use."""
        key = (tenant, conversation)
        entries = self._entries
        with entries.timer:
            entries.expire()
            entry = entries.pop(key, None)
        self._unindex(key)
        if entry is not None:
            return entry, False
        return None, entries.expired_keys.pop(key, False)

    def discard_pod(self, pod: PodId) -> int:
        """Forget every entry held by a pod (it died: its KV is gone)."""
        entries = self._entries
        with entries.timer:
            keys = [k for k, e in entries.items() if e.decode_pod == pod]
            for k in keys:
                del entries[k]
                self._unindex(k)
        return len(keys)


    # ---- ConversationBackend ---------------------------------------------
    def may_hold(self) -> bool:
        return len(self._entries) > 0

    async def aput(self, entry: RetainedKV) -> bool:
        return self.put(entry)

    def put_soon(self, entry: RetainedKV) -> bool:
        return self.put(entry)

    async def atake(self, tenant: str,
                    conversation: ConversationId) -> tuple[RetainedKV | None, bool]:
        return self.take(tenant, conversation)

    async def afind(self, tenant: str, prompt_ids: Sequence[int]) -> ConversationId | None:
        return self.find(tenant, prompt_ids)

    async def adiscard_pod(self, pod: PodId) -> int:
        return self.discard_pod(pod)

    async def astats(self) -> StoreStats:
        return StoreStats(self.name, len(self), self.nbytes, self.evicted, self.expired)

    async def aclose(self) -> None:
        return None


def open_store(url: str, *, max_entries: int, max_bytes: int, block_size: int,
               ttl_s: float, namespace: str, timeout_s: float,
               on_call: Callable[[str, float | None], None] = lambda _op, _s: None,
               on_evict: Callable[[RetainedKV], None] = lambda _e: None,
               ) -> ConversationBackend:
    """The backend ``url`` names: ``memory`` or ``redis://HOST:PORT/DB``. ``on_call(op,
    seconds)`` hears every remote call (seconds None: it failed); ``on_evict(entry)`` every
    entry the memory store lets go untaken, and every Redis write after an answer that failed
    (Redis expires and evicts on its own: see redis_store.py). With Redis, ``max_entries``
    and ``max_bytes`` cap this process's copies of entries (``redis_store._Recent``)."""
    if url == "memory":
        return ConversationStore(max_entries, max_bytes, block_size=block_size,
                                 on_evict=on_evict)
    from kvtier.router.redis_store import RedisStore

    return RedisStore(url, namespace=namespace, ttl_s=ttl_s, block_size=block_size,
                      timeout_s=timeout_s, on_call=on_call, on_evict=on_evict,
                      cache_entries=max_entries, cache_bytes=max_bytes)


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """Chained 16-byte digests of each whole block of ``token_ids`` (uint32 little-endian):
    the i-th names the first ``(i + 1) * block_size`` tokens."""
    a = np.asarray(token_ids, dtype="<u4")
    out: list[bytes] = []
    h = b""
    for i in range(len(a) // block_size):
        h = hashlib.blake2b(h + a[i * block_size:(i + 1) * block_size].tobytes(),
                            digest_size=16).digest()
        out.append(h)
    return out
