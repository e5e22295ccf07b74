"""Async client for the kvtier indexer's HTTP API (docs/INTERFACES.md).

``POST /v1/route`` -> both at once, from one hashing of the prompt (``route``): cached
prefix per pod and the best peer host tier; the router derives the source for the prefill
it chooses (``Route.source_for``), so a request costs one indexer call even when its
prefill leg is retried elsewhere. An indexer without ``/v1/route`` (404) is asked the two
older calls instead:
``POST /v1/lookup`` -> cached prefix length per pod (KV-aware choice).
``POST /v1/source`` -> a peer host tier to pull a prefix from (P2P).

Outcomes are values: every call returns a result or ``None`` and never raises;
``None`` means "indexer unavailable or answered garbage" and the router serves
the request anyway (and counts it). The answer shapes are parsed into frozen
models at this edge.

Threading model: one instance per router app, used from its event loop; the
shared ``httpx.AsyncClient`` is the only state.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import msgspec
from pydantic import BaseModel, ConfigDict, ValidationError

from kvtier.ids import PodId
from kvtier.transfer_params import RemoteKVSource
from kvtier.wire.indexer_api import RouteRequest, Source, decode_route

log = logging.getLogger(__name__)


class _Match(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")
    pod: str
    tier: str = "GPU"
    matched_tokens: int


class _LookupReply(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")
    block_size: int | None = None
    matches: list[_Match] = []


class _Source(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")
    pod: str
    tier: str = "CPU"
    matched_tokens: int
    p2p_host: str
    p2p_port: int


class _SourceReply(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")
    source: _Source | None = None
    target_matched_tokens: int = 0
    delta: int = 0


@dataclass(frozen=True)
class Route:
    """One ``/v1/route`` answer: cached prefix per pod (any tier) and the best peer host
    tier for a target that holds nothing."""

    matched: dict[PodId, int]
    best: Source | None
    # the longest prefix any host tier (CPU) holds, on any pod: whether a host copy survives
    host_tokens: int = 0

    def source_for(self, target: PodId, min_delta: int, model: str, block_size: int,
                   ) -> RemoteKVSource | None:
        """The peer ``target`` should pull from: the best source, when it is another pod and
        gains at least ``min_delta`` (and one) tokens over what ``target`` holds on any tier."""
        s = self.best
        if s is None or s.pod == target:
            return None
        if s.matched_tokens - self.matched.get(target, 0) < max(min_delta, 1):
            return None
        try:
            return RemoteKVSource(pod=s.pod, host=s.p2p_host, port=s.p2p_port,
                                  num_tokens=s.matched_tokens, model=model,
                                  block_size=block_size)
        except ValidationError:
            return None


_UNSUPPORTED = object()


class IndexerClient:
    def __init__(self, url: str, client: httpx.AsyncClient, timeout_s: float):
        self.url = url.rstrip("/")
        self._client = client
        self._timeout = timeout_s
        self.route_supported = True

    async def route(self, model: str, token_ids: Sequence[int], min_delta: int,
                    loads: Mapping[str, int] | None = None) -> Route | None:
        """Lookup and source from one call (see the module docstring); None if unavailable.
        Falls back to ``/v1/lookup`` + ``/v1/source`` when the indexer has no route call."""
        if self.route_supported:
            req = RouteRequest(model=model, token_ids=list(token_ids),
                               min_cached_token_delta=min_delta or None,
                               loads=dict(loads) if loads else None)
            raw = await self._post_raw("/v1/route", msgspec.json.encode(req))
            if raw is not _UNSUPPORTED:
                if raw is None:
                    return None
                try:
                    reply = decode_route(raw)  # type: ignore[arg-type]
                except (msgspec.ValidationError, msgspec.DecodeError):
                    return None
                matched: dict[PodId, int] = {}
                host = 0
                for m in reply.matches:
                    pod = PodId(m.pod)
                    matched[pod] = max(matched.get(pod, 0), m.matched_tokens)
                    if m.tier == "CPU":
                        host = max(host, m.matched_tokens)
                return Route(matched, reply.source, host)
            self.route_supported = False
            log.warning("indexer %s has no /v1/route: asking /v1/lookup and /v1/source", self.url)
        found = await self.lookup(model, token_ids)
        if found is None:
            return None
        raw_src = await self._post("/v1/source", {"model": model, "token_ids": list(token_ids)})
        best = None
        if raw_src is not None:
            try:
                s = _SourceReply.model_validate(raw_src).source
            except ValidationError:
                s = None
            if s is not None:
                best = Source(s.pod, "CPU", s.matched_tokens, s.p2p_host, s.p2p_port)
        # lookup's answer here is per pod, tiers merged: the best peer is the host copy seen
        return Route(found, best, best.matched_tokens if best is not None else 0)

    async def _post_raw(self, path: str, body: bytes) -> bytes | object | None:
        """The answer's bytes; ``_UNSUPPORTED`` for an unknown path; None when unavailable."""
        try:
            r = await self._client.post(f"{self.url}{path}", content=body, timeout=self._timeout,
                                        headers={"content-type": "application/json"})
        except httpx.HTTPError as e:
            log.debug("indexer %s failed: %r", path, e)
            return None
        if r.status_code in (404, 405):  # an indexer from before the route call
            return _UNSUPPORTED
        if r.status_code != 200:
            log.debug("indexer %s answered %d", path, r.status_code)
            return None
        return r.content

    async def _post(self, path: str, body: dict[str, object]) -> dict[str, Any] | None:
        try:
            r = await self._client.post(f"{self.url}{path}", json=body, timeout=self._timeout)
        except httpx.HTTPError as e:
            log.debug("indexer %s failed: %r", path, e)
            return None
        if r.status_code != 200:
            log.debug("indexer %s answered %d", path, r.status_code)
            return None
        try:
            out = r.json()
        except ValueError:
            return None
        return out if isinstance(out, dict) else None

    async def lookup(self, model: str, token_ids: Sequence[int]) -> dict[PodId, int] | None:
        """Longest cached prefix (tokens) per pod, any tier; None if unavailable."""
        raw = await self._post("/v1/lookup", {"model": model, "token_ids": list(token_ids)})
        if raw is None:
            return None
        try:
            reply = _LookupReply.model_validate(raw)
        except ValidationError:
            return None
        out: dict[PodId, int] = {}
        for m in reply.matches:
            pod = PodId(m.pod)
            out[pod] = max(out.get(pod, 0), m.matched_tokens)
        return out
