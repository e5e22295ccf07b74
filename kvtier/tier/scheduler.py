"""Scheduler half of the host tier: decides what to load and store, owns the tier.

Per request:

- ``match`` (vLLM's ``get_num_new_matched_tokens``): RequestKeys of the full
  blocks of ``all_token_ids`` (minus the last token, which vLLM always
  recomputes), longest READY prefix in the host tier, pinned at once so the
  blocks cannot be evicted before the worker copies them.
- ``after_alloc``: turns the pin into a LoadOp for the blocks vLLM allocated.
- ``finished``: keys of every block whose KV was computed (prompt AND
  generated tokens unless ``offload_prompt_only``), ``prepare_store`` for the
  ones not present, one StoreOp; returns True so vLLM keeps the blocks until
  the worker reports the copy done (``finished_sending``).
- ``worker_done``: completes store and load jobs from the worker's metadata.
- ``publish``: the tier's KV events since the last call, to the events publisher.

Built whole by ``kvtier.tier.spec.HostTierSpec.get_scheduler`` (peer client, events
publisher and the servers it closes are constructor fields, never patched in later).

Threading model: vLLM calls the scheduler half from its scheduler thread;
the peer server (if enabled) runs on its own thread and shares the tier, so
every tier call here and there holds ``self.lock``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from kvtier.hashing import RequestKeyHasher, to_external
from kvtier.ids import EngineBlockHash, RequestKey
from kvtier.reuse_gate import DEFAULT_MIN_CACHED_TOKEN_DELTA, gains_enough
from kvtier.tier.events import TierEventPublisher
from kvtier.tier.manager import BlockMeta, HostTier, LoadJob
from kvtier.tier.ops import LoadOp, StoreOp
from kvtier.tier.peer import PeerClient
from kvtier.transfer_params import RemoteKVSource

log = logging.getLogger(__name__)


def engine_hash(h: object) -> EngineBlockHash | None:
    if isinstance(h, (bytes, bytearray)):
        return to_external(bytes(h))
    if isinstance(h, int):
        return EngineBlockHash(h)
    return None


class Closeable(Protocol):
    def close(self) -> None: ...


@dataclass
class _Match:
    num_local: int
    job: LoadJob


@dataclass
class TierScheduler:
    tier: HostTier
    hasher: RequestKeyHasher
    block_size: int
    offload_prompt_only: bool = False
    lock: threading.RLock = field(default_factory=threading.RLock)
    # Peer fetch (None: off), gated by min_cached_token_delta (kvtier.reuse_gate).
    peer: PeerClient | None = None
    min_cached_token_delta: int = DEFAULT_MIN_CACHED_TOKEN_DELTA
    events: TierEventPublisher | None = None  # the tier's KV events (None: not published)
    # Servers that share the tier (peer server, metrics): closed with the scheduler.
    services: tuple[Closeable, ...] = ()
    _matches: dict[str, _Match] = field(default_factory=dict)
    _loads: list[LoadOp] = field(default_factory=list)
    _stores: list[StoreOp] = field(default_factory=list)
    _salted: dict[str, RequestKeyHasher] = field(default_factory=dict)

    def keys(self, token_ids: Sequence[int], salt: str | None = None) -> list[RequestKey]:
        """RequestKeys of the full blocks; a request's ``cache_salt`` is part
        of the namespace, as it is of vLLM's own block hashes (tenant isolation)."""
        if not salt:
            return self.hasher.keys(token_ids)
        h = self._salted.get(salt)
        if h is None:
            if len(self._salted) > 1024:
                self._salted.clear()
            h = self._salted[salt] = replace(self.hasher, extra=f"salt={salt}")
        return h.keys(token_ids)

    def loadable_keys(self, token_ids: Sequence[int], salt: str | None = None) -> list[RequestKey]:
        # vLLM must compute at least one token to sample from; never offer the
        # block that contains the last token.
        n = (len(token_ids) - 1) // self.block_size
        return self.keys(token_ids[: n * self.block_size], salt) if n > 0 else []

    def pull_from_peer(self, source: RemoteKVSource, token_ids: Sequence[int],
                       num_computed: int, salt: str | None = None) -> None:
        """Bring the prefix a peer's host tier holds into the local tier.

        Synchronous (blocks the scheduler for the transfer; milliseconds on
        one host). Gated by ``min_cached_token_delta``; refused when the
        router's source description names a different block size / seed /
        model. Failures fall back to recompute and are counted.
        """
        if self.peer is None:
            return
        ident = self.peer.identity
        for f, mine in (("block_size", ident.block_size), ("hash_seed", ident.hash_seed),
                        ("model", ident.model)):
            theirs = getattr(source, f)
            if theirs is not None and theirs != mine:
                with self.lock:
                    self.tier.stats.record_fallback("refused")
                log.warning("kvtier peer fetch from %s refused: %s %r != %r", source.pod, f,
                            theirs, mine)
                return
        keys = self.loadable_keys(token_ids, salt)
        keys = keys[: source.num_tokens // self.block_size]
        with self.lock:
            local = max(self.tier.lookup_prefix(keys), num_computed // self.block_size)
        if not gains_enough((len(keys) - local) * self.block_size,
                            self.min_cached_token_delta):
            return
        bs = self.block_size
        metas = [BlockMeta(token_ids=tuple(token_ids[i * bs:(i + 1) * bs]),
                           parent_key=keys[i - 1] if i else None) for i in range(len(keys))]
        res = self.peer.fetch(source.host, source.port, keys, metas)
        if res.reason:
            # WARNING, not INFO: vLLM leaves non-vllm loggers at the root
            # default, and a fallback to recompute is what an operator greps for.
            log.warning("kvtier peer fetch from %s fell back: %d/%d blocks (%s)", source.pod,
                        res.blocks, len(keys), res.reason)

    def match(self, req_id: str, token_ids: Sequence[int], num_computed: int,
              salt: str | None = None) -> int:
        """Tokens beyond ``num_computed`` loadable from the host tier (pinned)."""
        with self.lock:
            self._release(req_id)
            keys = self.loadable_keys(token_ids, salt)
            first = num_computed // self.block_size
            hit = self.tier.lookup_prefix(keys)
            if hit <= first:
                return 0
            job = self.tier.prepare_load(keys[first:hit])
            if job is None:
                return 0
            self._matches[req_id] = _Match(num_computed, job)
            return (hit - first) * self.block_size

    def after_alloc(self, req_id: str, block_ids: Sequence[int], num_external: int) -> None:
        with self.lock:
            m = self._matches.pop(req_id, None)
            if m is None:
                return
            n = num_external // self.block_size
            if n <= 0 or n > len(m.job.slots):
                self.tier.complete_load(m.job.job_id, success=False)
                return
            first = m.num_local // self.block_size
            dst = tuple(block_ids[first: first + n])
            if n < len(m.job.slots):
                # vLLM took fewer tokens than offered: repin exactly what is loaded.
                self.tier.complete_load(m.job.job_id, success=False)
                job = self.tier.prepare_load(m.job.keys[:n])
                if job is None:
                    return
            else:
                job = m.job
            self._loads.append(LoadOp(job.job_id, dst, job.slots[:n]))

    def _release(self, req_id: str) -> None:
        m = self._matches.pop(req_id, None)
        if m is not None:
            self.tier.complete_load(m.job.job_id, success=False)

    def finished(self, req_id: str, all_token_ids: Sequence[int], num_computed: int,
                 num_prompt: int, block_ids: Sequence[int],
                 block_hashes: Sequence[object] = (), salt: str | None = None) -> bool:
        """Offload the request's computed blocks; True if a copy is pending."""
        with self.lock:
            self._release(req_id)
            n_tokens = min(num_computed, num_prompt) if self.offload_prompt_only else num_computed
            tokens = list(all_token_ids[:n_tokens])
            keys = self.keys(tokens, salt)[: len(block_ids)]
            if not keys:
                return False
            bs = self.block_size
            metas = []
            for i, _ in enumerate(keys):
                metas.append(BlockMeta(
                    token_ids=tuple(tokens[i * bs: (i + 1) * bs]),
                    engine_hash=engine_hash(block_hashes[i]) if i < len(block_hashes) else None,
                    parent_key=keys[i - 1] if i else None,
                    parent_engine_hash=(engine_hash(block_hashes[i - 1])
                                        if 0 < i <= len(block_hashes) else None),
                ))
            job = self.tier.prepare_store(keys, metas)
            if job is None or not job.keys:
                if job is not None:
                    self.tier.complete_store(job.job_id, True)
                return False
            index = {k: i for i, k in enumerate(keys)}
            src = tuple(block_ids[index[k]] for k in job.keys)
            self._stores.append(StoreOp(job.job_id, req_id, src, job.slots))
            return True

    def take_ops(self) -> tuple[list[LoadOp], list[StoreOp]]:
        with self.lock:
            self.tier.expire_leases()
            loads, stores = self._loads, self._stores
            self._loads, self._stores = [], []
            return loads, stores

    def worker_done(self, stores: Sequence[int], loads: Sequence[tuple[int, bool]]) -> None:
        with self.lock:
            for job_id in stores:
                self.tier.complete_store(job_id, True)
            for job_id, ok in loads:
                self.tier.complete_load(job_id, ok)

    def publish(self) -> None:
        """Send the tier's KV events since the last call (dropped when nothing publishes)."""
        with self.lock:
            events = self.tier.take_events()
        if events and self.events is not None:
            self.events.publish(events, self.block_size)

    def reset(self) -> None:
        """Forget everything the tier holds (vLLM's ``reset_prefix_cache``)."""
        with self.lock:
            self.tier.clear()

    def close(self) -> None:
        if self.events is not None:
            self.events.close()
        for s in self.services:
            s.close()
        if self.peer is not None:
            self.peer.close()
