"""The indexer's own wire messages (HTTP API in docs/INTERFACES.md), as msgspec structs.

msgspec validates while it decodes (types, ranges, required fields) and
names the offending path in its error (``Expected `int`, got `str` - at
`$.token_ids[3]```), which the HTTP layer returns as a 4xx ``{"error": ...}``.

The router's side of ``POST /v1/route`` (one call per request: matches and
the best pull source from one hashing of the prompt; no target pod, so the
router gates the source for the prefill it chooses, ``kvtier.reuse_gate``)::

    body = msgspec.json.encode(RouteRequest(model=m, token_ids=ids, loads={"prefill-0": 3}))
    reply = decode_route((await http.post(url + "/v1/route", content=body)).content)

``/v1/lookup`` and ``/v1/source`` (``LookupRequest``, ``SourceRequest``) are the
indexer's other calls, for callers that want one half or name a target pod.

Threading model: immutable values.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

TokenId = Annotated[int, msgspec.Meta(ge=0, le=0xFFFFFFFF)]
PodName = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
InFlight = Annotated[int, msgspec.Meta(ge=0)]
ModelField = Annotated[str, msgspec.Meta(min_length=1, max_length=512)]


class LookupRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    model: ModelField
    token_ids: list[TokenId]


class Match(msgspec.Struct, frozen=True, gc=False):  # gc=False: str/int only, no cycles
    pod: str
    tier: Literal["GPU", "CPU"]
    matched_tokens: int


class LookupResponse(msgspec.Struct, frozen=True):
    block_size: int
    matches: list[Match]


class SourceRequest(msgspec.Struct, frozen=True):
    model: ModelField
    token_ids: list[TokenId]
    target_pod: PodName
    min_cached_token_delta: Annotated[int, msgspec.Meta(ge=0)] | None = None
    loads: dict[PodName, InFlight] | None = None  # in-flight requests per pod (absent: 0)


class Source(msgspec.Struct, frozen=True, gc=False):
    pod: str
    tier: Literal["CPU"]
    matched_tokens: int
    p2p_host: str
    p2p_port: int


class SourceResponse(msgspec.Struct, frozen=True):
    source: Source | None
    target_matched_tokens: int
    delta: int


class RouteRequest(msgspec.Struct, frozen=True, omit_defaults=True):
    """``POST /v1/route``: as ``SourceRequest``, ``target_pod`` optional (None: the source
    for a target that holds nothing)."""

    model: ModelField
    token_ids: list[TokenId]
    target_pod: PodName | None = None
    min_cached_token_delta: Annotated[int, msgspec.Meta(ge=0)] | None = None
    loads: dict[PodName, InFlight] | None = None


class RouteResponse(msgspec.Struct, frozen=True):
    """``/v1/lookup``'s ``block_size`` and ``matches`` plus ``/v1/source``'s fields."""

    block_size: int
    matches: list[Match]
    source: Source | None
    target_matched_tokens: int
    delta: int


_route_decoder = msgspec.json.Decoder(RouteResponse)


def decode_route(body: bytes) -> RouteResponse:
    """A ``/v1/route`` answer; ``msgspec.ValidationError``/``DecodeError`` on garbage."""
    return _route_decoder.decode(body)


class AddPodRequest(msgspec.Struct, frozen=True):
    """Either ``spec`` (the --pod syntax) or the fields of a PodSpec."""

    spec: str | None = None
    name: str | None = None
    events: str | None = None
    replay: str | None = None
    p2p: str | None = None
    model: str | None = None
    topic: str = ""
    stream: str | None = None  # set: add this stream to an existing pod
