"""The router's HTTP surface over real sockets, with no real engine behind it.

Auth, malformed bodies, health reporting and the 502 for "no engine could
serve" need no vLLM: engines are unreachable ports here. The reuse headers and
the reuse counter are checked against fake engines (tests/fakes/engine.py)
reached through the router's upstream transport.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvtier.router.config import RouterConfig
from kvtier.router.server import RouterServer
from kvtier.runtime import free_ports
from tests.fakes.engine import BLOCK_SIZE, D_URL, GEN, P_URL, FakeEngines

pytestmark = pytest.mark.integration


def dead_url() -> str:
    return f"http://127.0.0.1:{free_ports(1)[0]}"  # nothing listens there


@pytest.fixture(scope="module")
def srv() -> Iterator[RouterServer]:
    cfg = RouterConfig.model_validate({
        "prefill": [dead_url()], "decode": [dead_url()], "port": 0, "log_json": False,
        "api_keys": ["sk-a", "sk-b"], "max_body_bytes": 4096, "health_interval_s": 0.2,
        "eject_after_failures": 1})
    with RouterServer(cfg) as s:
        yield s


def post(srv: RouterServer, path: str, body: dict[str, Any] | None = None,
         key: str | None = "sk-a", content: bytes | None = None) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(srv.url + path, json=body, content=content, headers=headers, timeout=30)


CHAT: dict[str, Any] = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("key", [None, "sk-wrong", ""])
def test_auth_required(srv: RouterServer, key: str | None) -> None:
    r = post(srv, "/v1/chat/completions", CHAT, key=key)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(srv.url + "/v1/models").status_code == 401


@pytest.mark.parametrize("content,status", [
    (b"{not json", 400), (b"[1,2]", 400), (b"\xff\xfe", 400), (b"x" * 5000, 413),
    (b'{"model": "tiny"}', 400), (b"[" * 3000 + b"]" * 3000, 413),
])
def test_malformed_bodies_are_4xx(srv: RouterServer, content: bytes, status: int) -> None:
    r = post(srv, "/v1/completions", content=content)
    assert r.status_code == status
    assert r.json()["error"]["code"] == status


def test_no_engine_reachable_is_502_not_500(srv: RouterServer) -> None:
    r = post(srv, "/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": 4})
    assert r.status_code == 502 and r.json()["error"]["type"] == "upstream_error"
    # No prefill answered: there is no reuse decision to report.
    assert "x-kvtier-reuse" not in r.headers and "x-kvtier-outcome" not in r.headers


def test_healthz_and_metrics(srv: RouterServer) -> None:
    import time

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        h = httpx.get(srv.url + "/healthz")
        if h.status_code == 503:
            break
        time.sleep(0.1)
    assert h.status_code == 503 and h.json()["status"] == "degraded"
    assert all(not i["healthy"] for i in h.json()["instances"].values())
    text = httpx.get(srv.url + "/metrics").text
    assert "kvtier_router_requests_total" in text
    assert 'kvtier_router_instance_healthy{instance="decode-0",role="decode"} 0.0' in text


@pytest.mark.parametrize("port", [0, 8000])
def test_port_0_or_the_cli_default_picks_a_free_port(port: int) -> None:
    cfg = RouterConfig.model_validate({"decode": [dead_url()], "port": port, "log_json": False})
    srv = RouterServer(cfg, health_checks=False)
    assert srv.config.port not in (0, 8000) and srv.url.endswith(f":{srv.config.port}")
    with srv:
        assert httpx.get(srv.url + "/healthz").status_code in (200, 503)
    srv.stop()  # idempotent


def test_reuse_headers_and_counter_over_http() -> None:
    cfg = RouterConfig.model_validate({"prefill": [P_URL], "decode": [D_URL], "port": 0,
                                       "log_json": False, "block_size": BLOCK_SIZE})
    prompt = list(range(1, 11))
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 3, "conversation_id": "c"}
    with RouterServer(cfg, transport=FakeEngines(), health_checks=False) as srv:
        first = httpx.post(srv.url + "/v1/completions", json=body, timeout=30)
        assert first.status_code == 200
        assert first.headers["x-kvtier-reuse"] == "none; tokens=0"
        assert first.headers["x-kvtier-outcome"] == "none"
        nxt = {**body, "prompt": [*prompt, *GEN, 7], "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=nxt, timeout=30) as r:
            assert r.status_code == 200
            assert r.headers["x-kvtier-reuse"] == f"dp_read; tokens={len(prompt) + 2}"
            assert r.headers["x-kvtier-outcome"] == "full"
            assert b"".join(r.iter_bytes()).endswith(b"data: [DONE]\n\n")
        text = httpx.get(srv.url + "/metrics").text
    assert 'kvtier_router_reuse_total{path="dp_read"} 1.0' in text
    assert 'kvtier_router_reuse_total{path="none"} 1.0' in text


def test_streamed_turn_keeps_reuse_through_a_real_params_feed() -> None:
    """The decode node's feed over real ZMQ: KVTierNixlConnector's publisher, the router's
    subscriber. A streamed turn is relayed event by event and the next turn reads D's KV."""
    pytest.importorskip("vllm")
    from kvtier.tier.params_feed import ParamsPublisher
    from kvtier.wire.params_feed import FinishedParams
    from tests.helpers import wait_until

    port = free_ports(1)[0]
    pub = ParamsPublisher(f"tcp://127.0.0.1:{port}")
    fake = FakeEngines()
    fake.feed = lambda url, msg: pub.publish(msg)
    cfg = RouterConfig.model_validate({
        "prefill": [P_URL], "port": 0, "log_json": False, "block_size": BLOCK_SIZE,
        "decode": [{"name": "decode-0", "url": D_URL,
                    "params_feed": f"tcp://127.0.0.1:{port}"}]})
    prompt = list(range(1, 11))
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 3, "stream": True}
    try:
        with RouterServer(cfg, transport=fake, health_checks=False) as srv:
            # A PUB drops what it sends before the router's subscription reaches it (slower on
            # a busy machine): publish a message no leg waits for until the router counts one.
            def heard() -> bool:
                pub.publish(FinishedParams("cmpl-probe", {}, ()))
                return 'params_feed_total{result="unmatched"}' in httpx.get(
                    srv.url + "/metrics").text
            assert wait_until(heard, timeout=15)
            with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=30) as r:
                events = [e for e in b"".join(r.iter_bytes()).split(b"\n\n") if e]
            assert len(events) == 4 and events[-1] == b"data: [DONE]"
            nxt = {**body, "prompt": [*prompt, *GEN, 7]}
            r2 = httpx.post(srv.url + "/v1/completions", json=nxt, timeout=30)
            assert r2.headers["x-kvtier-reuse"] == f"dp_read; tokens={len(prompt) + 2}"
            text = httpx.get(srv.url + "/metrics").text
        assert 'kvtier_router_params_feed_total{result="received"}' in text
    finally:
        pub.close()


def test_client_keepalive_s_is_how_long_the_router_keeps_an_idle_connection() -> None:
    import socket
    import time

    cfg = RouterConfig.model_validate({"decode": [dead_url()], "port": 0, "log_json": False,
                                       "client_keepalive_s": 1})
    with RouterServer(cfg, health_checks=False) as srv, \
            socket.create_connection(("127.0.0.1", srv.config.port), timeout=5) as conn:
        conn.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert b"HTTP/1.1" in conn.recv(4096)
        time.sleep(2.0)  # past client_keepalive_s: the router has closed it
        conn.settimeout(0.5)  # closed answers b"" at once; still open would time out
        assert conn.recv(4096) == b""
    assert RouterConfig.model_validate({"decode": [dead_url()]}).client_keepalive_s == 75
