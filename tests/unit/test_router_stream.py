"""Streaming that keeps reuse: the decode leg streams to the client event by event while D's
retained params arrive on the decode node's params feed (``KVTierNixlConnector``, faked
here by calling ``ParamsFeed.deliver`` as the feed's reader would); engine transfer params
never reach a client in any mode."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from kvtier.ids import PodId
from kvtier.router.app import create_app
from kvtier.router.config import RouterConfig
from kvtier.router.flow import Router
from kvtier.router.sse import Garbage, strip_params
from kvtier.wire.params_feed import FinishedParams, new_tag, tag_of
from tests.fakes.engine import BLOCK_SIZE, D_URL, GEN, P_URL, FakeEngines

PROMPT = list(range(1, 11))
COVERED = len(PROMPT) + len(GEN) - 1


class Stack:
    def __init__(self, client: TestClient, fake: FakeEngines) -> None:
        self.client, self.fake = client, fake
        self.router: Router = client.app.state.router  # type: ignore[attr-defined]

    def complete(self, prompt: list[int], conv: str | None = "c1", **extra: Any) -> Any:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 3, **extra}
        if conv is not None:
            body["conversation_id"] = conv
        return self.client.post("/v1/completions", json=body)

    def metric(self, name: str, **labels: str) -> float:
        return self.router.metrics.registry.get_sample_value(name, labels) or 0.0


def make(feed: bool = True, deliver: bool = True, **cfg: Any) -> Iterator[Stack]:
    fake = FakeEngines(stream_params=cfg.pop("stream_params", False))
    decode: dict[str, Any] = {"name": "decode-0", "url": D_URL}
    if feed:
        decode["params_feed"] = "tcp://127.0.0.1:9"  # never answers: messages come by hand
    config = RouterConfig.model_validate({
        "prefill": [P_URL], "decode": [decode], "log_json": False, "block_size": BLOCK_SIZE,
        **cfg})
    with TestClient(create_app(config, transport=fake, health_checks=False)) as c:
        s = Stack(c, fake)
        if deliver:
            fake.feed = lambda url, msg: s.router.feed.deliver(PodId("decode-0"), msg)
        yield s


def decode_calls(s: Stack) -> list[Any]:
    return [c for c in s.fake.completions(D_URL)]


def events(text: str) -> list[str]:
    return [e for e in text.split("\n\n") if e]


def test_streaming_is_the_default_and_relays_event_by_event() -> None:
    for s in make():
        r = s.complete(PROMPT, stream=True)
        assert r.status_code == 200
        ev = events(r.text)
        assert ev[-1] == "data: [DONE]"
        pieces = [json.loads(e[6:])["choices"][0]["text"] for e in ev[:-1]]
        assert pieces == ["a", "b", "c"]  # decode's own events, not one re-emitted answer
        d = decode_calls(s)[-1]
        assert d.body["stream"] is True and "return_token_ids" not in d.body
        assert len(s.router.store) == 1
        assert s.metric("kvtier_router_params_feed_total", result="received") == 1
        # the next turn reads what the feed said D retained
        r2 = s.complete([*PROMPT, *GEN, 7], stream=True)
        assert r2.headers["x-kvtier-reuse"] == f"dp_read; tokens={COVERED}"
        assert r2.headers["x-kvtier-outcome"] == "full"
        assert s.fake.prefills()[-1].kvp["remote_engine_id"] == "D"


def test_the_decode_leg_request_id_carries_a_tag_the_engine_id_keeps() -> None:
    tag = new_tag()
    assert tag_of(f"chatcmpl-abc123-{tag}-9f8e7d6c") == tag
    assert tag_of(f"cmpl-{tag}-0-1a2b3c4d") == tag
    assert tag_of("chatcmpl-plain-9f8e7d6c") is None


def test_params_no_leg_waits_for_are_counted_and_dropped() -> None:
    for s in make():
        s.router.feed.deliver(PodId("decode-0"), FinishedParams(f"cmpl-{new_tag()}-0-1a2b3c4d",
                                                                {}, (1, 2)))
        s.router.feed.deliver(PodId("decode-0"), FinishedParams("cmpl-untagged", {}, ()))
        assert s.metric("kvtier_router_params_feed_total", result="unmatched") == 2
        assert s.metric("kvtier_router_params_feed_total", result="received") == 0
        assert not s.router.feed._pending


def test_params_that_never_arrive_cost_a_bounded_wait_and_no_reuse() -> None:
    for s in make(deliver=False, params_wait_s=0.05):
        r = s.complete(PROMPT, stream=True)
        assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
        assert len(s.router.store) == 0
        assert s.metric("kvtier_router_params_feed_total", result="timeout") == 1
        assert not s.router.feed._pending  # nothing left waiting


def test_a_decode_node_without_a_feed_is_served_buffered() -> None:
    for s in make(feed=False):
        r = s.complete(PROMPT, stream=True)
        assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
        assert decode_calls(s)[-1].body["stream"] is False
        assert len(s.router.store) == 1


def test_a_feed_message_for_another_prompt_is_not_kept() -> None:
    for s in make(deliver=False):
        def wrong(url: str, msg: FinishedParams) -> None:
            s.router.feed.deliver(PodId("decode-0"), FinishedParams(
                msg.request_id, msg.kv_transfer_params, (999, *msg.token_ids[1:])))
        s.fake.feed = wrong
        assert s.complete(PROMPT, stream=True).status_code == 200
        assert len(s.router.store) == 0


@pytest.mark.parametrize("capture", ["stream", "buffered", "passthrough"])
@pytest.mark.parametrize("conv", ["named", None])
@pytest.mark.parametrize("stream", [True, False])
def test_engine_transfer_params_never_reach_a_client(capture: str, conv: str | None,
                                                     stream: bool) -> None:
    for s in make(stream_capture=capture, stream_params=True):
        for prompt in (PROMPT, [*PROMPT, *GEN, 7]):
            r = s.complete(prompt, conv=conv, stream=stream)
            assert r.status_code == 200
            assert "kv_transfer_params" not in r.text and "remote_block_ids" not in r.text
        r = s.complete(PROMPT, conv=conv, stream=stream, n=2)  # direct mode
        assert r.status_code == 200 and "kv_transfer_params" not in r.text


def test_params_an_engine_streams_are_counted_and_stripped() -> None:
    for s in make(stream_capture="passthrough", stream_params=True):
        r = s.complete(PROMPT, stream=True)
        assert "kv_transfer_params" not in r.text
        assert [json.loads(e[6:])["choices"][0]["text"] for e in events(r.text)[:-1]] \
            == ["a", "b", "c"]
        assert s.metric("kvtier_router_params_in_stream_total") == 1


async def _chunks(*parts: bytes) -> AsyncIterator[bytes]:
    for p in parts:
        yield p


def test_strip_params_cuts_events_across_chunks() -> None:
    asyncio.run(_strip_params_cuts_events_across_chunks())


async def _strip_params_cuts_events_across_chunks() -> None:
    ev1 = b'data: {"choices":[{"text":"a"}]}\n\n'
    ev2 = b'data: {"choices":[{"text":"b","kv_transfer_params":{"x":1}}],' \
          b'"kv_transfer_params":{"y":2}}\n\n'
    raw = ev1 + ev2 + b"data: [DONE]\n\n"
    found: list[dict[str, Any]] = []
    out = [e async for e in strip_params(_chunks(raw[:7], raw[7:50], raw[50:]), found.append)]
    # What each read completed goes out together: ev1 after the second read, then the rest.
    assert out[0] == ev1 and out[-1].endswith(b"\n\ndata: [DONE]\n\n")
    events = b"".join(out).split(b"\n\n")
    assert json.loads(events[1][6:]) == {"choices": [{"text": "b"}]}
    assert sorted(found, key=str) == [{"x": 1}, {"y": 2}]
    # Garbage after a sane event, in one read with it: nothing of it is relayed.
    with pytest.raises(Garbage):
        [e async for e in strip_params(_chunks(ev1 + b"<html>\n\n"), found.append)]


def test_without_a_feed_an_unnamed_stream_stays_a_stream() -> None:
    for s in make(feed=False):
        r = s.complete(PROMPT, conv=None, stream=True)
        assert r.status_code == 200 and len(events(r.text)) == 4
        assert decode_calls(s)[-1].body["stream"] is True
        assert len(s.router.store) == 0


def test_a_streamed_responses_turn_keeps_reuse_through_the_feed() -> None:
    """The Responses API streamed through P/D: decode's own named events relayed as they
    come (the closing one held until D's params arrived on the feed and were retained), the
    leg's request id carries the feed tag, and the next turn reads D's KV."""
    for s in make():
        turn1 = [{"role": "user", "content": "a streamed responses conversation"}]
        with s.client.stream("POST", "/v1/responses", json={
                "model": "tiny", "input": turn1, "stream": True, "conversation_id": "rs"}) as r:
            assert r.status_code == 200
            text = "".join(r.iter_text())
        kinds = [line[7:] for line in text.splitlines() if line.startswith("event: ")]
        assert kinds == ["response.created", *["response.output_text.delta"] * 3,
                         "response.completed"]
        assert "kv_transfer_params" not in text
        leg = [c for c in s.fake.calls if c.path == "/v1/responses" and c.url == D_URL][-1]
        assert leg.body["stream"] is True and tag_of(leg.body["request_id"]) is not None
        assert len(s.router.store) == 1
        rid = json.loads(text.split("data: ", 1)[1].split("\n", 1)[0])["response"]["id"]
        assert s.client.get(f"/v1/responses/{rid}").status_code == 200  # affinity
        turn2 = [*turn1, {"role": "user", "content": "next"}]
        r2 = s.client.post("/v1/responses", json={"model": "tiny", "input": turn2,
                                                  "stream": True, "conversation_id": "rs"})
        assert r2.headers["x-kvtier-reuse"].startswith("dp_read; tokens=")


def test_a_streamed_responses_turn_without_a_feed_is_relayed_without_reuse() -> None:
    for s in make(feed=False):
        turn1 = [{"role": "user", "content": "no feed on this decode node"}]
        r = s.client.post("/v1/responses", json={"model": "tiny", "input": turn1,
                                                 "stream": True, "conversation_id": "nf"})
        assert r.status_code == 200 and r.text.count("event: response.output_text.delta") == 3
        assert len(s.router.store) == 0


def test_a_responses_stream_cut_before_its_end_says_so() -> None:
    for s in make():
        s.fake.fail(D_URL, "cut")
        r = s.client.post("/v1/responses", json={"model": "tiny", "input": "x",
                                                 "stream": True, "conversation_id": "cut"})
        assert r.status_code == 200
        assert "event: error" in r.text and "ended the stream early" in r.text


def test_a_streamed_responses_turn_whose_prefill_fails_is_served_whole_on_decode() -> None:
    """No prefill answers: the request is served on the decode instance (direct), and its
    Responses stream is relayed as Responses events, not judged by chat's [DONE] rule."""
    for s in make():
        s.fake.fail(P_URL, 503, 503, 503, 503)
        r = s.client.post("/v1/responses", json={"model": "tiny", "input": "x",
                                                 "stream": True, "conversation_id": "d"})
        assert r.status_code == 200
        kinds = [line[7:] for line in r.text.splitlines() if line.startswith("event: ")]
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed", r.text
        assert "error" not in r.text and "[DONE]" not in r.text, r.text
        assert s.metric("kvtier_router_retries_total", leg="prefill", action="recompute") == 1
