"""What a client can make the router send to an engine: an allow-list of headers, and none of
its own KV params. Fuzzed over header names and values, body fields, both legs, streaming and
not, the direct (single-instance) path and the tokenize call."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.router.app import create_app
from kvtier.router.config import RouterConfig
from tests.fakes.engine import BLOCK_SIZE, D_URL, GEN, P_URL, FakeEngines

EVIL = "6.6.6.6:6666"
CLIENT_RID = "client-chosen-request-id"
ALLOWED = {"content-type", "x-request-id", "traceparent", "tracestate", "authorization",
           # httpx's own transport headers
           "host", "accept", "accept-encoding", "connection", "user-agent", "content-length"}
KV_HEADERS = ["x-kv-cache-source-host-port", "x-prefiller-host-port", "x-kv-source",
              "x-kvtier-source", "x-remote-kv-source", "x-decoder-host-port",
              "x-data-parallel-rank", "x-kv-transfer-params", "cookie", "x-forwarded-for",
              "x-conversation-id", "x-session-id"]
EVIL_PARAMS = {"do_remote_prefill": True, "remote_host": "6.6.6.6", "remote_port": 6666,
               "remote_engine_id": "evil", "remote_block_ids": [[1, 2]],
               "remote_request_id": "evil", "remote_kv_source": {"host": "6.6.6.6"}}
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def make(fake: FakeEngines, **cfg: Any) -> TestClient:
    config = RouterConfig.model_validate({
        "prefill": [P_URL], "decode": [D_URL], "log_json": False, "block_size": BLOCK_SIZE,
        **cfg})
    return TestClient(create_app(config, transport=fake, health_checks=False))


@pytest.fixture()
def fake() -> FakeEngines:
    return FakeEngines()


@pytest.fixture()
def client(fake: FakeEngines) -> Iterator[TestClient]:
    with make(fake, engine_api_key="engine-secret", api_keys=["sk-client"]) as c:
        yield c


def assert_clean(fake: FakeEngines, client_headers: dict[str, str], rid: str | None = None,
                 ) -> None:
    assert fake.calls, "no engine was called"
    rids = set()
    for call in fake.calls:
        extra = set(call.headers) - ALLOWED
        assert not extra, f"{call.path} on {call.url} got client headers {extra}"
        assert EVIL not in json.dumps(call.headers), call.headers
        assert b"6.6.6.6" not in call.raw and b"evil" not in call.raw, call.raw[:300]
        assert call.headers.get("authorization") == "Bearer engine-secret"
        rid_sent = call.headers["x-request-id"]
        assert CLIENT_RID not in rid_sent
        rids.add(rid_sent.split("-")[0])
        if "traceparent" in {k.lower() for k in client_headers}:
            assert call.headers.get("traceparent") == TRACEPARENT
    assert len(rids) == 1, f"one router request id for every leg of one request: {rids}"
    if rid is not None:
        assert rids == {rid}


def evil_headers() -> dict[str, str]:
    h = {k: EVIL for k in KV_HEADERS}
    h.update({"X-Request-Id": CLIENT_RID, "traceparent": TRACEPARENT,
              "authorization": "Bearer sk-client"})
    return h


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("mode", ["pd", "direct", "chat"])
def test_kv_source_header_and_params_never_reach_an_engine(
        fake: FakeEngines, client: TestClient, stream: bool, mode: str) -> None:
    """The issue's case: `x-kv-cache-source-host-port: 6.6.6.6:6666` reached both legs."""
    if mode == "chat":
        path = "/v1/chat/completions"
        body: dict[str, Any] = {"model": "tiny", "conversation_id": "c",
                                "messages": [{"role": "user", "content": "hello there"}]}
    else:
        path = "/v1/completions"
        body = {"model": "tiny", "prompt": list(range(1, 11)), "conversation_id": "c"}
        if mode == "direct":
            body["n"] = 2  # served on one instance
    body.update({"max_tokens": 3, "stream": stream, "kv_transfer_params": EVIL_PARAMS})
    r = client.post(path, json=body, headers=evil_headers())
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] != CLIENT_RID
    assert_clean(fake, evil_headers(), r.headers["x-request-id"])
    if mode != "direct":
        assert any(c.is_prefill for c in fake.calls)  # both legs were looked at
        assert any(c.url == D_URL for c in fake.calls)
    if mode == "chat" and not stream:
        # The next turn proves its prefix: the tokenize call gets the same treatment.
        fake.calls.clear()
        r = client.post(path, json=body, headers=evil_headers())
        assert r.status_code == 200
        assert any(c.path == "/tokenize" for c in fake.calls)
        assert_clean(fake, evil_headers(), r.headers["x-request-id"])


