"""The indexer as an in-process object: subscriptions, index, queries, snapshot.

``IndexerService`` is what the HTTP daemon serves and what a router in the
same process may call directly (``lookup`` / ``source`` / ``route``: no
HTTP, no serialization, answered inline on the caller's thread). ``route``
answers both from one hashing of the prompt and one walk of the index.

A pod may have several event streams (``kvtier.indexer.config``); queries
merge them, and pod-level views (``pod_status``, ``pod_details``) sum or
combine them. Source selection (``kvtier.indexer.select``): CPU-tier copies
of another, *offered* pod, within one block of the longest, least loaded.
A pod is offered unless every one of its streams has been down (disconnected,
or reconnected but not caught up by replay) for more than ``stale_after_s``.

Backend down (Redis): queries raise ``BackendUnavailable`` (HTTP 503).

Threading model: queries run on the caller's thread, concurrently with the
subscriber's threads (the index backends are thread-safe). ``add_pod`` /
``remove_pod`` may be called from any thread. ``start``/``stop`` from one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Self, TypedDict

from kvtier.ids import ModelName, PodId, RequestKey
from kvtier.indexer.config import IndexerConfig, PodSpec, number_streams
from kvtier.indexer.index import BackendUnavailable, Holder, KVIndex, MemoryIndex, restore_entries
from kvtier.indexer.ingest import EventApplier, HasherCache
from kvtier.indexer.keys import request_keys
from kvtier.indexer.metrics import IndexerMetrics, InstrumentedIndex
from kvtier.indexer.replicas import ReplicaSync, SharedIndex
from kvtier.indexer.select import (
    SourceChoice,
    choose_among,
    choose_source,
    matches,
    merge_streams,
    route_parts,
)
from kvtier.indexer.snapshot import load_snapshot, write_snapshot
from kvtier.indexer.subscriber import PodState, Subscriber
from kvtier.wire.indexer_api import LookupResponse, RouteResponse, SourceResponse

log = logging.getLogger(__name__)


class StreamStatus(TypedDict):
    connected: bool
    last_seq: int
    gaps: int


class PodStatus(StreamStatus):
    """A pod's streams combined: connected if any is, ``last_seq`` of its first stream,
    gaps summed; ``stale``: not offered as a source; ``streams``: each stream's own."""

    stale: bool
    streams: dict[PodId, StreamStatus]


class InputError(ValueError):
    """A query the caller got wrong (HTTP 4xx)."""

    def __init__(self, msg: str, status: int = 400) -> None:
        super().__init__(msg)
        self.status = status


