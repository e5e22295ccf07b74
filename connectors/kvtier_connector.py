"""KVTierConnector: kvtier's host tier as a vLLM v1 KV connector.

A thin role dispatcher (STYLE rule 10): the connector parses
``kv_connector_extra_config`` once into ``kvtier.tier.config.HostTierConfig``, reads the KV
geometry off vLLM's ``KVCacheConfig``, builds one ``kvtier.tier.spec.HostTierSpec`` and asks
it for the half of its role: a ``TierScheduler`` (scheduler role: the HostTier manager,
events, peer server and client, metrics) or a ``TierWorker`` (worker role: byte copies
between vLLM's KV tensors and the shared host pool). Both halves open the same pool by
engine id.

Threading model: vLLM calls the scheduler-role methods from its scheduler thread and the
worker-role methods from the model runner thread; each half is single-threaded apart from
the peer server, see ``kvtier.tier.scheduler``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from kvtier.connectors import compat
from kvtier.tier.config import HostTierConfig
from kvtier.tier.ops import LoadOp, StoreOp
from kvtier.tier.scheduler import TierScheduler
from kvtier.tier.spec import HostTierSpec, KVGeometry, check_block_size
from kvtier.tier.worker import TierWorker
from kvtier.transfer_params import KVTransferParams

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

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


def kv_geometry(kv_cache_config: KVCacheConfig, block_size: int) -> KVGeometry:
    """The tier's geometry from vLLM's KV cache config (every group's layers, in order)."""
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
    return KVGeometry(block_size, slot, kv_cache_config.num_blocks, tuple(names), layout)


@compat.label_host_hits
class KVTierConnector(KVConnectorBase_V1):
    @property
    def requires_kv_delivery(self) -> bool:
        return False  # best-effort cache: a dropped store is a future miss

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = compat.kv_transfer_config(self)
        cfg = HostTierConfig.from_extra_config(ktc.kv_connector_extra_config).resolved(
            dict(os.environ))
        block_size = check_block_size(cfg, vllm_config.cache_config.block_size)
        tp_rank, tp_size = compat.tp_rank_size(vllm_config)
        self.spec = HostTierSpec(cfg, kv_geometry(kv_cache_config, block_size),
                                 engine_id=f"{ktc.engine_id}",
                                 engine_model=vllm_config.model_config.model,
                                 tp_rank=tp_rank, tp_size=tp_size)
        self.sched: TierScheduler | None = None
        self.worker: TierWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.sched = self.spec.get_scheduler()
        else:
            self.worker = self.spec.get_worker()
        s = self.spec
        log.info("KVTierConnector %s: %d slots x %d B, model %s, layout %s, pool %s", role.name,
                 s.num_slots, s.geometry.slot_bytes, s.model, s.geometry.layout, s.pool_tag)

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
            self.sched.close()

    # -- scheduler role ----------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.sched is not None
        params = KVTransferParams.from_wire(request.kv_transfer_params)
        if params is not None and params.remote_kv_source is not None:
            self.sched.pull_from_peer(params.remote_kv_source, request.all_token_ids,
                                      num_computed_tokens, request.cache_salt)
        n = self.sched.match(request.request_id, request.all_token_ids, num_computed_tokens,
                             request.cache_salt)
        return n, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        assert self.sched is not None
        block_ids = blocks.get_block_ids()[0] if num_external_tokens > 0 else []
        self.sched.after_alloc(request.request_id, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.sched is not None
        loads, stores = self.sched.take_ops()
        self.sched.publish()
        return TierMetadata(loads, stores)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        if self.sched is not None and isinstance(meta, TierWorkerMetadata):
            self.sched.worker_done(meta.stores_done, meta.loads_done)
            self.sched.publish()

    def request_finished(self, request: Request,
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
        self.sched.reset()
        return True
