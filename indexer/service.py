"""The indexer as an in-process object: subscriptions, index, queries, snapshot.

``IndexerService`` is what the HTTP daemon serves and what a router in the
same process may call directly (``lookup`` / ``source``: no HTTP, no
serialization, answered inline on the caller's thread).

Source selection (``source``), after llm-d's P2P pull rule:
only CPU-tier copies can be pulled; a candidate must be another pod than the
target, have a P2P address configured, and hold at least
``min_cached_token_delta`` more tokens than the target holds on *any* of its
tiers. Among candidates the longest match wins; ties are broken by pod name
(deterministic; the indexer knows no load).

Threading model: queries run on the caller's thread, concurrently with the
subscriber's threads (the index backends are thread-safe). ``add_pod`` /
``remove_pod`` may be called from any thread. ``start``/``stop`` from one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Self, TypedDict

from kvtier.indexer.config import IndexerConfig, PodSpec
from kvtier.indexer.index import KVIndex, MemoryIndex, restore_entries
from kvtier.indexer.ingest import EventApplier, HasherCache
from kvtier.indexer.metrics import IndexerMetrics, InstrumentedIndex
from kvtier.indexer.snapshot import load_snapshot, write_snapshot
from kvtier.indexer.subscriber import PodState, Subscriber

from kvtier.ids import ModelName, PodId, RequestKey, Tier
from kvtier.wire.indexer_api import LookupResponse, Match, Source, SourceResponse

log = logging.getLogger(__name__)


class PodStatus(TypedDict):
    connected: bool
    last_seq: int
    gaps: int


class InputError(ValueError):
    """A query the caller got wrong (HTTP 4xx)."""

    def __init__(self, msg: str, status: int = 400) -> None:
        super().__init__(msg)
        self.status = status


def make_index(cfg: IndexerConfig) -> KVIndex:
    if cfg.backend == "memory":
        return MemoryIndex(max_keys=cfg.max_keys, max_blocks_per_pod=cfg.max_blocks_per_pod)
    from kvtier.indexer.redis_index import RedisIndex

    return RedisIndex.from_url(cfg.backend, namespace=cfg.redis_namespace,
                               max_keys=cfg.max_keys)


class IndexerService:
    def __init__(self, cfg: IndexerConfig, index: KVIndex | None = None) -> None:
        self.cfg = cfg
        self.metrics = IndexerMetrics()
        self.raw_index = index if index is not None else make_index(cfg)
        self.index = InstrumentedIndex(self.raw_index, self.metrics)
        self.hashers = HasherCache(cfg.block_size, cfg.hash_seed)
        self.subscriber = Subscriber(
            EventApplier(self.index, self.hashers), cfg.default_model,
            apply_workers=cfg.apply_workers, replay_timeout_s=cfg.replay_timeout_s,
            max_pending=cfg.max_pending_batches)
        self.metrics.bind(self.subscriber, self.raw_index)
        self._snap_stop = threading.Event()
        self._snap_thread: threading.Thread | None = None
        self._started = False

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        resume = self._load_snapshot()
        self.subscriber.start()
        for spec in self.cfg.pods:
            self.subscriber.add_pod(spec, last_seq=resume.get(spec.name, -1))
        if self.cfg.snapshot_path and self.cfg.snapshot_interval_s > 0:
            self._snap_thread = threading.Thread(target=self._snapshot_loop, daemon=True,
                                                 name="kvtier-indexer-snapshot")
            self._snap_thread.start()
        self._started = True

    def stop(self) -> None:
        if not self._started:
            return
        self._started = False
        self._snap_stop.set()
        if self._snap_thread is not None:
            self._snap_thread.join(timeout=10)
        self.subscriber.drain(timeout=5)
        if self.cfg.snapshot_path:
            self.snapshot()
        self.subscriber.stop()
        self.raw_index.close()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- pods ---------------------------------------------------------------------------------

    def add_pod(self, spec: PodSpec) -> PodState:
        if spec.name in self.subscriber.pods:
            raise InputError(f"pod {spec.name!r} already exists", status=409)
        return self.subscriber.add_pod(spec)

    def remove_pod(self, name: PodId) -> None:
        if self.subscriber.remove_pod(name) is None:
            raise InputError(f"unknown pod {name!r}", status=404)

    def pod_status(self) -> dict[PodId, PodStatus]:
        return {
            name: {"connected": st.connected, "last_seq": st.last_seq, "gaps": st.gaps}
            for name, st in list(self.subscriber.pods.items())
        }

    def wait_connected(self, timeout_s: float = 15.0, settle_s: float = 0.3) -> bool:
        """Wait until every pod's event PUB is connected (TCP) plus ``settle_s`` for the
        subscription to travel: a PUB drops what it publishes before a SUB has joined, so a
        caller about to drive traffic should wait here first. False (and a warning) on timeout."""
        if wait_until(lambda: all(st.connected for st in list(self.subscriber.pods.values())),
                      timeout_s, 0.05):
            time.sleep(settle_s)
            return True
        missing = sorted(n for n, st in list(self.subscriber.pods.items()) if not st.connected)
        log.warning("indexer: events of %s not connected after %.0f s; what they publish "
                    "meanwhile is lost until a replay", missing, timeout_s)
        return False

    def pod_details(self) -> dict[PodId, dict[str, Any]]:
        out: dict[PodId, dict[str, Any]] = {}
        for name, st in list(self.subscriber.pods.items()):
            out[name] = {
                **st.spec.model_dump(), "model": st.model, "connected": st.connected,
                "last_seq": st.last_seq, "gaps": st.gaps, "missing_batches": st.missing,
                "malformed_frames": st.malformed, "replays": st.replays,
                "replay_timeouts": st.replay_timeouts, "restarts": st.restarts,
                "blocks_stored": st.counters.blocks_stored,
                "blocks_removed": st.counters.blocks_removed,
                "dropped": dict(st.counters.dropped),
            }
        return out

    # -- queries (inline, caller's thread) ---------------------------------------------------

    def _keys(self, model: ModelName, token_ids: Sequence[int]) -> list[RequestKey]:
        if not token_ids:
            raise InputError("token_ids must not be empty")
        if len(token_ids) > self.cfg.max_lookup_tokens:
            raise InputError(f"token_ids has {len(token_ids)} tokens, over the limit of "
                             f"{self.cfg.max_lookup_tokens}", status=413)
        return self.hashers.get(model).keys(token_ids)

    def lookup(self, model: ModelName, token_ids: Sequence[int]) -> LookupResponse:
        """Longest cached prefix per (pod, tier), longest first."""
        bs = self.cfg.block_size
        found = self.index.lookup(self._keys(model, token_ids))
        matches = [Match(pod=p, tier=t.value, matched_tokens=n * bs)
                   for (p, t), n in found.items() if n > 0]
        matches.sort(key=lambda m: (-m.matched_tokens, m.pod, m.tier))
        return LookupResponse(block_size=bs, matches=matches)

    def source(self, model: ModelName, token_ids: Sequence[int], target_pod: PodId,
               min_cached_token_delta: int | None = None) -> SourceResponse:
        """Best peer to pull this prompt's KV from into ``target_pod``, or none."""
        min_delta = (self.cfg.min_cached_token_delta if min_cached_token_delta is None
                     else min_cached_token_delta)
        bs = self.cfg.block_size
        found = self.index.lookup(self._keys(model, token_ids))
        target = max((n for (p, _), n in found.items() if p == target_pod), default=0) * bs
        pods = self.subscriber.pods
        # (tokens, pod, its p2p address): the address is taken with the candidate, as the pod
        # may be removed by another thread before we answer.
        best: tuple[int, PodId, tuple[str, int]] | None = None
        for (p, t), n in found.items():
            if t is not Tier.CPU or p == target_pod:
                continue
            st = pods.get(p)
            addr = None if st is None else st.spec.p2p_host_port
            if addr is None:
                continue
            tokens = n * bs
            if best is None or tokens > best[0] or (tokens == best[0] and p < best[1]):
                best = (tokens, p, addr)
        if best is None:
            return SourceResponse(source=None, target_matched_tokens=target, delta=0)
        tokens, pod, (host, port) = best
        delta = tokens - target
        if delta < min_delta or tokens == 0:
            return SourceResponse(source=None, target_matched_tokens=target, delta=delta)
        return SourceResponse(
            source=Source(pod=pod, tier="CPU", matched_tokens=tokens, p2p_host=host,
                          p2p_port=port),
            target_matched_tokens=target, delta=delta)

    # -- snapshot -----------------------------------------------------------------------------

    def snapshot(self) -> None:
        """Write the snapshot file now (memory backend: mappings + last applied seq per pod)."""
        if not self.cfg.snapshot_path:
            return
        pods = {name: (st.applied_seq, self.raw_index.pod_entries(name))
                for name, st in list(self.subscriber.pods.items())}
        write_snapshot(self.cfg.snapshot_path, self.cfg, pods)

    def _load_snapshot(self) -> dict[PodId, int]:
        if not self.cfg.snapshot_path:
            return {}
        snap = load_snapshot(self.cfg.snapshot_path, self.cfg)
        if snap is None:
            return {}
        configured = {p.name for p in self.cfg.pods}
        resume: dict[PodId, int] = {}
        for name, (seq, entries) in snap.items():
            if name in configured:
                n = restore_entries(self.raw_index, name, entries)
                resume[name] = seq
                log.info("pod %s: restored %d blocks from snapshot, resuming after seq %d",
                         name, n, seq)
        return resume

    def _snapshot_loop(self) -> None:
        while not self._snap_stop.wait(self.cfg.snapshot_interval_s):
            try:
                self.snapshot()
            except Exception:
                log.exception("snapshot failed")


def wait_until(pred: Callable[[], object], timeout: float = 10.0, interval: float = 0.02) -> bool:
    """Poll ``pred`` until true or ``timeout``; for tests and the CLI."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return bool(pred())
