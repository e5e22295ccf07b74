"""CostAwareConnector: a MultiConnector that picks the load path by expected cost.

vLLM's MultiConnector loads from the *first* child (config order) that offers
any tokens. That is the wrong choice whenever a later child is cheaper: e.g.
the local host tier holds turn 1's prompt (a memcpy away) while
NixlConnector offers prompt + a few generated tokens from another host (a
NIXL handshake and transfer away). This connector asks every child, as
MultiConnector does, and then lets ``kvtier.cost.decide.decide`` (the decision the router
and the simulator make too) pick the child (or plain recompute) with the lowest expected
time; ties go to recompute, then to the child listed first. Everything else
(saving to all children, merging ``kv_transfer_params``, async-save
bookkeeping, releasing the children that were not chosen through
``update_state_after_alloc(..., 0)``) is MultiConnector's.

Config: MultiConnector's ``kv_connector_extra_config`` plus a ``cost`` table
parsed once into ``kvtier.cost.config.CostConfig`` (one ``paths`` entry per
child, in the same order). Preferred: the cost model ``kvtier calibrate --out
cost.json`` fitted, with the read path each child stands for::

    "kv_connector_extra_config": {
      "connectors": [{...NixlConnector...}, {...KVTierConnector...}],
      "cost": {"fitted": "/etc/kvtier/cost.json", "paths": ["dp_read", "p2p"]}

(a relative name is looked up in the working directory, then in kvtier's ``configs/``;
``configs/costaware-calibrated.json`` names the shipped ``configs/cost-tiny.json``)
    }

or a flat hand-written table (recompute linear in tokens)::

      "cost": {"recompute_tokens_per_s": 20000,
               "paths": [{"setup_s": 0.005, "bandwidth_bytes_per_s": 4e9},
                         {"setup_s": 0.0005, "bandwidth_bytes_per_s": 7e9}]}

``bytes_per_token`` defaults to the engine's KV bytes per token (all layers).

Start vLLM with ``--disable-hybrid-kv-cache-manager``: vLLM decides whether
the hybrid KV cache manager may stay on from the connector *class*, and
special-cases only the name "MultiConnector" (whose HMA support depends on
its children); a subclass inherits ``SupportsHMA`` and so looks HMA-capable
even when a child (KVTierConnector) is not. The constructor says so instead
of failing on MultiConnector's bare assertion.

Threading model: MultiConnector's (scheduler-role methods on vLLM's
scheduler thread, worker-role methods on the model runner thread).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

from kvtier.connectors import compat
from kvtier.cost.config import CostConfig
from kvtier.cost.decide import Decision, Offer, decide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


def kv_bytes_per_token(kv_cache_config: KVCacheConfig, block_size: int) -> int:
    per_block = sum(g.kv_cache_spec.page_size_bytes * len(g.layer_names)
                    for g in kv_cache_config.kv_cache_groups)
    return max(1, per_block // block_size)


class CostAwareConnector(MultiConnector):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig):
        ktc = vllm_config.kv_transfer_config
        if (not vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
                and not MultiConnector.all_children_support_hma(ktc)):
            raise ValueError(
                "CostAwareConnector: a child connector does not support the hybrid KV cache "
                "manager; start vLLM with --disable-hybrid-kv-cache-manager")
        super().__init__(vllm_config, role, kv_cache_config)
        extra = ktc.kv_connector_extra_config
        if "cost" not in extra:
            raise ValueError("CostAwareConnector needs kv_connector_extra_config.cost "
                             "(fitted + paths, or recompute_tokens_per_s + paths; one paths "
                             "entry per child)")
        cost = CostConfig.model_validate(extra["cost"])
        if len(cost.paths) != len(self.sub_connectors):
            raise ValueError(f"cost.paths has {len(cost.paths)} entries for "
                             f"{len(self.sub_connectors)} connectors; give one per child")
        self.cost = cost.with_bytes_per_token(
            kv_bytes_per_token(kv_cache_config, vllm_config.cache_config.block_size))
        self.last_choice: Decision | None = None  # for logs and tests of the adapter

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        offers: list[tuple[int, bool]] = []
        for c in self.sub_connectors:
            toks, load_async = c.get_num_new_matched_tokens(request, num_computed_tokens)
            if toks is None:  # a child is still looking: ask again next step
                return None, False
            offers.append((toks, load_async))
        model, names = self.cost.resolved()
        choice = decide(request.num_tokens, [Offer(n, t) for n, (t, _) in zip(names, offers)],
                        local_tokens=num_computed_tokens, cost=model)
        self.last_choice = choice
        if choice.index is None:
            return 0, False
        # MultiConnector's per-request routing table: update_state_after_alloc
        # and get_external_cache_hit_sources consult it.
        compat.route_to_child(self, request.request_id, choice.index)
        if sum(t > 0 for t, _ in offers) > 1:
            log.debug("kvtier cost-aware: req %s offers %s -> child %s (%.1f ms vs recompute "
                      "%.1f ms)", request.request_id, [t for t, _ in offers], choice.index,
                      (choice.expected_s or 0.0) * 1e3, (choice.recompute_s or 0.0) * 1e3)
        return offers[choice.index]
