"""Server-sent events: re-emit a non-streaming OpenAI response as a stream.

vLLM 0.32 returns ``kv_transfer_params`` only in non-streaming responses, so a
streaming client in a tracked conversation is served by running the decode leg
non-streaming and replaying its answer here, in the chunk format vLLM itself
streams (``chat.completion.chunk`` / ``text_completion``), usage chunk included
when asked, terminated by ``data: [DONE]``.

``strip_params`` relays an engine's own stream with every ``kv_transfer_params`` taken out
(clients never see engine transfer params; the router may use them).

Threading model: pure functions (``strip_params``: one async generator per stream).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterator
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


_PARAMS = b"kv_transfer_params"
_FIELDS = (b"data:", b":", b"event:", b"id:", b"retry:")


class Garbage(Exception):
    """An engine's stream carried something that is not an SSE event."""


def first_event_problem(event: bytes) -> str | None:
    """What is wrong with a stream's first event (without its blank-line end), or None:
    it must be SSE with a ``data:`` line holding a JSON object that is not an error."""
    data = None
    for line in event.split(b"\n"):
        line = line.rstrip(b"\r")
        if not line.startswith(_FIELDS):
            return "not an SSE event"
        if line.startswith(b"data:"):
            data = line[5:].strip()
    if data is None:
        return "no data line"
    if data == b"[DONE]":
        return "stream ended before any answer"
    try:
        obj = json.loads(data)
    except ValueError:
        return "data is not JSON"
    if not isinstance(obj, dict):
        return "data is not a JSON object"
    if "error" in obj:
        return "error event"
    return None


async def strip_params(stream: AsyncIterator[bytes],
                       found: Callable[[dict[str, Any]], None]) -> AsyncIterator[bytes]:
    """Relay an engine's SSE stream with every ``kv_transfer_params`` (top level or in a
    choice) taken out and handed to ``found``.

    Yields the complete events each read brought, together (one write to the client per
    read, not per event; an engine streaming one token at a time is still relayed event by
    event); a partial event waits for its end. An event that mentions the key is parsed and
    rewritten, any other is relayed as it came. An event that does not start like SSE raises
    ``Garbage`` (nothing of it is relayed). A trailing partial event is relayed as is when
    the stream ends."""
    buf = b""
    async for chunk in stream:
        buf = buf + chunk if buf else chunk
        cut = buf.rfind(b"\n\n")
        if cut < 0:
            continue
        events, buf = buf[:cut + 2], buf[cut + 2:]
        if _PARAMS in events or b"\n\n" in events[:-2] or not events.startswith(_FIELDS):
            events = b"".join(_checked(e, found) for e in _split(events))
        yield events
    if buf.strip():
        yield _checked(buf, found)


def _split(events: bytes) -> list[bytes]:
    parts = events.split(b"\n\n")
    return [p + b"\n\n" for p in parts[:-1]]


def _checked(event: bytes, found: Callable[[dict[str, Any]], None]) -> bytes:
    if not event.startswith(_FIELDS):
        raise Garbage(event[:80].decode(errors="replace"))
    return _stripped(event, found) if _PARAMS in event else event


def _stripped(event: bytes, found: Callable[[dict[str, Any]], None]) -> bytes:
    out: list[bytes] = []
    for line in event.split(b"\n"):
        if line.startswith(b"data:") and _PARAMS in line:
            try:
                obj = json.loads(line[5:])
            except ValueError:
                # Not JSON, yet names the key: drop the line rather than leak it.
                continue
            if isinstance(obj, dict):
                _take(obj, found)
                for ch in obj.get("choices") or []:
                    if isinstance(ch, dict):
                        _take(ch, found)
            line = b"data: " + json.dumps(obj, separators=(",", ":")).encode()
        out.append(line)
    return b"\n".join(out)


def _take(obj: dict[str, Any], found: Callable[[dict[str, Any]], None]) -> None:
    kvp = obj.pop("kv_transfer_params", None)
    if isinstance(kvp, dict):
        found(kvp)


# ---- the Responses API's stream: named events, no [DONE] ---------------------------------
# The events that end a Responses stream (the response object in its final state).
RESPONSE_END_TYPES = frozenset({"response.completed", "response.incomplete", "response.failed"})


def strip_transfer_params(obj: Any) -> Any:
    """``obj`` without any ``kv_transfer_params`` key, at any depth."""
    if isinstance(obj, dict):
        return {k: strip_transfer_params(v) for k, v in obj.items() if k != "kv_transfer_params"}
    if isinstance(obj, list):
        return [strip_transfer_params(v) for v in obj]
    return obj


def clean_named_event(event: bytes) -> tuple[bytes, str | None, str | None]:
    """One Responses SSE event (without its blank-line end) with engine transfer params taken
    out, ended again; its type and, for ``response.created``, the response's id.

    The type comes from the ``event:`` line vLLM sends; a data line is parsed only when it
    names the params, is a ``response.created`` (the id), or the event had no ``event:``
    line (the type then comes from the data). A data line that names the params and is not
    JSON is dropped rather than leaked, as in chat streams (``strip_params``)."""
    kind: str | None = None
    rid: str | None = None
    out = []
    for line in event.split(b"\n"):
        if line.startswith(b"event:"):
            kind = line[6:].strip().decode(errors="replace") or None
        elif line.startswith(b"data:") and (_PARAMS in line or kind in (None, "response.created")):
            try:
                data = json.loads(line[5:])
            except ValueError:
                if _PARAMS in line:
                    continue
                out.append(line)
                continue
            if isinstance(data, dict):
                if isinstance(data.get("type"), str):
                    kind = data["type"]
                resp = data.get("response")
                if kind == "response.created" and isinstance(resp, dict) \
                        and isinstance(resp.get("id"), str):
                    rid = resp["id"]
                if _PARAMS in line:
                    line = b"data: " + json.dumps(strip_transfer_params(data),
                                                  separators=(",", ":")).encode()
        out.append(line)
    return b"\n".join(out) + b"\n\n", kind, rid


async def named_events(stream: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The events of an SSE stream, one by one, without their blank-line ends; a trailing
    partial event when the stream ends."""
    buf = b""
    async for chunk in stream:
        buf += chunk
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            if event.strip():
                yield event
    if buf.strip():
        yield buf


def responses_error_event(message: str) -> bytes:
    return (b"event: error\ndata: " + json.dumps({"type": "error", "message": message})
            .encode() + b"\n\n")
