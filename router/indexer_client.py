"""Async client for the kvtier indexer's HTTP API (docs/INTERFACES.md).

``POST /v1/route`` (``route``): from one hashing of the prompt, the cached prefix per pod (any
tier) and the best peer host tier to pull from, asked without a target pod: the indexer
returns its best candidate and the router gates it for the prefill it chooses
(``Route.source_for``, the one reuse gate ``kvtier.reuse_gate.gains_enough``), so a request
costs one indexer call even when its prefill leg is retried elsewhere. Request and answer
are the msgspec structs of ``kvtier.wire.indexer_api``.

Outcomes are values: ``route`` returns a ``Route`` or ``None`` and never raises; ``None``
means "indexer unavailable or answered garbage" and the router serves the request anyway
(and counts it).

Threading model: one instance per router app, used from its event loop; the
shared ``httpx.AsyncClient`` is the only state.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import httpx
import msgspec
from pydantic import ValidationError

from kvtier.ids import PodId
from kvtier.reuse_gate import gains_enough
from kvtier.transfer_params import RemoteKVSource
from kvtier.wire.indexer_api import RouteRequest, Source, decode_route

log = logging.getLogger(__name__)


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
        gains enough over what ``target`` holds on any tier (``gains_enough`` with
        ``min_delta``: at least that many tokens, and at least one)."""
        s = self.best
        if s is None or s.pod == target:
            return None
        if not gains_enough(s.matched_tokens - self.matched.get(target, 0), min_delta):
            return None
        try:
            return RemoteKVSource(pod=s.pod, host=s.p2p_host, port=s.p2p_port,
                                  num_tokens=s.matched_tokens, model=model,
                                  block_size=block_size)
        except ValidationError:
            return None


class IndexerClient:
    def __init__(self, url: str, client: httpx.AsyncClient, timeout_s: float):
        self.url = url.rstrip("/")
        self._client = client
        self._timeout = timeout_s

    async def route(self, model: str, token_ids: Sequence[int],
                    loads: Mapping[str, int] | None = None) -> Route | None:
        """Cached prefix per pod and the best peer source, from one call; None if the
        indexer is unavailable or answered garbage."""
        req = RouteRequest(model=model, token_ids=list(token_ids),
                           loads=dict(loads) if loads else None)
        try:
            r = await self._client.post(f"{self.url}/v1/route", content=msgspec.json.encode(req),
                                        timeout=self._timeout,
                                        headers={"content-type": "application/json"})
        except httpx.HTTPError as e:
            log.debug("indexer /v1/route failed: %r", e)
            return None
        if r.status_code != 200:
            log.debug("indexer /v1/route answered %d", r.status_code)
            return None
        try:
            reply = decode_route(r.content)
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
