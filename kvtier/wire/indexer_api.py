"""The indexer's own wire messages (HTTP API in docs/INTERFACES.md), as msgspec structs.

msgspec validates while it decodes (types, ranges, required fields) and
names the offending path in its error (``Expected `int`, got `str` - at
`$.token_ids[3]```), which the HTTP layer returns as a 4xx ``{"error": ...}``.

Threading model: immutable values.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

TokenId = Annotated[int, msgspec.Meta(ge=0, le=0xFFFFFFFF)]
PodName = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
ModelField = Annotated[str, msgspec.Meta(min_length=1, max_length=512)]


class LookupRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    model: ModelField
    token_ids: list[TokenId]


class Match(msgspec.Struct, frozen=True):
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


class Source(msgspec.Struct, frozen=True):
    pod: str
    tier: Literal["CPU"]
    matched_tokens: int
    p2p_host: str
    p2p_port: int


class SourceResponse(msgspec.Struct, frozen=True):
    source: Source | None
    target_matched_tokens: int
    delta: int


class AddPodRequest(msgspec.Struct, frozen=True):
    """Either ``spec`` (the --pod syntax) or the fields of a PodSpec."""

    spec: str | None = None
    name: str | None = None
    events: str | None = None
    replay: str | None = None
    p2p: str | None = None
    model: str | None = None
    topic: str = ""
