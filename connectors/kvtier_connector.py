"""KVTierConnector: kvtier's host tier as a vLLM v1 KV connector.

A thin role dispatcher (STYLE rule 10): the scheduler role owns a
``TierScheduler`` (the HostTier manager, events, peer server and client), the
worker role a ``TierWorker`` (byte copies between vLLM's KV tensors and the
shared host pool). Both halves open the same pool by engine id.

Config: ``kv_connector_extra_config`` parsed once into
``kvtier.tier.config.HostTierConfig``.

Threading model: vLLM calls the scheduler-role methods from its scheduler
thread and the worker-role methods from the model runner thread; each half
is single-threaded apart from the peer server, see tier_scheduler.py.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtier.connectors import compat
from kvtier.connectors.tier_scheduler import TierScheduler
from kvtier.connectors.tier_worker import LoadOp, StoreOp, TierWorker
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from kvtier.hashing import RequestKeyHasher
from kvtier.ids import ModelName
from kvtier.tier.config import HostTierConfig
from kvtier.tier.events import TierEventPublisher
from kvtier.tier.manager import HostTier
from kvtier.tier.pool import HostPool
from kvtier.tier.pool import pool_tag as kvtier_pool_tag
from kvtier.transfer_params import KVTransferParams

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from kvtier.tier.metrics import TierMetricsServer
    from kvtier.tier.nixl import NixlPool
    from kvtier.tier.peer import PeerServer

log = logging.getLogger(__name__)


@dataclass
class TierMetadata(KVConnectorMetadata):
    loads: list[LoadOp] = field(default_factory=list)
    stores: list[StoreOp] = field(default_factory=list)


@dataclass
class TierWorkerMetadata(KVConnectorWorkerMetadata):
    stores_done: list[int] = field(default_factory=list)
    loads_done: list[tuple[int, bool]] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, TierWorkerMetadata)
        return TierWorkerMetadata(self.stores_done + other.stores_done,
                                  self.loads_done + other.loads_done)


@dataclass(frozen=True)
class KVGeometry:
    """What both halves derive from vLLM's KVCacheConfig, and peers must share."""

    block_size: int
    slot_bytes: int
    num_blocks: int
    layer_names: tuple[str, ...]
    layout: str  # compared in the peer handshake

    @classmethod
    def of(cls, kv_cache_config: "KVCacheConfig", block_size: int) -> "KVGeometry":
        names: list[str] = []
        parts: list[str] = []
        slot = 0
        for g in kv_cache_config.kv_cache_groups:
            spec = g.kv_cache_spec
            names.extend(g.layer_names)
            slot += spec.page_size_bytes * len(g.layer_names)
            parts.append(
                f"{type(spec).__name__}:{getattr(spec, 'num_kv_heads', '?')}x"
                f"{getattr(spec, 'head_size', '?')}:{getattr(spec, 'dtype', '?')}"
                f":{spec.page_size_bytes}x{len(g.layer_names)}")
        layout = (f"{compat.kv_cache_layout(kv_cache_config) or 'default'}|bs{block_size}|"
                  + ";".join(parts))
        return cls(block_size, slot, kv_cache_config.num_blocks, tuple(names), layout)


