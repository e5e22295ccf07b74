"""kvtier's peer fetch as a secondary tier of vLLM's CPU offloading (the core; no vLLM here).

On CUDA kvtier's host tier is vLLM's own (``OffloadingConnector``, CPU, with
``TieringOffloadingSpec``); what vLLM lacks is a pull from another engine's host memory gated
by ``min_cached_token_delta``. ``PeerTier`` adds it as a *secondary tier*: vLLM's CPU tier stays
the primary and sees this one only through the calls below, which the adapter
(``kvtier.connectors.peer_tier``) makes from vLLM's ``SecondaryTierManager`` methods.

- ``store``: vLLM cascades every block it stores in its CPU tier; the rows are copied into a
  pool of this tier's own (so vLLM's LRU stays free to evict its rows at once), keyed by the
  block's offload key. That pool is what peers read.
- ``lookup``: a key this tier holds is a HIT. A key it lacks, on a request whose
  ``kv_transfer_params`` name a peer (``remote_kv_source``, set by kvtier's router), is RETRY:
  vLLM's scan keeps going, so every key of the request after vLLM's own hits is seen in one
  step; at the step's end (``schedule_end``) one pull of that chain is queued, gated by
  ``min_cached_token_delta`` (``kvtier.reuse_gate``), and the peer's READY prefix is READ over
  NIXL into this tier's pool (``kvtier.tier.peer.PeerClient``, the CPU platform's protocol).
  Once it is done the keys it brought are HITs and the rest MISSes.
- ``load``: vLLM promotes HIT keys into its CPU tier: rows copied back from this tier's pool.
- ``finished_jobs``: stores and loads report here, as vLLM polls for them.

Peers serve from the same pool with kvtier's ``PeerServer`` on its own thread, so an idle
engine (one that takes no scheduler steps) still serves (vLLM's own ``tiering/p2p`` serves once
per scheduler step). Both engines must hash blocks alike: the keys are vLLM's block hashes
(``hash_label`` names what makes them agree, e.g. ``PYTHONHASHSEED`` and the hash algorithm,
and is compared in the handshake).

Threading model: vLLM calls ``store``/``lookup``/``load``/``schedule_end``/``finished_jobs`` from
its scheduler thread; every copy and pull runs on one worker thread of this tier (in submission
order, so ``PeerClient`` keeps its one-thread contract); the peer server has its own thread.
Every tier call holds ``self.lock``.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from kvtier.ids import RequestKey
from kvtier.reuse_gate import DEFAULT_MIN_CACHED_TOKEN_DELTA, gains_enough
from kvtier.tier.manager import HostTier
from kvtier.tier.manager import LookupResult as TierLookup
from kvtier.tier.nixl import NixlPool
from kvtier.tier.peer import PeerClient, PeerServer
from kvtier.tier.pool import HostPool
from kvtier.transfer_params import RemoteKVSource
from kvtier.wire.peer import Identity

log = logging.getLogger(__name__)

LAYOUT = "vllm-offload-cpu-row"  # one primary-tier row per block, as vLLM's CPU tier lays it out


class Found(str, Enum):
    HIT = "hit"
    MISS = "miss"
    RETRY = "retry"


@dataclass
class _Pull:
    """One request's pull: keys gathered during a step, then one fetch."""

    source: RemoteKVSource
    keys: list[RequestKey] = field(default_factory=list)
    future: Future[None] | None = None

    @property
    def done(self) -> bool:
        return self.future is not None and self.future.done()


@dataclass(frozen=True)
class PeerTierConfig:
    """What ``PeerTier`` needs besides the primary rows (parsed by the adapter)."""

    capacity_bytes: int
    block_size: int  # tokens per offload key (vLLM's offloaded block size)
    model: str
    hash_label: int  # compared in the handshake: engines must hash blocks alike
    host: str = "127.0.0.1"
    port: int | None = None  # serve peers here (None: pull only)
    peer_timeout_s: float = 5.0
    min_cached_token_delta: int = DEFAULT_MIN_CACHED_TOKEN_DELTA
    name: str = "kvtier-peer-tier"

    def __post_init__(self) -> None:
        if self.capacity_bytes <= 0 or self.block_size <= 0:
            raise ValueError(f"kvtier peer tier needs capacity_bytes and block_size > 0, got "
                             f"{self.capacity_bytes} and {self.block_size}")


