"""The host tier's configuration, parsed once from ``kv_connector_extra_config``.

Keys follow vLLM's SimpleCPUOffloadConnector where they mean the same thing
(``cpu_bytes_to_use``, ``block_size``, ``offload_prompt_only``), with one
deliberate difference: ``offload_prompt_only`` defaults to **false**, because
in agentic multi-turn serving the next turn's prompt is this turn's prompt
*plus what the model generated*.

Renamed/alternative keys are accepted through ``ALIASES``.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

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
    # Per-instance ports when one config file serves several instances: the
    # port is VLLM_NIXL_SIDE_CHANNEL_PORT + offset (each instance of a stack
    # has its own side channel port). Explicit endpoints/ports win.
    events_port_offset: int | None = None
    replay_port_offset: int | None = None
    p2p_port_offset: int | None = None
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

    def resolved(self, env: dict[str, str]) -> "HostTierConfig":
        """Fill offset-based ports from the instance's NIXL side channel port."""
        base = env.get("VLLM_NIXL_SIDE_CHANNEL_PORT")
        if base is None:
            return self
        b = int(base)
        upd: dict[str, Any] = {}
        if self.events_endpoint is None and self.events_port_offset is not None:
            upd["events_endpoint"] = f"tcp://*:{b + self.events_port_offset}"
        if self.replay_endpoint is None and self.replay_port_offset is not None:
            upd["replay_endpoint"] = f"tcp://*:{b + self.replay_port_offset}"
        if self.p2p_port is None and self.p2p_port_offset is not None:
            upd["p2p_port"] = b + self.p2p_port_offset
        return self.model_copy(update=upd) if upd else self

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> "HostTierConfig":
        """Parse the connector's extra config; keys of other connectors
        (a MultiConnector passes each child only its own) are refused."""
        return cls.model_validate(dict(extra or {}))
