"""The host tier's configuration, parsed once from ``kv_connector_extra_config``.

Keys follow vLLM's SimpleCPUOffloadConnector where they mean the same thing
(``cpu_bytes_to_use``, ``block_size``, ``offload_prompt_only``), with one
deliberate difference: ``offload_prompt_only`` defaults to **false**, because
in agentic multi-turn serving the next turn's prompt is this turn's prompt
*plus what the model generated*.

Renamed/alternative keys are accepted through ``ALIASES``.

Per-instance ports. One config file serves every instance of a stack, so the
ports of the tier's event PUB, replay ROUTER and peer side channel are not in
the file: ``resolved(env)`` takes them from the instance's environment, which
``kvtier.devstack.stack.InstanceSpec.env()`` fills (``KVTIER_TIER_EVENTS_PORT``,
``KVTIER_TIER_REPLAY_PORT``, ``KVTIER_P2P_PORT``, ``KVTIER_POD_NAME``, and
``KVTIER_METRICS_PORT`` for the tier's Prometheus endpoint). The
file only says *whether* the tier publishes events (``kv_events``) and serves
peers (``peer_fetch``). Precedence per port: explicit key in the file > env
var > ``*_port_offset`` (deprecated: ``VLLM_NIXL_SIDE_CHANNEL_PORT`` + offset;
an offset key also switches its feature on, as it used to).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

ENV_EVENTS_PORT = "KVTIER_TIER_EVENTS_PORT"
ENV_REPLAY_PORT = "KVTIER_TIER_REPLAY_PORT"
ENV_P2P_PORT = "KVTIER_P2P_PORT"
ENV_POD_NAME = "KVTIER_POD_NAME"
ENV_METRICS_PORT = "KVTIER_METRICS_PORT"

ALIASES = {
    "cpu_bytes": "cpu_bytes_to_use",
    "host_bytes": "cpu_bytes_to_use",
    "kv_events_endpoint": "events_endpoint",
    "kv_events_replay_endpoint": "replay_endpoint",
    "peer_port": "p2p_port",
    "peer_host": "p2p_host",
    "model_name": "model",
}


class HostTierConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    cpu_bytes_to_use: int = Field(default=256 << 20, gt=0)
    block_size: int | None = Field(default=None, ge=1)  # None: the engine's block size
    offload_prompt_only: bool = False
    # KV events of the host tier (vLLM wire format, medium "CPU"); None: off.
    events_endpoint: str | None = None
    replay_endpoint: str | None = None
    events_topic: str = "kvtier-cpu"
    # Switch the tier's KV events / peer server on with ports from the env
    # (see the module docstring). An explicit endpoint/port switches it on too.
    kv_events: bool = False
    peer_fetch: bool = False
    # Deprecated fallback: port = VLLM_NIXL_SIDE_CHANNEL_PORT + offset.
    events_port_offset: int | None = None
    replay_port_offset: int | None = None
    p2p_port_offset: int | None = None
    # Prometheus /metrics of the tier (kvtier.tier.metrics); served when a
    # port is known (metrics_port or KVTIER_METRICS_PORT) and metrics is on.
    metrics: bool = True
    metrics_port: int | None = Field(default=None, ge=0, le=65535)
    metrics_host: str = "127.0.0.1"
    events_buffer_steps: int = Field(default=10000, ge=1)
    # Peer fetch: where this instance serves its tier to peers; None: not served.
    p2p_host: str = "127.0.0.1"
    p2p_port: int | None = Field(default=None, ge=1, le=65535)
    # Identity checked in the peer handshake. None: taken from the engine.
    model: str | None = None
    hash_seed: int = 0
    pod: str | None = None
    # Pull from a peer only if it saves at least this many tokens.
    min_cached_token_delta: int = Field(default=1, ge=0)
    peer_timeout_s: float = Field(default=5.0, gt=0)
    lease_s: float = Field(default=30.0, gt=0)

    @model_validator(mode="before")
    @classmethod
    def _aliases(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        out = {}
        for k, v in data.items():
            out[ALIASES.get(k, k)] = v
        return out

    def resolved(self, env: Mapping[str, str]) -> "HostTierConfig":
        """Fill per-instance ports and the pod name from the instance's env.

        Raises ValueError when a feature is on but no port can be found for it.
        """
        base = env.get("VLLM_NIXL_SIDE_CHANNEL_PORT")

        def port(var: str, offset: int | None) -> int | None:
            if env.get(var):
                return int(env[var])
            if offset is not None and base is not None:
                return int(base) + offset
            return None

        upd: dict[str, Any] = {}
        if self.events_endpoint is None and (self.kv_events or self.events_port_offset is not None):
            p = port(ENV_EVENTS_PORT, self.events_port_offset)
            if p is None:
                raise ValueError(f"kv_events is on but neither events_endpoint nor "
                                 f"{ENV_EVENTS_PORT} gives the tier's event port")
            upd["events_endpoint"] = f"tcp://*:{p}"
        events_on = self.events_endpoint is not None or "events_endpoint" in upd
        if self.replay_endpoint is None and events_on:
            p = port(ENV_REPLAY_PORT, self.replay_port_offset)
            if p is not None:
                upd["replay_endpoint"] = f"tcp://*:{p}"
        if self.p2p_port is None and (self.peer_fetch or self.p2p_port_offset is not None):
            p = port(ENV_P2P_PORT, self.p2p_port_offset)
            if p is None:
                raise ValueError(f"peer_fetch is on but neither p2p_port nor {ENV_P2P_PORT} "
                                 f"gives the tier's peer port")
            upd["p2p_port"] = p
        if self.metrics and self.metrics_port is None and env.get(ENV_METRICS_PORT):
            upd["metrics_port"] = int(env[ENV_METRICS_PORT])
        if self.pod is None and env.get(ENV_POD_NAME):
            upd["pod"] = env[ENV_POD_NAME]
        return self.model_copy(update=upd) if upd else self

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> "HostTierConfig":
        """Parse the connector's extra config; keys of other connectors
        (a MultiConnector passes each child only its own) are refused."""
        return cls.model_validate(dict(extra or {}))
