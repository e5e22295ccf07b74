"""Applying decoded KV events of one pod to the index.

``EventApplier`` turns ``BlockStored`` into request keys (chained from the
parent's request key, found through the pod's engine-hash mapping), resolves
``BlockRemoved`` through that mapping, and clears the pod on
``AllBlocksCleared``. Everything it cannot index is counted by reason in
``PodCounters`` (never raised): orphans (parent unknown: events were lost
before we subscribed), blocks with extra hash keys (multimodal, cache salt:
not findable from token ids), non-primary KV-cache groups, unknown media,
block-size mismatches, unknown event kinds.

Threading model: an applier is stateless apart from its counters; one pod's
batches must be applied from one thread at a time (the subscriber shards by
pod), different pods may be applied concurrently.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvtier.hashing import RequestKeyHasher
from kvtier.ids import EngineBlockHash, ModelName, PodId, RequestKey, Tier
from kvtier.indexer.fastdecode import RawTokens
from kvtier.indexer.index import KVIndex
from kvtier.indexer.keys import block_keys
from kvtier.wire.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    UnknownEvent,
)

_MEDIA: dict[str | None, Tier] = {None: Tier.GPU, "GPU": Tier.GPU, "CPU": Tier.CPU}


@dataclass
class PodCounters:
    """Per-pod event accounting (read by /healthz and /metrics)."""

    applied: Counter[str] = field(default_factory=Counter)  # kind -> events applied
    dropped: Counter[str] = field(default_factory=Counter)  # reason -> blocks/events skipped
    blocks_stored: int = 0
    blocks_removed: int = 0


class HasherCache:
    """RequestKeyHasher per (model, lora); hashers are immutable and cheap to share."""

    def __init__(self, block_size: int, seed: int = 0) -> None:
        self.block_size = block_size
        self.seed = seed
        self._h: dict[tuple[ModelName, str | None], RequestKeyHasher] = {}
        self._lock = threading.Lock()

    def get(self, model: ModelName, lora: str | None = None) -> RequestKeyHasher:
        h = self._h.get((model, lora))
        if h is None:
            with self._lock:
                h = self._h.setdefault(
                    (model, lora),
                    RequestKeyHasher(model, self.block_size, self.seed, lora=lora),
                )
        return h


class EventApplier:
    def __init__(self, index: KVIndex, hashers: HasherCache) -> None:
        self.index = index
        self.hashers = hashers
        # MemoryIndex's hash-and-store in one compiled call, for tokens still in msgpack
        self._store_tokens = getattr(index, "store_tokens", None)

    def apply(self, pod: PodId, model: ModelName, batch: EventBatch, c: PodCounters,
              siblings: Callable[[], Sequence[PodId]] | None = None) -> None:
        """Apply one batch of stream ``pod``. ``siblings``: the pod's other streams, where a
        parent block this stream never stored may be found (e.g. the host tier storing
        blocks whose parent only the engine stream announced)."""
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                self._stored(pod, model, ev, c, siblings)
            elif isinstance(ev, BlockRemoved):
                self._removed(pod, ev, c)
            elif isinstance(ev, AllBlocksCleared):
                self.index.clear_pod(pod)
                c.applied["AllBlocksCleared"] += 1
            elif isinstance(ev, UnknownEvent):
                c.dropped[f"unknown_event:{ev.kind}"[:64]] += 1

    def _tier(self, medium: str | None, group_idx: int | None, c: PodCounters,
              nblocks: int) -> Tier | None:
        if group_idx not in (None, 0):
            # Hybrid models: only the first (full-attention) group describes a prefix.
            c.dropped["non_primary_group"] += nblocks
            return None
        tier = _MEDIA.get(medium)
        if tier is None:
            c.dropped["unknown_medium"] += nblocks
        return tier

    def _stored(self, pod: PodId, model: ModelName, ev: BlockStored, c: PodCounters,
                siblings: Callable[[], Sequence[PodId]] | None = None) -> None:
        n = len(ev.block_hashes)
        tier = self._tier(ev.medium, ev.group_idx, c, n)
        if tier is None:
            return
        if ev.has_extra_keys:
            c.dropped["extra_keys"] += n
            return
        if ev.block_size == 0 and not ev.token_ids and tier is not Tier.GPU:
            self._stored_by_hash(pod, tier, ev.block_hashes, c)
            return
        hasher = self.hashers.get(model, ev.lora_name)
        if ev.block_size != hasher.block_size:
            c.dropped["block_size_mismatch"] += n
            return
        parent: RequestKey | None = None
        if ev.parent_block_hash is not None:
            parent = self.index.resolve(pod, ev.parent_block_hash)
            if parent is None and siblings is not None:
                for other in siblings():
                    parent = self.index.resolve(other, ev.parent_block_hash)
                    if parent is not None:
                        break
            if parent is None:
                c.dropped["orphan"] += n
                return
        bs = ev.block_size
        full = min(n, len(ev.token_ids) // bs)
        if full < n:
            c.dropped["short_token_ids"] += n - full
        if full == 0:
            return
        toks: object = ev.token_ids   # RawTokens from the fast decoder (a Sequence[int])
        if not (self._store_tokens is not None and type(toks) is RawTokens
                and self._store_tokens(pod, tier, ev.block_hashes, toks.raw, hasher, parent,
                                       full)):
            keys = block_keys(hasher, ev.token_ids, parent, full)   # exactly ``full`` keys
            self.index.store(pod, tier, list(zip(ev.block_hashes, keys)))
        c.applied["BlockStored"] += 1
        c.blocks_stored += full

    def _stored_by_hash(self, pod: PodId, tier: Tier, hashes: Sequence[EngineBlockHash],
                        c: PodCounters) -> None:
        """vLLM's CPU offloading (``OffloadingConnector``; its tiering spec allows no
        self-describing events) names an offloaded block by its hash alone, no tokens, block
        size 0. The engine's own stream announced the same hash with its tokens when the block
        was computed, so the key is the one stored for it; a hash never announced is dropped."""
        pairs = []
        for h in hashes:
            key = self.index.resolve(pod, h)
            if key is not None:
                pairs.append((h, key))
        if len(pairs) < len(hashes):
            c.dropped["unresolved_hash"] += len(hashes) - len(pairs)
        if pairs:
            self.index.store(pod, tier, pairs)
            c.applied["BlockStored"] += 1
            c.blocks_stored += len(pairs)

    def _removed(self, pod: PodId, ev: BlockRemoved, c: PodCounters) -> None:
        tier = self._tier(ev.medium, ev.group_idx, c, len(ev.block_hashes))
        if tier is None:
            return
        known = self.index.remove(pod, tier, ev.block_hashes)
        if known < len(ev.block_hashes):
            c.dropped["remove_unknown"] += len(ev.block_hashes) - known
        c.applied["BlockRemoved"] += 1
        c.blocks_removed += known
