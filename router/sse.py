"""Server-sent events: re-emit a non-streaming OpenAI response as a stream.

vLLM 0.32 returns ``kv_transfer_params`` only in non-streaming responses, so a
streaming client in a tracked conversation is served by running the decode leg
non-streaming and replaying its answer here, in the chunk format vLLM itself
streams (``chat.completion.chunk`` / ``text_completion``), usage chunk included
when asked, terminated by ``data: [DONE]``.

Threading model: pure functions.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


def error_event(message: str, code: int = 502) -> bytes:
    return _event({"error": {"message": message, "type": "upstream_error", "code": code}})


def chat_events(resp: dict[str, Any], include_usage: bool) -> Iterator[bytes]:
    base = {"id": resp.get("id"), "object": "chat.completion.chunk",
            "created": resp.get("created"), "model": resp.get("model")}
    for ch in resp.get("choices", []):
        msg = ch.get("message") or {}
        idx = ch.get("index", 0)
        yield _event({**base, "choices": [{"index": idx, "delta": {"role": msg.get("role",
                      "assistant"), "content": ""}, "logprobs": None, "finish_reason": None}]})
        delta: dict[str, Any] = {}
        for k in ("content", "reasoning_content", "reasoning", "tool_calls"):
            if msg.get(k):
                delta[k] = msg[k]
        if delta:
            yield _event({**base, "choices": [{"index": idx, "delta": delta,
                          "logprobs": ch.get("logprobs"), "finish_reason": None}]})
        final = {"index": idx, "delta": {}, "logprobs": None,
                 "finish_reason": ch.get("finish_reason"), "stop_reason": ch.get("stop_reason")}
        if "token_ids" in ch:
            final["token_ids"] = ch["token_ids"]
        yield _event({**base, "choices": [final]})
    if include_usage and resp.get("usage") is not None:
        yield _event({**base, "choices": [], "usage": resp["usage"]})
    yield DONE


def completion_events(resp: dict[str, Any], include_usage: bool) -> Iterator[bytes]:
    base = {"id": resp.get("id"), "object": "text_completion",
            "created": resp.get("created"), "model": resp.get("model")}
    for ch in resp.get("choices", []):
        c = {"index": ch.get("index", 0), "text": ch.get("text", ""),
             "logprobs": ch.get("logprobs"), "finish_reason": ch.get("finish_reason"),
             "stop_reason": ch.get("stop_reason")}
        if "token_ids" in ch:
            c["token_ids"] = ch["token_ids"]
        yield _event({**base, "choices": [c]})
    if include_usage and resp.get("usage") is not None:
        yield _event({**base, "choices": [], "usage": resp["usage"]})
    yield DONE