__all__ = ["BackendUnavailable", "IndexerService", "InputError", "make_index"]


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
        self._stale_logged: set[PodId] = set()
        self.replica: ReplicaSync | None = None
        if isinstance(self.raw_index, SharedIndex):
            self.replica = ReplicaSync(self.raw_index, self.subscriber)
        self.metrics.bind(self.subscriber, self.raw_index, cfg.stale_after_s)
        self._snap_stop = threading.Event()
        self._snap_thread: threading.Thread | None = None
        self._started = False

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        resume = self._load_snapshot() if self.replica is None else self.replica.resume_seqs()
        self.subscriber.start()
        for spec in self.cfg.pods:
            self.subscriber.add_pod(spec, last_seq=resume.get(spec.stream_id, -1))
        if self.cfg.snapshot_path and self.cfg.snapshot_interval_s > 0:
            self._snap_thread = threading.Thread(target=self._snapshot_loop, daemon=True,
                                                 name="kvtier-indexer-snapshot")
            self._snap_thread.start()
        if self.replica is not None:
            self.replica.start()
        self._started = True

    def stop(self) -> None:
        if not self._started:
            return
        self._started = False
        self._snap_stop.set()
        if self._snap_thread is not None:
            self._snap_thread.join(timeout=10)
        self.subscriber.drain(timeout=5)
        if self.replica is not None:
            self.replica.stop()
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
        """Add a pod, or (``spec.stream`` set) another stream of an existing pod."""
        existing = tuple(st.spec for st in self.subscriber.streams_of(spec.name))
        if existing and spec.stream is None:
            raise InputError(f"pod {spec.name!r} already exists (give stream=NAME to add "
                             "another event stream to it)", status=409)
        try:
            (spec,) = number_streams([spec], existing)
        except ValueError as e:
            raise InputError(str(e), status=409) from None
        try:
            st = self.subscriber.add_pod(spec)
        except ValueError as e:   # the same stream added by a concurrent call
            raise InputError(str(e), status=409) from None
        log.info("pod %s: stream %s added (%s)", spec.name, spec.stream_id, spec.events)
        return st

    def remove_pod(self, name: PodId) -> None:
        if not self.subscriber.remove_pod(name):
            raise InputError(f"unknown pod {name!r}", status=404)

    def _streams_by_pod(self) -> dict[PodId, list[PodState]]:
        out: dict[PodId, list[PodState]] = {}
        for st in list(self.subscriber.streams.values()):
            out.setdefault(st.pod, []).append(st)
        return out

    def _stale(self, streams: Sequence[PodState], now: float) -> bool:
        return all(st.stale(now, self.cfg.stale_after_s) for st in streams)

    def offered(self, pod: PodId, now: float | None = None) -> bool:
        """False for an unknown pod, or one whose every stream is down past ``stale_after_s``."""
        streams = self.subscriber.streams_of(pod)
        if not streams:
            return False
        stale = self._stale(streams, time.monotonic() if now is None else now)
        if stale != (pod in self._stale_logged):   # log transitions, once each
            (self._stale_logged.add if stale else self._stale_logged.discard)(pod)
            log.warning("pod %s: %s", pod, f"no live event stream for over "
                        f"{self.cfg.stale_after_s:g} s: not offered as a source" if stale
                        else "live again: offered as a source")
        return not stale

    def p2p_of(self, pod: PodId) -> tuple[str, int] | None:
        for st in self.subscriber.streams_of(pod):
            if st.spec.p2p_host_port is not None:
                return st.spec.p2p_host_port
        return None

    def pod_status(self) -> dict[PodId, PodStatus]:
        now = time.monotonic()
        out: dict[PodId, PodStatus] = {}
        for pod, streams in self._streams_by_pod().items():
            per: dict[PodId, StreamStatus] = {
                st.name: {"connected": st.connected, "last_seq": st.last_seq, "gaps": st.gaps}
                for st in streams}
            out[pod] = {"connected": any(s["connected"] for s in per.values()),
                        "last_seq": streams[0].last_seq,
                        "gaps": sum(s["gaps"] for s in per.values()),
                        "stale": self._stale(streams, now), "streams": per}
        return out

    def backend_error(self) -> str | None:
        """None when the index backend answers, else why not."""
        try:
            self.raw_index.ping()
        except BackendUnavailable as e:
            return str(e)
        return None

    def wait_connected(self, timeout_s: float = 15.0, settle_s: float = 0.3) -> bool:
        """Wait until every pod's event PUB is connected (TCP) plus ``settle_s`` for the
        subscription to travel: a PUB drops what it publishes before a SUB has joined, so a
        caller about to drive traffic should wait here first. False (and a warning) on timeout."""
        def connected() -> bool:
            return all(st.connected for st in list(self.subscriber.streams.values()))
        if _wait_until(connected, timeout_s, 0.05):
            time.sleep(settle_s)
            return True
        missing = sorted(n for n, st in list(self.subscriber.streams.items())
                         if not st.connected)
        log.warning("indexer: events of %s not connected after %.0f s; what they publish "
                    "meanwhile is lost until a replay", missing, timeout_s)
        return False

    def pod_details(self) -> dict[PodId, dict[str, Any]]:
        """Per pod: its first stream's spec fields, counters summed over its streams, and
        ``streams`` with each stream's own."""
        now = time.monotonic()
        out: dict[PodId, dict[str, Any]] = {}
        for pod, streams in self._streams_by_pod().items():
            per = {st.name: self._stream_details(st, now) for st in streams}
            first = per[streams[0].name]
            summed = {k: sum(d[k] for d in per.values()) for k in (
                "gaps", "missing_batches", "malformed_frames", "replays", "replay_timeouts",
                "restarts", "resyncs", "blocks_stored", "blocks_removed")}
            dropped: dict[str, int] = {}
            for d in per.values():
                for k, v in d["dropped"].items():
                    dropped[k] = dropped.get(k, 0) + v
            out[pod] = {**first, **summed, "dropped": dropped,
                        "connected": any(d["connected"] for d in per.values()),
                        "stale": self._stale(streams, now), "streams": per}
        return out

    @staticmethod
    def _stream_details(st: PodState, now: float) -> dict[str, Any]:
        return {
            **st.spec.model_dump(), "model": st.model, "connected": st.connected,
            "down_for_s": None if st.down_since is None else round(now - st.down_since, 3),
            "last_seq": st.last_seq, "gaps": st.gaps, "missing_batches": st.missing,
            "malformed_frames": st.malformed, "replays": st.replays,
            "replay_timeouts": st.replay_timeouts, "restarts": st.restarts,
            "resyncs": st.resyncs, "blocks_stored": st.counters.blocks_stored,
            "blocks_removed": st.counters.blocks_removed, "dropped": dict(st.counters.dropped),
        }

    # -- queries (inline, caller's thread) ---------------------------------------------------

    def _keys(self, model: ModelName, token_ids: Sequence[int]) -> list[RequestKey]:
        if not token_ids:
            raise InputError("token_ids must not be empty")
        if len(token_ids) > self.cfg.max_lookup_tokens:
            raise InputError(f"token_ids has {len(token_ids)} tokens, over the limit of "
                             f"{self.cfg.max_lookup_tokens}", status=413)
        return request_keys(self.hashers.get(model), token_ids)

    def _merged(self, model: ModelName, token_ids: Sequence[int]) -> dict[Holder, int]:
        found = self.index.lookup(self._keys(model, token_ids))
        # Only holders named NAME#S need merging; the memory backend holds only this
        # service's streams, so without any such stream the answer is already per pod.
        if self.subscriber.substreams or self.replica is not None:
            return merge_streams(found)
        return found

    def lookup(self, model: ModelName, token_ids: Sequence[int]) -> LookupResponse:
        """Longest cached prefix per (pod, tier), longest first."""
        bs = self.cfg.block_size
        return LookupResponse(block_size=bs, matches=matches(self._merged(model, token_ids), bs))

    def _choose(self, merged: dict[Holder, int], target_pod: PodId | None,
                min_cached_token_delta: int | None,
                loads: Mapping[str, int] | None) -> SourceChoice:
        min_delta = (self.cfg.min_cached_token_delta if min_cached_token_delta is None
                     else min_cached_token_delta)
        now = time.monotonic()
        return choose_source(merged, self.cfg.block_size, target_pod, min_delta, self.p2p_of,
                             lambda p: self.offered(p, now), loads)

    def source(self, model: ModelName, token_ids: Sequence[int], target_pod: PodId,
               min_cached_token_delta: int | None = None,
               loads: Mapping[str, int] | None = None) -> SourceResponse:
        """Best peer to pull this prompt's KV from into ``target_pod``, or none."""
        c = self._choose(self._merged(model, token_ids), target_pod, min_cached_token_delta,
                         loads)
        return SourceResponse(source=c.source, target_matched_tokens=c.target_matched_tokens,
                              delta=c.delta)

    def route(self, model: ModelName, token_ids: Sequence[int], target_pod: PodId | None = None,
              min_cached_token_delta: int | None = None,
              loads: Mapping[str, int] | None = None) -> RouteResponse:
        """``lookup`` and ``source`` in one: one hashing of the prompt, one index walk."""
        bs = self.cfg.block_size
        found, target, cpu = route_parts(self._merged(model, token_ids), bs, target_pod)
        min_delta = (self.cfg.min_cached_token_delta if min_cached_token_delta is None
                     else min_cached_token_delta)
        now = time.monotonic()
        c = choose_among(cpu, target, bs, target_pod, min_delta, self.p2p_of,
                         lambda p: self.offered(p, now), loads)
        return RouteResponse(block_size=bs, matches=found, source=c.source,
                             target_matched_tokens=c.target_matched_tokens, delta=c.delta)

    # -- snapshot -----------------------------------------------------------------------------

    def snapshot(self) -> None:
        """Write the snapshot file now (memory backend: mappings + last applied seq per pod)."""
        if not self.cfg.snapshot_path:
            return
        pods = {name: (st.applied_seq, self.raw_index.pod_entries(name))
                for name, st in list(self.subscriber.streams.items())}
        write_snapshot(self.cfg.snapshot_path, self.cfg, pods)

    def _load_snapshot(self) -> dict[PodId, int]:
        if not self.cfg.snapshot_path:
            return {}
        snap = load_snapshot(self.cfg.snapshot_path, self.cfg)
        if snap is None:
            return {}
        configured = {p.stream_id for p in self.cfg.pods}
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


def _wait_until(pred: Callable[[], object], timeout: float = 10.0,
                interval: float = 0.02) -> bool:
    """Poll ``pred`` until true or ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return bool(pred())
