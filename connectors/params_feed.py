"""KVTierNixlConnector: NixlConnector that publishes finished requests' params and leases
the blocks a decode node retains.

vLLM 0.32 puts ``kv_transfer_params`` only into non-streaming responses, so a router that
streams the decode leg to its client never learns which blocks the decode node retained for
the next turn (bidirectional mode). This thin subclass changes nothing in what NixlConnector
does; after ``request_finished`` (scheduler process) it also sends the params it returned,
with the request id and the request's token ids (prompt + generated), on a ZMQ PUB socket
(``kvtier.wire.params_feed``). The router subscribes and keeps them for the next turn.

Config (``kv_connector_extra_config``, next to NixlConnector's own keys)::

    "kv_connector": "KVTierNixlConnector",
    "kv_connector_module_path": "kvtier.connectors.params_feed",
    "kv_connector_extra_config": {"bidirectional_kv_xfer": true, ...,
                                  "params_feed_endpoint": "tcp://*:5590"}

Without ``params_feed_endpoint`` the port comes from ``KVTIER_PARAMS_FEED_PORT`` (bound on
all interfaces), else from ``params_feed_port_offset`` added to ``VLLM_NIXL_SIDE_CHANNEL_PORT``
(``configs/nixl-bidirectional-feed.json``: one file for every instance); with none of them,
nothing is published (logged once). Publishing never blocks
the scheduler: a full send queue (no subscriber keeping up) drops the message.

Decode-side leases (``decode_lease_s`` > 0 in the config): a finished turn whose blocks
NixlConnector retains for a next-turn read (bidirectional mode) is held under a lease
(``kvtier.leases.LeaseTable``) instead of for the whole ``decoder_kv_blocks_ttl``: the
deadline handed to vLLM's NIXL workers is the lease's (the request's own
``kvtier_decode_lease_s`` in its kv_transfer_params, else ``decode_lease_s``), the returned
params' ``remote_blocks_expiry_time`` says so (a prefill declines a read that would land
after it), and a router renews or releases leases by request id over ZMQ
(``kvtier.wire.leases``; endpoint ``lease_endpoint``, else ``tcp://*:$KVTIER_LEASE_PORT``,
else NIXL's side-channel port + ``lease_port_offset``). Renewed and released deadlines reach
the workers in the next step's metadata, the way vLLM sends the first one; the TTL stays the
upper bound. Lease metrics (``kvtier_decode_*``) are served on the lease port + 1.

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
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import zmq
from kvtier.connectors import compat
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from kvtier.leases import LeaseMetricsServer, LeaseServer, LeaseTable
from kvtier.wire import leases as lease_wire
from kvtier.wire.params_feed import ENDPOINT_KEY, OFFSET_KEY, PORT_ENV, FinishedParams

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.request import Request

log = logging.getLogger("kvtier.connectors.params_feed")

_NixlConnector: Any = compat.nixl_connector_class()
_SEND_HWM = 4096


class ParamsPublisher:
    """One PUB socket; ``publish`` never blocks and never raises."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self._sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUB)
        self._sock.setsockopt(zmq.SNDHWM, _SEND_HWM)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(endpoint)
        self.dropped = 0

    def publish(self, msg: FinishedParams) -> None:
        try:
            self._sock.send_multipart(msg.frames(), flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            self.dropped += 1

    def close(self) -> None:
        self._sock.close(0)


def feed_endpoint(extra: dict[str, Any], env: Mapping[str, str] | None = None,
                  keys: tuple[str, str, str] = (ENDPOINT_KEY, PORT_ENV, OFFSET_KEY)) -> str | None:
    """Where to bind: the config's endpoint, else ``tcp://*:$KVTIER_PARAMS_FEED_PORT``, else
    ``tcp://*:`` NIXL's side-channel port (``VLLM_NIXL_SIDE_CHANNEL_PORT``) plus
    ``params_feed_port_offset`` (one config file for every instance of a stack). ``keys``
    names the (config key, environment variable, offset key) to read: the lease server's
    endpoint is found the same way."""
    endpoint_key, port_env, offset_key = keys
    env = os.environ if env is None else env
    ep = extra.get(endpoint_key)
    if isinstance(ep, str) and ep:
        return ep
    port = env.get(port_env)
    if port:
        return f"tcp://*:{int(port)}"
    offset, side = extra.get(offset_key), env.get("VLLM_NIXL_SIDE_CHANNEL_PORT")
    if isinstance(offset, int) and side:
        return f"tcp://*:{int(side) + offset}"
    return None


LEASE_KEYS = (lease_wire.ENDPOINT_KEY, lease_wire.PORT_ENV, lease_wire.OFFSET_KEY)


def lease_seconds(extra: dict[str, Any]) -> float:
    """``decode_lease_s`` from the config: 0 (leases off) when absent; a clear error when
    it is not a non-negative number."""
    v = extra.get(lease_wire.LEASE_KEY, 0)
    if isinstance(v, bool) or not isinstance(v, int | float) or v < 0:
        raise ValueError(f"{lease_wire.LEASE_KEY} must be a number of seconds >= 0, not {v!r}")
    return float(v)


class KVTierNixlConnector(_NixlConnector):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._publisher: ParamsPublisher | None = None
        self._leases: LeaseTable | None = None
        self._lease_server: LeaseServer | None = None
        self._lease_metrics: LeaseMetricsServer | None = None
        if role == KVConnectorRole.SCHEDULER:
            cfg = vllm_config.kv_transfer_config
            extra = dict(cfg.kv_connector_extra_config or {}) if cfg is not None else {}
            self._start_leases(extra)
            ep = feed_endpoint(extra)
            if ep is None:
                log.warning("KVTierNixlConnector: no %s and no %s: finished-request params "
                            "are not published", ENDPOINT_KEY, PORT_ENV)
            else:
                self._publisher = ParamsPublisher(ep)
                log.info("KVTierNixlConnector publishes finished-request params on %s", ep)

    def _start_leases(self, extra: dict[str, Any]) -> None:
        lease_s = lease_seconds(extra)
        if not lease_s:
            return
        ep = feed_endpoint(extra, keys=LEASE_KEYS)
        if ep is None:
            raise ValueError(f"{lease_wire.LEASE_KEY} is set but the lease server has no "
                             f"address: set {lease_wire.ENDPOINT_KEY}, "
                             f"{lease_wire.OFFSET_KEY} or ${lease_wire.PORT_ENV}")
        self._leases = LeaseTable(lease_s)
        self._lease_server = LeaseServer(self._leases, ep)
        port = int(self._lease_server.endpoint.rsplit(":", 1)[1])
        pod = os.environ.get("KVTIER_POD_NAME", f"decode@{port}")
        self._lease_metrics = LeaseMetricsServer(self._leases, pod, port + 1)
        log.info("KVTierNixlConnector: decode leases of %.1f s, control on %s, metrics on "
                 ":%d", lease_s, self._lease_server.endpoint, port + 1)

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        delay, params = super().request_finished(request, block_ids)
        self._lease(request, delay, params, len(block_ids))
        self._publish(request, params)
        return delay, params

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...],
                                    ) -> tuple[bool, dict[str, Any] | None]:
        delay, params = super().request_finished_all_groups(request, block_ids)
        self._lease(request, delay, params, sum(len(g) for g in block_ids))
        self._publish(request, params)
        return delay, params

    def _lease(self, request: Request, delay: bool, params: dict[str, Any] | None,
               blocks: int) -> None:
        """Put a decode node's retained turn under a lease (see the module docstring)."""
        if self._leases is None or not delay or not params or not params.get("do_remote_decode"):
            return
        rid = str(request.request_id)
        pending = compat.nixl_pending_sends(self)
        bound = pending.get(rid)
        if bound is None:
            return
        asked = (request.kv_transfer_params or {}).get(lease_wire.PARAM_KEY)
        lease_s = float(asked) if isinstance(asked, int | float) and asked > 0 else None
        deadline = self._leases.grant(rid, blocks, bound, lease_s)
        pending[rid] = deadline
        params["remote_blocks_expiry_time"] = deadline

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        if self._leases is not None:
            updates = self._leases.take_updates()
            if updates:
                compat.nixl_pending_sends(self).update(updates)
        return super().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        super().update_connector_output(connector_output)
        if self._leases is not None and connector_output.finished_sending:
            self._leases.finished(connector_output.finished_sending)

    def shutdown(self) -> None:
        for part in (self._lease_server, self._lease_metrics):
            if part is not None:
                part.close()
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
