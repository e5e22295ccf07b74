"""What the flow hands the app for one request, and the small rules every answer follows.

``Reply`` is one answer (JSON or a stream of SSE bytes) with its log fields (``TurnLog``) and
its ``ReuseReport``; ``Refusal`` names why retained device KV was not read; ``clean_response``
takes engine-only fields out of an answer; ``tenant_of`` is the tenant of a bearer token.

Threading model: plain values and pure functions.
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

from kvtier.router.turn import TurnLog
from kvtier.wire.reuse_headers import ReuseReport


class Refusal:
    """Why a conversation's retained device KV was not read (the ``refusal`` log field)."""

    STALE = "stale"          # its decode node is gone, or the engine refused the params
    EXPIRED = "expired"      # retained past its TTL
    UNPROVEN = "unproven"    # the prompt does not start with its tokens (or was not tokenized)
    BELOW_THRESHOLD = "below_threshold"  # the cost model chose another path or recompute
    RELEASED = "released"    # its decode lease was released or ran out (router/retention.py)


@dataclass
class Reply:
    status: int = 200
    json: Any = None
    stream: AsyncIterator[bytes] | None = None
    log: TurnLog = field(default_factory=TurnLog)
    reuse: ReuseReport = field(default_factory=ReuseReport)


def tenant_of(api_key: str | None) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()[:16] if api_key else ""


def clean_response(resp: dict[str, Any], keep_ids: bool) -> None:
    """Never show clients the engines' transfer params (block ids, hosts), nor the token ids
    the router asked for and the client did not (``return_token_ids``; a Responses answer's
    ``input_messages`` / ``output_messages``)."""
    resp.pop("kv_transfer_params", None)
    if keep_ids:
        return
    resp.pop("prompt_token_ids", None)
    resp.pop("input_messages", None)
    resp.pop("output_messages", None)
    for ch in resp.get("choices") or []:
        if isinstance(ch, dict):
            ch.pop("token_ids", None)
            ch.pop("prompt_token_ids", None)


async def aiter_of(it: Iterator[bytes]) -> AsyncIterator[bytes]:
    for x in it:
        yield x


def raw_message_tokens(messages: Any) -> list[int] | None:
    """The token ids of a Responses answer's ``input_messages`` / ``output_messages``
    (vLLM's ``raw_message_tokens`` items, with ``enable_response_messages``)."""
    if not isinstance(messages, list) or not messages:
        return None
    out: list[int] = []
    for m in messages:
        toks = m.get("tokens") if isinstance(m, dict) else None
        if not isinstance(toks, list) or not all(isinstance(t, int) for t in toks):
            return None
        out.extend(toks)
    return out
