"""A turn streamed straight from one engine (``kvtier ab --single-engine``): what is sent, and
the reuse read from the engine's own usage (``kvtier.ab.live.running.stream_turn``)."""

from __future__ import annotations

import json

import httpx

from kvtier.ab.live.running import stream_turn
from kvtier.ids import ReusePath


def _sse(*events: object) -> bytes:
    return b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events) + b"data: [DONE]\n\n"


def _client(body: bytes, seen: list[dict], headers: dict[str, str] | None = None
            ) -> httpx.Client:
    def handle(req: httpx.Request) -> httpx.Response:
        seen.append(json.loads(req.content))
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream",
                                                          **(headers or {})})
    return httpx.Client(base_url="http://engine", transport=httpx.MockTransport(handle))


def test_a_direct_turn_asks_for_usage_and_reports_the_engines_cached_tokens_as_local():
    body = _sse({"choices": [{"token_ids": [5, 6]}]}, {"choices": [{"token_ids": [7]}]},
                {"choices": [], "usage": {"prompt_tokens": 300, "completion_tokens": 3,
                                          "prompt_tokens_details": {"cached_tokens": 256}}})
    seen: list[dict] = []
    with _client(body, seen) as c:
        ids, reuse, first = stream_turn(c, "tiny", "conv", "conv:1", [1] * 300, 3, direct=True)
    assert ids == [5, 6, 7] and first is not None
    assert (reuse.path, reuse.tokens) == (ReusePath.LOCAL, 256)
    sent = seen[0]
    assert sent["stream_options"] == {"include_usage": True}
    assert "conversation_id" not in sent  # an engine is not a router


def test_a_direct_turn_without_cached_tokens_reused_nothing():
    for usage in ({"prompt_tokens": 10}, {"prompt_tokens_details": None},
                  {"prompt_tokens_details": {"cached_tokens": 0}}):
        seen: list[dict] = []
        body = _sse({"choices": [{"token_ids": [1]}]}, {"choices": [], "usage": usage})
        with _client(body, seen) as c:
            _, reuse, _ = stream_turn(c, "tiny", "c", "c:0", [1] * 10, 1, direct=True)
        assert (reuse.path, reuse.tokens) == (ReusePath.NONE, 0)


def test_through_a_router_the_turn_names_its_conversation_and_reads_the_routers_headers():
    seen: list[dict] = []
    body = _sse({"choices": [{"token_ids": [1]}]})
    with _client(body, seen, {"x-kvtier-reuse": "p2p; tokens=64",
                              "x-kvtier-outcome": "none"}) as c:
        _, reuse, _ = stream_turn(c, "tiny", "conv", "conv:1", [1] * 100, 1)
    assert seen[0]["conversation_id"] == "conv" and "stream_options" not in seen[0]
    assert (reuse.path, reuse.tokens) == (ReusePath.P2P, 64)
