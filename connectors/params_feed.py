"""KVTierNixlConnector: NixlConnector that also publishes each finished request's params.

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

vLLM checks a few features by the connector *name* "NixlConnector" (decode context
parallelism, MLA, SSM state layout, routed experts, HiSparse); none applies to kvtier's
models, and this class is a NixlConnector for every ``isinstance`` check.

Threading model: ``request_finished`` runs on vLLM's scheduler thread; the socket is created
and used only there.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import zmq
from kvtier.connectors import compat
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

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


def feed_endpoint(extra: dict[str, Any], env: Mapping[str, str] | None = None) -> str | None:
    """Where to bind: the config's endpoint, else ``tcp://*:$KVTIER_PARAMS_FEED_PORT``, else
    ``tcp://*:`` NIXL's side-channel port (``VLLM_NIXL_SIDE_CHANNEL_PORT``) plus
    ``params_feed_port_offset`` (one config file for every instance of a stack)."""
    env = os.environ if env is None else env
    ep = extra.get(ENDPOINT_KEY)
    if isinstance(ep, str) and ep:
        return ep
    port = env.get(PORT_ENV)
    if port:
        return f"tcp://*:{int(port)}"
    offset, side = extra.get(OFFSET_KEY), env.get("VLLM_NIXL_SIDE_CHANNEL_PORT")
    if isinstance(offset, int) and side:
        return f"tcp://*:{int(side) + offset}"
    return None


class KVTierNixlConnector(_NixlConnector):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._publisher: ParamsPublisher | None = None
        if role == KVConnectorRole.SCHEDULER:
            cfg = vllm_config.kv_transfer_config
            extra = dict(cfg.kv_connector_extra_config or {}) if cfg is not None else {}
            ep = feed_endpoint(extra)
            if ep is None:
                log.warning("KVTierNixlConnector: no %s and no %s: finished-request params "
                            "are not published", ENDPOINT_KEY, PORT_ENV)
            else:
                self._publisher = ParamsPublisher(ep)
                log.info("KVTierNixlConnector publishes finished-request params on %s", ep)

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        delay, params = super().request_finished(request, block_ids)
        self._publish(request, params)
        return delay, params

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...],
                                    ) -> tuple[bool, dict[str, Any] | None]:
        delay, params = super().request_finished_all_groups(request, block_ids)
        self._publish(request, params)
        return delay, params

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
