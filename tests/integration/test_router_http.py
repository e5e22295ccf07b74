"""The router's HTTP surface over real sockets, with no engine behind it.

Auth, malformed bodies, health reporting and the 502 for "no engine could
serve" need no vLLM: engines are unreachable ports here.
"""

from __future__ import annotations

import socket

import httpx
import pytest
from kvtier.router.config import RouterConfig
from kvtier.router.server import RouterServer

pytestmark = pytest.mark.integration


def dead_url() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def srv():
    cfg = RouterConfig.model_validate({
        "prefill": [dead_url()], "decode": [dead_url()], "port": 0, "log_json": False,
        "api_keys": ["sk-a", "sk-b"], "max_body_bytes": 4096, "health_interval_s": 0.2,
        "eject_after_failures": 1})
    with RouterServer(cfg) as s:
        yield s


def post(srv, path, body=None, key="sk-a", content=None):
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(srv.url + path, json=body, content=content, headers=headers, timeout=30)


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("key", [None, "sk-wrong", ""])
def test_auth_required(srv, key):
    r = post(srv, "/v1/chat/completions", CHAT, key=key)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(srv.url + "/v1/models").status_code == 401


@pytest.mark.parametrize("content,status", [
    (b"{not json", 400), (b"[1,2]", 400), (b"\xff\xfe", 400), (b"x" * 5000, 413),
    (b'{"model": "tiny"}', 400), (b"[" * 3000 + b"]" * 3000, 413),
])
def test_malformed_bodies_are_4xx(srv, content, status):
    r = post(srv, "/v1/completions", content=content)
    assert r.status_code == status
    assert r.json()["error"]["code"] == status


def test_no_engine_reachable_is_502_not_500(srv):
    r = post(srv, "/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": 4})
    assert r.status_code == 502 and r.json()["error"]["type"] == "upstream_error"


def test_healthz_and_metrics(srv):
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
