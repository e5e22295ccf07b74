"""Indexer configuration: parsed once, at the boundary, into frozen models.

Sources: a YAML/JSON file (``--config``) or CLI flags; both end up as one
``IndexerConfig``. ``--pod`` specs use the docs/INTERFACES.md syntax
``NAME=tcp://HOST:PORT[,replay=tcp://HOST:PORT][,p2p=HOST:PORT][,model=NAME][,topic=T]
[,stream=S]``. Renamed keys are accepted through ``_ALIASES``.

Pods with several streams: the same NAME given again is another event stream
of that pod (the engine's device events and its host tier's CPU events, or DP
ranks). Each stream is subscribed, sequenced and replayed on its own and is
stored in the index under its *stream id*: the pod name for a pod's first
stream, ``NAME#S`` for the others (``S`` from ``stream=``, else its position,
1, 2, ...). Queries merge a pod's streams back into one pod (``pod_of``).
Streams of one pod must agree on ``p2p`` and ``model`` where both name one.

Peer addresses are never defaulted: a pod's events, replay and p2p hosts come
from its spec, and ``${VAR}`` in a spec or config file is taken from the
environment (an unset variable is an error, not an empty host).

Threading model: immutable values, share freely.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvtier.ids import ModelName, PodId
from kvtier.reuse_gate import DEFAULT_MIN_CACHED_TOKEN_DELTA

_ENDPOINT = re.compile(r"^tcp://[^:/\s]+:\d{1,5}$")
_HOSTPORT = re.compile(r"^[^:/\s]+:\d{1,5}$")
_NAME = re.compile(r"^[A-Za-z0-9_.@-]{1,128}$")
_STREAM = re.compile(r"^[A-Za-z0-9_.@-]{1,64}$")
_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
STREAM_SEP = "#"   # never in a pod name: stream ids split unambiguously


def pod_of(stream_id: str) -> PodId:
    """The pod a stream id (an index holder name) belongs to."""
    return PodId(stream_id.partition(STREAM_SEP)[0])


def expand_env(text: str) -> str:
    """``${VAR}`` -> the environment's value; an unset variable is a ValueError."""
    def sub(m: re.Match[str]) -> str:
        v = os.environ.get(m.group(1))
        if v is None:
            raise ValueError(f"environment variable {m.group(1)} is not set (used in {text!r})")
        return v
    return _ENV.sub(sub, text)

# old or alternative key -> current key
_ALIASES = {"endpoint": "events", "events_endpoint": "events", "replay_endpoint": "replay",
            "p2p_address": "p2p", "served_model": "model"}


class PodSpec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: PodId
    events: str
    replay: str | None = None
    p2p: str | None = None
    model: ModelName | None = None   # None: the indexer's default_model
    topic: str = ""            # "" subscribes to every topic on that PUB
    stream: str | None = None  # None: the pod's first stream, or numbered by IndexerConfig

    @model_validator(mode="before")
    @classmethod
    def _aliases(cls, data: Any) -> Any:
        if isinstance(data, dict):
            data = {_ALIASES.get(k, k): expand_env(v) if isinstance(v, str) else v
                    for k, v in data.items()}
        return data

    @field_validator("stream")
    @classmethod
    def _stream(cls, v: str | None) -> str | None:
        if v is not None and not _STREAM.match(v):
            raise ValueError(f"stream name {v!r} must match {_STREAM.pattern}")
        return v

    @property
    def stream_id(self) -> PodId:
        """The name this stream's blocks are indexed under (``NAME`` or ``NAME#S``)."""
        return self.name if self.stream is None else PodId(f"{self.name}{STREAM_SEP}{self.stream}")

    @field_validator("name")
    @classmethod
    def _name(cls, v: PodId) -> PodId:
        if not _NAME.match(v):
            raise ValueError(f"pod name {v!r} must match {_NAME.pattern}")
        return v

    @field_validator("events", "replay")
    @classmethod
    def _endpoint(cls, v: str | None) -> str | None:
        if v is not None and not _ENDPOINT.match(v):
            raise ValueError(f"endpoint {v!r} must look like tcp://HOST:PORT")
        return v

    @field_validator("p2p")
    @classmethod
    def _p2p(cls, v: str | None) -> str | None:
        if v is not None and not _HOSTPORT.match(v):
            raise ValueError(f"p2p address {v!r} must look like HOST:PORT")
        return v

    @property
    def p2p_host_port(self) -> tuple[str, int] | None:
        if self.p2p is None:
            return None
        host, port = self.p2p.rsplit(":", 1)
        return host, int(port)

    @classmethod
    def parse(cls, spec: str) -> PodSpec:
        """``NAME=tcp://HOST:PORT[,key=value...]``."""
        name, sep, rest = expand_env(spec).partition("=")
        if not sep or not rest:
            raise ValueError(f"pod spec {spec!r} must be NAME=tcp://HOST:PORT[,key=value...]")
        parts = rest.split(",")
        fields: dict[str, Any] = {"name": name.strip(), "events": parts[0].strip()}
        for p in parts[1:]:
            k, sep, v = p.partition("=")
            if not sep:
                raise ValueError(f"pod spec option {p!r} must be key=value")
            fields[k.strip()] = v.strip()
        return cls.model_validate(fields)


class IndexerConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(8300, ge=0, le=65535)
    backend: str = "memory"            # "memory" or "redis://HOST:PORT[/DB]"
    redis_namespace: str = "kvtier"
    pods: tuple[PodSpec, ...] = ()
    default_model: ModelName = ModelName("default")
    block_size: int = Field(32, gt=0)
    hash_seed: int = 0
    max_keys: int = Field(2_000_000, gt=0)
    max_blocks_per_pod: int = Field(1_000_000, gt=0)
    max_lookup_tokens: int = Field(1 << 20, gt=0)
    # the one reuse gate's threshold (kvtier.reuse_gate), for /v1/source callers that name none
    min_cached_token_delta: int = Field(DEFAULT_MIN_CACHED_TOKEN_DELTA, ge=0)
    stale_after_s: float = Field(10.0, gt=0)  # all streams down that long: not a source
    apply_workers: int = Field(2, ge=1, le=64)
    replay_timeout_s: float = Field(3.0, gt=0)
    max_pending_batches: int = Field(100_000, gt=0)
    snapshot_path: str | None = None
    snapshot_interval_s: float = Field(0.0, ge=0)  # 0: only on shutdown

    @field_validator("backend")
    @classmethod
    def _backend(cls, v: str) -> str:
        if v != "memory" and not v.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"backend {v!r} must be 'memory' or a redis:// URL")
        return v

    @field_validator("pods")
    @classmethod
    def _streams(cls, pods: tuple[PodSpec, ...]) -> tuple[PodSpec, ...]:
        return number_streams(pods)

    def model_of(self, pod: PodSpec) -> ModelName:
        return pod.model or self.default_model

    def pods_by_name(self) -> dict[PodId, list[PodSpec]]:
        out: dict[PodId, list[PodSpec]] = {}
        for p in self.pods:
            out.setdefault(p.name, []).append(p)
        return out

    @classmethod
    def load(cls, path: str | Path, **overrides: Any) -> IndexerConfig:
        p = Path(path)
        text = p.read_text()
        if p.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text) or {}
        else:
            data = json.loads(text)
        if not isinstance(data, dict):
            # ValueError, not TypeError: callers report ValueError as a bad configuration.
            raise ValueError(f"{p}: top level must be a mapping")  # noqa: TRY004
        data = {k: expand_env(v) if isinstance(v, str) else v for k, v in data.items()}
        pods = data.get("pods") or []
        data["pods"] = [PodSpec.parse(x) if isinstance(x, str) else x for x in pods]
        data.update({k: v for k, v in overrides.items() if v is not None})
        return cls.model_validate(data)


def number_streams(pods: tuple[PodSpec, ...] | list[PodSpec],
                   existing: tuple[PodSpec, ...] = ()) -> tuple[PodSpec, ...]:
    """Give every repeated pod name a stream name (its position: 1, 2, ...) and check that
    the streams of one pod are distinct and agree on p2p and model. ``existing``: streams
    already running (a stream added at runtime must fit them); only ``pods`` are returned."""
    seen: dict[PodId, list[PodSpec]] = {}
    for p in existing:
        seen.setdefault(p.name, []).append(p)
    out: list[PodSpec] = []
    for p in pods:
        mine = seen.setdefault(p.name, [])
        if mine and p.stream is None:
            n = len(mine)
            taken = {q.stream for q in mine}
            while str(n) in taken:
                n += 1
            p = p.model_copy(update={"stream": str(n)})
        for q in mine:
            if q.stream_id == p.stream_id:
                raise ValueError(f"duplicate stream {p.stream_id!r} of pod {p.name!r}")
            if q.events == p.events:
                raise ValueError(f"pod {p.name!r} subscribes to {p.events} twice")
            for attr in ("p2p", "model"):
                a, b = getattr(q, attr), getattr(p, attr)
                if a is not None and b is not None and a != b:
                    raise ValueError(f"streams of pod {p.name!r} disagree on {attr}: "
                                     f"{a!r} vs {b!r}")
        mine.append(p)
        out.append(p)
    # A pod's p2p address and model, named by any of its streams, hold for all of them.
    for i, p in enumerate(out):
        fill = {attr: next((getattr(q, attr) for q in seen[p.name] if getattr(q, attr)), None)
                for attr in ("p2p", "model") if getattr(p, attr) is None}
        fill = {k: v for k, v in fill.items() if v is not None}
        if fill:
            out[i] = p.model_copy(update=fill)
    return tuple(out)