def test_second_turn_and_decode_feed_tag_keep_the_routers_id(fake: FakeEngines) -> None:
    """The decode leg's x-request-id carries the params-feed tag after the router's id."""
    decode = {"name": "decode-0", "url": D_URL, "params_feed": "tcp://127.0.0.1:9"}
    with make(fake, decode=[decode], engine_api_key="engine-secret") as c:
        router = c.app.state.router  # type: ignore[attr-defined]
        fake.feed = lambda url, msg: router.feed.deliver("decode-0", msg)
        body = {"model": "tiny", "prompt": list(range(1, 11)), "max_tokens": 3, "stream": True}
        r = c.post("/v1/completions", json=body, headers=evil_headers())
        assert r.status_code == 200
        nxt = {**body, "prompt": [*range(1, 11), *GEN, 7]}
        r2 = c.post("/v1/completions", json=nxt, headers=evil_headers())
        assert r2.headers["x-kvtier-reuse"].startswith("dp_read")
    decode_rids = [k.headers["x-request-id"] for k in fake.completions(D_URL)]
    ours = (r.headers["x-request-id"], r2.headers["x-request-id"])
    assert all(rid.startswith(ours) for rid in decode_rids)
    assert all(len(rid.split("-")) == 2 for rid in decode_rids)  # router id + feed tag
    for call in fake.calls:
        assert set(call.headers) <= ALLOWED and CLIENT_RID not in call.headers["x-request-id"]


_names = st.one_of(st.sampled_from(KV_HEADERS + ["x-request-id", "traceparent", "tracestate",
                                                 "content-type", "x-api-key"]),
                   st.from_regex(r"x-[a-z0-9-]{1,20}", fullmatch=True))
_values = st.one_of(st.just(EVIL), st.from_regex(r"[ -~]{0,40}", fullmatch=True))
_json = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-5, 5),
                               st.just("6.6.6.6"), st.just(EVIL)),
                     lambda kids: st.one_of(st.lists(kids, max_size=3),
                                            st.dictionaries(st.sampled_from(
                                                ["remote_host", "remote_port", "host", "x"]),
                                                kids, max_size=3)), max_leaves=8)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(headers=st.dictionaries(_names, _values, max_size=8),
       kvp=_json, stream=st.booleans(), chat=st.booleans())
def test_fuzz_no_client_header_or_kv_param_reaches_an_engine(
        headers: dict[str, str], kvp: Any, stream: bool, chat: bool) -> None:
    fake = FakeEngines()
    headers = {k: v for k, v in headers.items() if k.lower() not in ("content-type",)}
    if chat:
        path = "/v1/chat/completions"
        body: dict[str, Any] = {"model": "tiny",
                                "messages": [{"role": "user", "content": "hi there you"}]}
    else:
        path, body = "/v1/completions", {"model": "tiny", "prompt": list(range(1, 11))}
    body.update({"max_tokens": 3, "stream": stream, "kv_transfer_params": kvp})
    with make(fake, engine_api_key="engine-secret") as c:
        r = c.post(path, json=body, headers=headers)
    assert r.status_code == 200, r.text
    for call in fake.calls:
        assert set(call.headers) <= ALLOWED, call.headers
        assert call.headers["authorization"] == "Bearer engine-secret"
        for k, v in headers.items():
            if k.lower() not in ("traceparent", "tracestate"):
                assert call.headers.get(k.lower()) != v or v in ("", "application/json"), k
        assert b"6.6.6.6" not in call.raw


def test_client_bearer_token_is_not_sent_without_an_engine_key(fake: FakeEngines) -> None:
    with make(fake, api_keys=["sk-client"]) as c:
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2},
                   headers={"authorization": "Bearer sk-client"})
    assert r.status_code == 200
    assert all("authorization" not in call.headers for call in fake.calls)


def test_oversized_body_is_refused_from_its_content_length(fake: FakeEngines) -> None:
    with make(fake, max_body_bytes=4096) as c:
        r = c.post("/v1/completions", content=b"{" + b" " * 10_000 + b"}",
                   headers={"content-type": "application/json"})
    assert r.status_code == 413 and "too large" in r.json()["error"]["message"]
    assert fake.calls == []
