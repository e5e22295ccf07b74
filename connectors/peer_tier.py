"""kvtier's peer fetch as a secondary tier of vLLM's ``OffloadingConnector`` (CUDA).

vLLM's CPU offloading with ``"spec_name": "TieringOffloadingSpec"`` takes secondary tiers by
type name; ``kvtier.connectors.register`` (kvtier's ``vllm.general_plugins`` entry point) adds
``"kvtier-peer"``::

    {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
     "kv_connector_extra_config": {
        "spec_name": "KVTierTieringSpec", "spec_module_path": "kvtier.connectors.peer_tier",
        "cpu_bytes_to_use": ...,
        "offload_prompt_only": false,
        "secondary_tiers": [{"type": "kvtier-peer", "cpu_bytes_to_use": ...,
                             "min_cached_token_delta": 256}]}}

(``configs/vllm-offload-peer.json``; the port peers read from is ``p2p_port`` or
``KVTIER_P2P_PORT``, the address given to them ``p2p_host`` or ``KVTIER_P2P_HOST``.)

Everything kvtier does lives in ``kvtier.tier.secondary.PeerTier``; this class only turns
vLLM's calls into its calls (offload keys into kvtier's 64-bit keys, job fields by the vLLM
release's names through ``kvtier.connectors.compat``). The router names the peer in the
request's ``kv_transfer_params["remote_kv_source"]``, as it does for kvtier's own tier.

Both engines must derive the same block hashes: the same model and block size,
``--prefix-caching-hash-algo`` not a per-process seed (``sha256`` / ``sha256_cbor`` with the same
``PYTHONHASHSEED``). The handshake compares ``hash_label`` (``PYTHONHASHSEED`` unless the tier's
config sets it) and refuses a peer that differs.

Threading model: vLLM calls every method from its scheduler thread; ``PeerTier`` documents its
own threads.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Collection, Iterable
from typing import Any

import numpy as np
import xxhash
from vllm.v1.kv_offload.base import LookupResult, ReqContext, RequestOffloadingContext
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from kvtier.connectors import compat
from kvtier.ids import RequestKey
from kvtier.reuse_gate import DEFAULT_MIN_CACHED_TOKEN_DELTA
from kvtier.tier.env import InstanceEnv
from kvtier.tier.secondary import Found, PeerTier, PeerTierConfig
from kvtier.transfer_params import KVTransferParams

log = logging.getLogger(__name__)

TIER_TYPE = "kvtier-peer"
_RESULT = {Found.HIT: LookupResult.HIT, Found.MISS: LookupResult.MISS,
           Found.RETRY: LookupResult.RETRY}


def request_key(key: bytes) -> RequestKey:
    """kvtier's 64-bit key of a vLLM offload key (block hash + group index)."""
    return RequestKey(xxhash.xxh3_64_intdigest(bytes(key)))


class KVTierPeerTier(SecondaryTierManager):
    def __init__(self, offloading_spec: Any, primary_kv_view: memoryview, tier_type: str,
                 cpu_bytes_to_use: int, p2p_port: int | None = None,
                 p2p_host: str | None = None,
                 min_cached_token_delta: int = DEFAULT_MIN_CACHED_TOKEN_DELTA,
                 peer_timeout_s: float = 5.0, hash_label: int | None = None,
                 model: str | None = None, **kwargs: Any) -> None:
        # vLLM >= 0.30 passes a backpressure detector; 0.26 passes nothing more.
        super().__init__(offloading_spec, primary_kv_view, tier_type, **kwargs)
        # One config serves every instance: the port and address may come from the environment.
        if p2p_port is None and os.environ.get(InstanceEnv.P2P_PORT):
            p2p_port = int(os.environ[InstanceEnv.P2P_PORT])
        p2p_host = p2p_host or os.environ.get(InstanceEnv.P2P_HOST) or "127.0.0.1"
        rows = np.asarray(primary_kv_view, dtype=np.uint8)
        if rows.ndim != 2:
            rows = rows.reshape(len(primary_kv_view), -1)
        label = hash_label if hash_label is not None else int(
            os.environ.get("PYTHONHASHSEED", "0") or 0)
        cfg = PeerTierConfig(
            capacity_bytes=int(cpu_bytes_to_use), block_size=compat.offload_chunk_tokens(
                offloading_spec), model=model or compat.offload_model_name(offloading_spec),
            hash_label=label, host=p2p_host, port=p2p_port, peer_timeout_s=peer_timeout_s,
            min_cached_token_delta=min_cached_token_delta)
        self.core = PeerTier(rows, cfg)
        log.info("kvtier peer tier: %d blocks of %d B, serving on %s", self.core.tier.num_slots,
                 rows.shape[1], f"{p2p_host}:{p2p_port}" if p2p_port else "(pull only)")

    # -- vLLM's SecondaryTierManager ---------------------------------------------------------
    def lookup(self, key: Any, req_context: ReqContext) -> LookupResult:
        params = KVTransferParams.from_wire(req_context.kv_transfer_params)
        source = params.remote_kv_source if params is not None else None
        return _RESULT[self.core.lookup(req_context.req_id, request_key(key), source)]

    def submit_store(self, job_metadata: Any) -> None:
        keys, rows = compat.tier_job(job_metadata)
        self.core.store(job_metadata.job_id, [request_key(k) for k in keys], rows)

    def submit_load(self, job_metadata: Any) -> None:
        keys, rows = compat.tier_job(job_metadata)
        self.core.load(job_metadata.job_id, [request_key(k) for k in keys], rows)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        return [JobResult(job_id=j, success=ok) for j, ok in self.core.finished_jobs()]

    def has_pending_work(self) -> bool:
        return self.core.pending

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self.core.request_finished(req_context.req_id)

    def on_schedule_end(self, context: Any) -> None:
        self.core.schedule_end()

    def touch(self, keys: Collection[Any], req_context: ReqContext) -> None:
        return

    def drain_jobs(self) -> None:
        self.core.drain()

    def shutdown(self) -> None:
        self.core.close()


class KVTierTieringSpec(TieringOffloadingSpec):
    """vLLM's ``TieringOffloadingSpec`` as is, reachable by ``spec_module_path``: naming it
    (``"spec_name": "KVTierTieringSpec", "spec_module_path": "kvtier.connectors.peer_tier"``)
    imports this module, which registers ``"kvtier-peer"``, so the config works where kvtier is
    only on ``PYTHONPATH`` (no entry point) as well as installed."""


def _register() -> None:
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    try:
        SecondaryTierFactory.register_tier(TIER_TYPE, __name__, KVTierPeerTier.__name__)
    except ValueError:
        pass  # already registered (the entry point, or an earlier import)


_register()
