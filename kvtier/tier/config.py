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
``kvtier.devstack.spec.InstanceSpec.env()`` fills (``KVTIER_TIER_EVENTS_PORT``,
``KVTIER_TIER_REPLAY_PORT``, ``KVTIER_P2P_PORT``, ``KVTIER_POD_NAME``, and
``KVTIER_METRICS_PORT`` for the tier's Prometheus endpoint; the names are one table,
``kvtier.tier.env.InstanceEnv``). The
file only says *whether* the tier publishes events (``kv_events``) and serves
peers (``peer_fetch``). Precedence per port: explicit key in the file > env
var > ``*_port_offset`` (deprecated: ``VLLM_NIXL_SIDE_CHANNEL_PORT`` + offset;
an offset key also switches its feature on, as it used to).

The peer address (multi-host). The peer server listens on ``p2p_host`` and that is the
address peers are given (the indexer's ``p2p=HOST:PORT`` for this pod must name it), so it
is this host's, not a constant of the file. ``resolved(env)`` takes it, when peer fetch is
on, from (first that gives one): ``p2p_host`` in the file > ``KVTIER_P2P_HOST`` > the
source address of this host's default route > this host name's address > the first up,
non-loopback interface's IPv4 address > ``127.0.0.1`` (with a warning: single-host dev
only). A detected address must be bindable here. A given value must be an IPv4 address or
a host name of *this* host (no scheme, port or wildcard; IPv6 is not supported by the side
channel); anything else is a ValueError naming where the value came from.
``kvtier stack up`` (one host) sets ``KVTIER_P2P_HOST=127.0.0.1``.
"""

from __future__ import annotations

import ipaddress
import logging
import re
import socket
import struct
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvtier.reuse_gate import DEFAULT_MIN_CACHED_TOKEN_DELTA
from kvtier.tier.env import InstanceEnv

log = logging.getLogger(__name__)

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
    # Peer fetch: the address this instance serves its tier on and peers are given.
    # None: KVTIER_P2P_HOST, else detected (module docstring); filled by resolved().
    p2p_host: str | None = None
    p2p_port: int | None = Field(default=None, ge=1, le=65535)
    # Identity checked in the peer handshake. None: taken from the engine.
    model: str | None = None
    hash_seed: int = 0
    pod: str | None = None
    # Pull from a peer only if it saves at least this many tokens (kvtier.reuse_gate).
    min_cached_token_delta: int = Field(default=DEFAULT_MIN_CACHED_TOKEN_DELTA, ge=0)
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

    def resolved(self, env: Mapping[str, str]) -> HostTierConfig:
        """Fill per-instance ports, the peer address and the pod name from the instance's env.

        Raises ValueError when a feature is on but no port can be found for it, or when a
        given peer host is not usable here (``check_p2p_host``).
        """
        base = env.get(InstanceEnv.NIXL_SIDE_CHANNEL_PORT)

        def port(var: str, offset: int | None) -> int | None:
            if env.get(var):
                return int(env[var])
            if offset is not None and base is not None:
                return int(base) + offset
            return None

        upd: dict[str, Any] = {}
        if self.events_endpoint is None and (self.kv_events or self.events_port_offset is not None):
            p = port(InstanceEnv.TIER_EVENTS_PORT, self.events_port_offset)
            if p is None:
                raise ValueError(f"kv_events is on but neither events_endpoint nor "
                                 f"{InstanceEnv.TIER_EVENTS_PORT} gives the tier's event port")
            upd["events_endpoint"] = f"tcp://*:{p}"
        events_on = self.events_endpoint is not None or "events_endpoint" in upd
        if self.replay_endpoint is None and events_on:
            p = port(InstanceEnv.TIER_REPLAY_PORT, self.replay_port_offset)
            if p is not None:
                upd["replay_endpoint"] = f"tcp://*:{p}"
        if self.p2p_port is None and (self.peer_fetch or self.p2p_port_offset is not None):
            p = port(InstanceEnv.P2P_PORT, self.p2p_port_offset)
            if p is None:
                raise ValueError(f"peer_fetch is on but neither p2p_port nor "
                                 f"{InstanceEnv.P2P_PORT} gives the tier's peer port")
            upd["p2p_port"] = p
        if self.p2p_port is not None or "p2p_port" in upd:
            host, how = resolve_p2p_host(self.p2p_host, env)
            log.info("kvtier peer server address %s (%s)", host, how)
            if host != self.p2p_host:
                upd["p2p_host"] = host
        if self.metrics and self.metrics_port is None and env.get(InstanceEnv.METRICS_PORT):
            upd["metrics_port"] = int(env[InstanceEnv.METRICS_PORT])
        if self.pod is None and env.get(InstanceEnv.POD_NAME):
            upd["pod"] = env[InstanceEnv.POD_NAME]
        return self.model_copy(update=upd) if upd else self

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> HostTierConfig:
        """Parse the connector's extra config; keys of other connectors
        (a MultiConnector passes each child only its own) are refused."""
        return cls.model_validate(dict(extra or {}))


# -- the peer address ------------------------------------------------------------------------

_HOSTNAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
                       r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?$")
# TEST-NET-3 (RFC 5737): not a network hosts live on, so the kernel picks the default route's
# source address for it; a UDP connect sends nothing.
_ROUTE_PROBE = "203.0.113.1"
LOOPBACK_FALLBACK = "127.0.0.1"


def resolve_p2p_host(value: str | None, env: Mapping[str, str]) -> tuple[str, str]:
    """The peer server's address and where it came from (the module docstring's order).

    ``value``: ``p2p_host`` from the file (None: not given). Raises ValueError for a bad
    given value; detection never raises."""
    if value is not None:
        return check_p2p_host(value, "p2p_host (kv_connector_extra_config)"), \
            "p2p_host in the config"
    if env.get(InstanceEnv.P2P_HOST):
        return check_p2p_host(env[InstanceEnv.P2P_HOST], InstanceEnv.P2P_HOST), InstanceEnv.P2P_HOST
    for how, detect in (("the default route's source address", route_address),
                        ("this host name's address", hostname_address),
                        ("a network interface's address", interface_address)):
        addr = detect()
        if addr is not None:
            return addr, f"detected: {how}; set {InstanceEnv.P2P_HOST} to choose another"
    log.warning("kvtier peer server: no non-loopback address found, using %s: peers on other "
                "hosts cannot reach it (set %s)", LOOPBACK_FALLBACK, InstanceEnv.P2P_HOST)
    return LOOPBACK_FALLBACK, \
        f"no other address found; single-host only (set {InstanceEnv.P2P_HOST})"


def check_p2p_host(value: str, where: str) -> str:
    """A given peer host -> the IPv4 address to listen on and advertise; ValueError saying
    what is wrong with it otherwise."""
    v = value.strip()
    bad = f"{where}={value!r}"
    if not v:
        raise ValueError(f"{bad}: empty; name this host's address or leave it unset to detect it")
    if "://" in v or "/" in v or any(c.isspace() for c in v):
        raise ValueError(f"{bad}: must be an IPv4 address or host name (no scheme, path or "
                         f"spaces), e.g. 10.0.0.5")
    if ":" in v:
        try:
            ipaddress.IPv6Address(v.strip("[]"))
        except ValueError:
            raise ValueError(f"{bad}: must be an address or host name without a port (the "
                             f"port is p2p_port / KVTIER_P2P_PORT)") from None
        raise ValueError(f"{bad}: IPv6 is not supported by the peer side channel; give this "
                         f"host's IPv4 address")
    try:
        ip: ipaddress.IPv4Address | None = ipaddress.IPv4Address(v)
    except ValueError:
        ip = None
    if ip is not None:
        if ip.is_unspecified:
            raise ValueError(f"{bad}: a wildcard address cannot be given to peers; name this "
                             f"host's address, or leave it unset to detect it")
        if ip.is_multicast or ip == ipaddress.IPv4Address("255.255.255.255"):
            raise ValueError(f"{bad}: not a unicast address")
        addr = v
    else:
        if all(p.isdigit() for p in v.split(".")):
            raise ValueError(f"{bad}: not a valid IPv4 address")
        if not _HOSTNAME.match(v):
            raise ValueError(f"{bad}: not a valid host name")
        try:
            addr = str(socket.getaddrinfo(v, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0])
        except (OSError, IndexError) as e:
            raise ValueError(f"{bad}: cannot resolve it to an IPv4 address ({e})") from None
    if not _bindable(addr):
        raise ValueError(f"{bad} ({addr}) is not an address of this host: the peer server "
                         f"listens on it. Name one of this host's addresses, or leave it unset "
                         f"to detect it")
    return addr


def _bindable(addr: str) -> bool:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((addr, 0))
    except OSError:
        return False
    return True


def _usable(addr: str) -> bool:
    try:
        ip = ipaddress.IPv4Address(addr)
    except ValueError:
        return False
    return not (ip.is_loopback or ip.is_unspecified or ip.is_link_local) and _bindable(addr)


def route_address() -> str | None:
    """This host's source address towards the default route; None without one."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((_ROUTE_PROBE, 9))
            addr = str(s.getsockname()[0])
    except OSError:
        return None
    return addr if _usable(addr) else None


def hostname_address() -> str | None:
    """The first address this host's name resolves to that is a usable one of this host."""
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET,
                                   socket.SOCK_STREAM)
    except OSError:
        return None
    for *_, sa in infos:
        if _usable(str(sa[0])):
            return str(sa[0])
    return None


def interface_address() -> str | None:
    """The IPv4 address of the first interface that is up and not loopback (Linux)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not Linux
        return None
    siocgifflags, siocgifaddr, iff_up, iff_loopback = 0x8913, 0x8915, 0x1, 0x8
    try:
        names = socket.if_nameindex()
    except OSError:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in names:
            req = struct.pack("256s", name.encode()[:15])
            try:
                flags = struct.unpack_from("H", fcntl.ioctl(s.fileno(), siocgifflags, req), 16)[0]
                if not flags & iff_up or flags & iff_loopback:
                    continue
                addr = socket.inet_ntoa(fcntl.ioctl(s.fileno(), siocgifaddr, req)[20:24])
            except OSError:
                continue
            if _usable(addr):
                return addr
    return None
