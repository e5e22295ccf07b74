"""Async client for the kvtier indexer's HTTP API (docs/INTERFACES.md).

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
from collections.abc import Sequence
from typing import Any

import httpx
from pydantic import BaseModel, ConfigDict, ValidationError

from kvtier.ids import PodId
from kvtier.transfer_params import RemoteKVSource

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


class IndexerClient:
    def __init__(self, url: str, client: httpx.AsyncClient, timeout_s: float):
        self.url = url.rstrip("/")
        self._client = client
        self._timeout = timeout_s

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

    async def source(self, model: str, token_ids: Sequence[int], target: PodId,
                     min_delta: int, block_size: int) -> tuple[bool, RemoteKVSource | None]:
        """(answered, source): a peer to pull from for ``target``, if worth it."""
        body: dict[str, object] = {"model": model, "token_ids": list(token_ids),
                                   "target_pod": target}
        if min_delta:
            body["min_cached_token_delta"] = min_delta
        raw = await self._post("/v1/source", body)
        if raw is None:
            return False, None
        try:
            reply = _SourceReply.model_validate(raw)
        except ValidationError:
            return False, None
        s = reply.source
        if s is None or s.pod == target or s.matched_tokens <= 0:
            return True, None
        try:
            return True, RemoteKVSource(pod=s.pod, host=s.p2p_host, port=s.p2p_port,
                                        num_tokens=s.matched_tokens, model=model,
                                        block_size=block_size)
        except ValidationError:
            return True, None
