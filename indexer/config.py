"""Indexer configuration: parsed once, at the boundary, into frozen models.

Sources: a YAML/JSON file (``--config``) or CLI flags; both end up as one
``IndexerConfig``. ``--pod`` specs use the docs/INTERFACES.md syntax
``NAME=tcp://HOST:PORT[,replay=tcp://HOST:PORT][,p2p=HOST:PORT][,model=NAME][,topic=T]``.
Renamed keys are accepted through ``_ALIASES``.

Threading model: immutable values, share freely.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvtier.ids import ModelName, PodId

_ENDPOINT = re.compile(r"^tcp://[^:/\s]+:\d{1,5}$")
_HOSTPORT = re.compile(r"^[^:/\s]+:\d{1,5}$")
_NAME = re.compile(r"^[A-Za-z0-9_.@-]{1,128}$")

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

    @model_validator(mode="before")
    @classmethod
    def _aliases(cls, data: Any) -> Any:
        if isinstance(data, dict):
            data = {_ALIASES.get(k, k): v for k, v in data.items()}
        return data

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
        name, sep, rest = spec.partition("=")
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
    min_cached_token_delta: int = Field(1, ge=0)
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

    @model_validator(mode="after")
    def _unique_pods(self) -> IndexerConfig:
        names = [p.name for p in self.pods]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"duplicate pod names: {sorted(dup)}")
        return self

    def model_of(self, pod: PodSpec) -> ModelName:
        return pod.model or self.default_model

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
        data = dict(data)
        pods = data.get("pods") or []
        data["pods"] = [PodSpec.parse(x) if isinstance(x, str) else x for x in pods]
        data.update({k: v for k, v in overrides.items() if v is not None})
        return cls.model_validate(data)