class PeerTier:
    """A host pool of its own, filled by vLLM's cascade and by pulls from peers, served to them."""

    def __init__(self, rows: np.ndarray, cfg: PeerTierConfig) -> None:
        if rows.ndim != 2 or rows.dtype != np.uint8:
            raise ValueError(f"primary rows must be a 2-D uint8 array, got {rows.dtype} "
                             f"{rows.shape}")
        self.rows, self.cfg = rows, cfg
        row_bytes = int(rows.shape[1])
        num_slots = cfg.capacity_bytes // row_bytes
        if num_slots <= 0:
            raise ValueError(f"kvtier peer tier: capacity {cfg.capacity_bytes} B holds no "
                             f"block of {row_bytes} B")
        self.lock = threading.RLock()
        self.tier = HostTier(num_slots, row_bytes)
        self.pool = HostPool(num_slots, row_bytes)  # process-private: only this process copies
        # Agent names must differ between peers: two processes can place this object alike.
        self.nixl = NixlPool(self.pool, f"{cfg.name}-{os.getpid()}-{id(self):x}")
        self.identity = Identity(cfg.model, cfg.block_size, cfg.hash_label, LAYOUT, row_bytes)
        self.server = (PeerServer(self.tier, self.lock, self.nixl, self.identity, cfg.host,
                                  cfg.port) if cfg.port is not None else None)
        self.client = PeerClient(self.tier, self.lock, self.nixl, self.identity,
                                 cfg.peer_timeout_s)
        self._work = ThreadPoolExecutor(1, thread_name_prefix="kvtier-peer-tier")
        self._pulls: dict[str, _Pull] = {}
        self._finished: list[tuple[int, bool]] = []

    # -- cascade from vLLM's CPU tier ----------------------------------------------------
    def store(self, job_id: int, keys: Sequence[RequestKey], rows: Sequence[int]) -> None:
        """Copy primary ``rows`` (pinned by vLLM until this job is reported) into the pool."""
        if len(keys) != len(rows):
            raise ValueError(f"{len(keys)} keys for {len(rows)} rows")
        self._work.submit(self._store, job_id, list(keys), [int(r) for r in rows])

    def _store(self, job_id: int, keys: list[RequestKey], rows: list[int]) -> None:
        ok = False
        try:
            with self.lock:
                job = self.tier.prepare_store(keys)
            if job is not None and job.keys:
                index = {k: r for k, r in zip(keys, rows)}
                src = [index[k] for k in job.keys]
                self.pool.array[list(job.slots)] = self.rows[src]
                with self.lock:
                    self.tier.complete_store(job.job_id, True)
            # A full pool keeps what it has: the cascade is best effort, vLLM's tier has them.
            ok = True
        except Exception:
            log.exception("kvtier peer tier: store job %d failed", job_id)
        with self.lock:
            self._finished.append((job_id, ok))

    # -- lookup and pull -----------------------------------------------------------------
    def lookup(self, req_id: str, key: RequestKey, source: RemoteKVSource | None) -> Found:
        with self.lock:
            if self.tier.lookup(key) is TierLookup.HIT:
                return Found.HIT
        if source is None:
            return Found.MISS
        pull = self._pulls.get(req_id)
        if pull is None:
            pull = self._pulls[req_id] = _Pull(source)
        if pull.future is None:
            if key not in pull.keys:
                pull.keys.append(key)
            return Found.RETRY
        return Found.MISS if pull.done else Found.RETRY

    def schedule_end(self) -> None:
        """Queue one pull per request whose keys were gathered this step."""
        for req_id, pull in self._pulls.items():
            if pull.future is None:
                pull.future = self._work.submit(self._pull, req_id, pull.source,
                                                list(pull.keys))

    def _pull(self, req_id: str, source: RemoteKVSource, keys: list[RequestKey]) -> None:
        bs = self.cfg.block_size
        keys = keys[: source.num_tokens // bs] if source.num_tokens else keys
        if not gains_enough(len(keys) * bs, self.cfg.min_cached_token_delta):
            log.info("kvtier peer tier: %s: %d tokens from %s, under min_cached_token_delta %d",
                     req_id, len(keys) * bs, source.pod, self.cfg.min_cached_token_delta)
            return
        try:
            res = self.client.fetch(source.host, source.port, keys)
        except Exception:
            log.exception("kvtier peer tier: pull for %s from %s failed", req_id, source.pod)
            return
        if res.reason:
            log.warning("kvtier peer tier: pull for %s from %s fell back: %d/%d blocks (%s)",
                        req_id, source.pod, res.blocks, len(keys), res.reason)
        else:
            log.info("kvtier peer tier: %s pulled %d blocks (%d tokens) from %s", req_id,
                     res.fetched, res.fetched * bs, source.pod)

    def request_finished(self, req_id: str) -> None:
        self._pulls.pop(req_id, None)

    @property
    def pending(self) -> bool:
        """A pull or copy is in flight (vLLM keeps stepping while it is)."""
        with self.lock:
            if self._finished:
                return True
        return any(p.future is not None and not p.done for p in self._pulls.values())

    # -- promotion into vLLM's CPU tier --------------------------------------------------
    def load(self, job_id: int, keys: Sequence[RequestKey], rows: Sequence[int]) -> None:
        """Copy the pool's blocks for ``keys`` into primary ``rows`` (allocated by vLLM)."""
        if len(keys) != len(rows):
            raise ValueError(f"{len(keys)} keys for {len(rows)} rows")
        self._work.submit(self._load, job_id, list(keys), [int(r) for r in rows])

    def _load(self, job_id: int, keys: list[RequestKey], rows: list[int]) -> None:
        ok = False
        with self.lock:
            job = self.tier.prepare_load(keys)
        if job is not None:
            try:
                self.rows[rows] = self.pool.array[list(job.slots)]
                ok = True
            except Exception:
                log.exception("kvtier peer tier: load job %d failed", job_id)
            with self.lock:
                self.tier.complete_load(job.job_id, ok)
        with self.lock:
            self._finished.append((job_id, ok))

    def finished_jobs(self) -> list[tuple[int, bool]]:
        with self.lock:
            done, self._finished = self._finished, []
        return done

    def drain(self) -> None:
        """Wait until every submitted copy and pull has run."""
        self._work.submit(lambda: None).result()

    def clear(self) -> None:
        self.drain()
        with self.lock:
            self.tier.clear()

    def close(self) -> None:
        self._work.shutdown(wait=True, cancel_futures=True)
        if self.server is not None:
            self.server.close()
        self.client.close()
        self.nixl.close()