@compat.label_host_hits
class KVTierConnector(KVConnectorBase_V1):
    @property
    def requires_kv_delivery(self) -> bool:
        return False  # best-effort cache: a dropped store is a future miss

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = compat.kv_transfer_config(self)
        self.cfg = HostTierConfig.from_extra_config(ktc.kv_connector_extra_config).resolved(
            dict(os.environ))
        block_size = self.cfg.block_size or vllm_config.cache_config.block_size
        if block_size != vllm_config.cache_config.block_size:
            raise ValueError(
                f"kvtier block_size {block_size} != engine block size "
                f"{vllm_config.cache_config.block_size}; they must be equal")
        self.geometry = KVGeometry.of(kv_cache_config, block_size)
        num_slots = self.cfg.cpu_bytes_to_use // self.geometry.slot_bytes
        self.tp_rank, self.tp_size = compat.tp_rank_size(vllm_config)
        pool_tag = kvtier_pool_tag(f"{ktc.engine_id}", self.tp_rank, self.tp_size)
        self.model = ModelName(self.cfg.model or Path(vllm_config.model_config.model).name)
        self.sched: TierScheduler | None = None
        self.worker: TierWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            tier = HostTier(num_slots, self.geometry.slot_bytes, lease_s=self.cfg.lease_s)
            hasher = RequestKeyHasher(self.model, block_size, seed=self.cfg.hash_seed)
            self.sched = TierScheduler(tier, hasher, block_size, self.cfg.offload_prompt_only)
            self.peer_server: PeerServer | None = None
            self.nixl: NixlPool | None = None
            self.pool: HostPool | None = None
            if self.cfg.p2p_port is not None:
                self._start_peer(pool_tag, num_slots)
            self.events: TierEventPublisher | None = None
            if self.cfg.events_endpoint:
                self.events = TierEventPublisher(
                    self.cfg.events_endpoint, self.cfg.replay_endpoint, self.cfg.events_topic,
                    self.cfg.events_buffer_steps)
            self.metrics: TierMetricsServer | None = None
            if self.cfg.metrics and self.cfg.metrics_port is not None:
                self._start_metrics(tier, f"{ktc.engine_id}")
        else:
            self.worker = TierWorker(pool_tag, num_slots, self.geometry.slot_bytes,
                                     self.geometry.num_blocks, self.geometry.layer_names)
        log.info("KVTierConnector %s: %d slots x %d B, model %s, layout %s, pool %s", role.name,
                 num_slots, self.geometry.slot_bytes, self.model, self.geometry.layout,
                 pool_tag)

    def _start_peer(self, pool_tag: str, num_slots: int) -> None:
        from kvtier.tier.nixl import NixlPool
        from kvtier.tier.peer import PeerClient, PeerServer
        from kvtier.wire.peer import Identity

        assert self.sched is not None and self.cfg.p2p_port is not None
        assert self.cfg.p2p_host is not None  # HostTierConfig.resolved: this host's address
        if self.tp_size != 1:
            # The peer protocol moves one pool per engine; with TP every rank has its
            # own (pool_tag), and a handshake that carries the TP layout is not built yet.
            raise ValueError(f"kvtier peer fetch (p2p_port) needs tensor_parallel_size 1, "
                             f"got {self.tp_size}")
        g = self.geometry
        ident = Identity(self.model, g.block_size, self.cfg.hash_seed, g.layout, g.slot_bytes)
        self.pool = HostPool.shared(pool_tag, num_slots, g.slot_bytes)
        self.nixl = NixlPool(self.pool, f"kvtier-{pool_tag}")
        self.peer_server = PeerServer(self.sched.tier, self.sched.lock, self.nixl, ident,
                                      self.cfg.p2p_host, self.cfg.p2p_port)
        self.sched.peer = PeerClient(self.sched.tier, self.sched.lock, self.nixl, ident,
                                     self.cfg.peer_timeout_s)
        self.sched.min_delta = self.cfg.min_cached_token_delta

    def _start_metrics(self, tier: HostTier, engine_id: str) -> None:
        from kvtier.tier.metrics import TierCollector, TierMetricsServer

        assert self.sched is not None and self.cfg.metrics_port is not None
        lock = self.sched.lock

        def snapshot() -> dict:
            with lock:
                return tier.stats.snapshot()

        collector = TierCollector(snapshot, tier.slot_bytes, tier.capacity_bytes,
                                  self.cfg.pod or engine_id, self.model)
        self.metrics = TierMetricsServer(collector, self.cfg.metrics_port, self.cfg.metrics_host)
        log.info("KVTierConnector metrics on %s", self.metrics.url)

    # -- worker role -------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self.worker is not None
        self.worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = compat.connector_metadata(self)
        assert isinstance(meta, TierMetadata) and self.worker is not None
        if meta.loads or meta.stores:
            self.worker.run(meta.loads, meta.stores)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        return

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self.worker is not None
        return (self.worker.take_finished_sending() or None), None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_load_errors() if self.worker is not None else set()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if self.worker is None:
            return None
        stores, loads = self.worker.take_done()
        if not stores and not loads:
            return None
        return TierWorkerMetadata(stores, loads)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()
        if self.sched is not None:
            if self.events is not None:
                self.events.close()
            if self.peer_server is not None:
                self.peer_server.close()
            if self.sched.peer is not None:
                self.sched.peer.close()
            if self.metrics is not None:
                self.metrics.close()

    # -- scheduler role ----------------------------------------------------
    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.sched is not None
        params = KVTransferParams.from_wire(request.kv_transfer_params)
        if params is not None and params.remote_kv_source is not None:
            self.sched.pull_from_peer(params.remote_kv_source, request.all_token_ids,
                                      num_computed_tokens, request.cache_salt)
        n = self.sched.match(request.request_id, request.all_token_ids, num_computed_tokens,
                             request.cache_salt)
        return n, False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        assert self.sched is not None
        block_ids = blocks.get_block_ids()[0] if num_external_tokens > 0 else []
        self.sched.after_alloc(request.request_id, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        assert self.sched is not None
        loads, stores = self.sched.take_ops()
        self._publish()
        return TierMetadata(loads, stores)

    def _publish(self) -> None:
        assert self.sched is not None
        with self.sched.lock:
            events = self.sched.tier.take_events()
        if events and self.events is not None:
            self.events.publish(events, self.geometry.block_size)

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        meta = connector_output.kv_connector_worker_meta
        if self.sched is not None and isinstance(meta, TierWorkerMetadata):
            self.sched.worker_done(meta.stores_done, meta.loads_done)
            self._publish()

    def request_finished(self, request: "Request",
                         block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        assert self.sched is not None
        ids = block_ids[0] if block_ids and isinstance(block_ids[0], (list, tuple)) else block_ids
        pending = self.sched.finished(
            request.request_id, request.all_token_ids, request.num_computed_tokens,
            request.num_prompt_tokens, list(ids or ()), getattr(request, "block_hashes", ()),
            request.cache_salt)
        return pending, None

    def reset_cache(self) -> bool | None:
        if self.sched is None:
            return None
        with self.sched.lock:
            self.sched.tier.clear()
        return True
