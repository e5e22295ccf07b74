"""The router's production upstream clients (router/h1.py's, the default, and aiohttp; real
sockets; every test runs with each) against the same fake engines the unit tests use (tests/fakes/engine.py, served over HTTP by a small ASGI
adapter): the header allow-list, garbage answers, a decode dying mid-stream, the end of a
stream without [DONE], a timing-out prefill ejected though its /health answers."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvtier.router.config import RouterConfig
from kvtier.router.server import RouterServer
from kvtier.runtime import ServerThread
from tests.fakes.engine import BLOCK_SIZE, D_URL, GEN, P2_URL, P_URL, FakeEngines

pytestmark = pytest.mark.integration

EVIL = "6.6.6.6:6666"


class FakeOverHTTP:
    """ASGI app answering as ``FakeEngines`` does for the engine at ``logical`` (its fault
    queue, its block params), whatever port it really listens on. A fault that breaks the
    stream breaks the real connection; "timeout" hangs longer than the router waits."""

    def __init__(self, fake: FakeEngines, logical: str) -> None:
        self.fake, self.logical = fake, logical

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        headers = [(k.decode(), v.decode()) for k, v in scope["headers"]]
        req = httpx.Request(scope["method"], self.logical + scope["path"], headers=headers,
                            content=body)
        queued = self.fake.faults.get(self.logical)
        if queued and queued[0] == "timeout" and scope["path"].endswith("completions"):
            queued.pop(0)
            self.fake.calls.append(self._call(scope["path"], body, headers))
            await asyncio.sleep(3)  # past the router's prefill timeout
            return
        resp = await self.fake.handle_async_request(req)
        await send({"type": "http.response.start", "status": resp.status_code,
                    "headers": [(k.encode(), v.encode()) for k, v in resp.headers.items()
                                if k.lower() not in ("content-length", "transfer-encoding")]})
        async for chunk in resp.stream:  # type: ignore[union-attr]
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def _call(self, path: str, body: bytes, headers: list[tuple[str, str]]) -> Any:
        import json

        from tests.fakes.engine import Call
        return Call(self.logical, path, json.loads(body), {k.lower(): v for k, v in headers},
                    body)


@pytest.fixture()
def fleet() -> Iterator[tuple[FakeEngines, dict[str, str]]]:
    fake = FakeEngines()
    servers = {u: ServerThread(FakeOverHTTP(fake, u)) for u in (P_URL, P2_URL, D_URL)}
    for s in servers.values():
        s.start()
    try:
        yield fake, {u: s.url for u, s in servers.items()}
    finally:
        for s in servers.values():
            s.stop()


CLIENT = {"name": "auto"}  # the upstream_client of this test's routers (``client``)


@pytest.fixture(autouse=True, params=["auto", "aiohttp"])
def client(request: pytest.FixtureRequest) -> Iterator[str]:
    CLIENT["name"] = request.param
    yield request.param
    CLIENT["name"] = "auto"


def router(real: dict[str, str], **kw: Any) -> RouterServer:
    prefill = [{"name": f"prefill-{i}", "url": real[u], "role": "prefill"}
               for i, u in enumerate(kw.pop("prefill", [P_URL]))]
    cfg = RouterConfig.model_validate({
        "instances": [*prefill, {"name": "decode-0", "url": real[D_URL], "role": "decode"}],
        "port": 0, "log_json": False, "block_size": BLOCK_SIZE,
        "upstream_client": CLIENT["name"], **kw})
    srv = RouterServer(cfg, health_checks=False)
    # "auto" is the lean client where httptools is installed (it is, with uvicorn[standard])
    assert srv.router.legs.upstream.name == {"auto": "h1"}.get(CLIENT["name"], CLIENT["name"])
    return srv


BODY: dict[str, Any] = {"model": "tiny", "prompt": list(range(1, 11)), "max_tokens": 3}


def events(raw: bytes) -> list[bytes]:
    return [e for e in raw.split(b"\n\n") if e]


@pytest.mark.parametrize("stream", [False, True])
def test_only_allowed_headers_reach_engines_over_sockets(fleet, stream: bool) -> None:
    fake, real = fleet
    hdrs = {"x-kv-cache-source-host-port": EVIL, "x-request-id": "client-rid",
            "x-prefiller-host-port": EVIL, "cookie": "a=b",
            "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
    with router(real, engine_api_key="ek") as srv:
        body = {**BODY, "stream": stream, "conversation_id": "c",
                "kv_transfer_params": {"remote_host": "6.6.6.6"}}
        r = httpx.post(srv.url + "/v1/completions", json=body, headers=hdrs, timeout=30)
        assert r.status_code == 200
        r2 = httpx.post(srv.url + "/v1/completions", headers=hdrs, timeout=30,
                        json={**body, "prompt": [*BODY["prompt"], *GEN, 7]})
        assert r2.headers["x-kvtier-reuse"].startswith("dp_read")
    allowed = {"content-type", "x-request-id", "traceparent", "authorization", "host",
               "accept", "accept-encoding", "content-length", "connection"}
    assert len(fake.completions()) >= 4
    for call in fake.calls:
        assert set(call.headers) <= allowed, call.headers
        assert call.headers["x-request-id"] != "client-rid"
        assert call.headers["authorization"] == "Bearer ek"
        assert call.headers["traceparent"] == hdrs["traceparent"]
        assert b"6.6.6.6" not in call.raw


def test_garbage_everywhere_is_a_502_with_a_message(fleet) -> None:
    fake, real = fleet
    fake.fail(P_URL, *["garbage"] * 3)
    fake.fail(D_URL, *["garbage"] * 3)
    with router(real, max_retries=0) as srv:
        r = httpx.post(srv.url + "/v1/completions", json={**BODY, "stream": True}, timeout=30)
    assert r.status_code == 502 and "no engine could serve" in r.json()["error"]["message"]


@pytest.mark.parametrize("fault,said", [("midstream", b"failed mid-stream"),
                                        ("cut", b"ended the stream early")])
def test_a_decode_dying_mid_stream_is_an_error_event(fleet, fault: str, said: bytes) -> None:
    fake, real = fleet
    fake.fail(D_URL, fault)
    with router(real) as srv:
        with httpx.stream("POST", srv.url + "/v1/completions",
                          json={**BODY, "stream": True}, timeout=30) as r:
            raw = b"".join(r.iter_bytes())
            assert r.status_code == 200
        text = httpx.get(srv.url + "/metrics").text
    ev = events(raw)
    assert said in ev[-2] and ev[-1] == b"data: [DONE]"
    assert 'kvtier_router_upstream_errors_total{kind="midstream",leg="decode"} 1.0' in text


def test_a_hanging_prefill_is_ejected_over_sockets(fleet) -> None:
    fake, real = fleet
    fake.fail(P_URL, "timeout", "timeout")
    with router(real, prefill=[P_URL, P2_URL], eject_after_failures=2, readmit_probe_s=600,
                timeouts={"prefill_s": 0.5}) as srv:
        for _ in range(12):
            r = httpx.post(srv.url + "/v1/completions", json=BODY, timeout=30)
            assert r.status_code == 200
            if not fake.faults[P_URL]:
                break
        p0 = srv.router.pool.by_name["prefill-0"]
        assert not p0.healthy and p0.ejected == "legs"
        text = httpx.get(srv.url + "/metrics").text
    assert 'kvtier_router_instance_ejections_total{instance="prefill-0",reason="legs"} 1.0' \
        in text


def test_a_client_leaving_cancels_the_upstream_leg(fleet) -> None:
    """The prefill hangs; the client gives up: the router hears the disconnect (no polling)
    and cancels the leg, and counts a 499."""
    fake, real = fleet
    fake.fail(P_URL, "timeout")
    with router(real) as srv:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(srv.url + "/v1/completions", json=BODY, timeout=0.5)
        text = ""
        for _ in range(100):  # the router hears the disconnect asynchronously
            text = httpx.get(srv.url + "/metrics").text
            if "kvtier_router_client_disconnects_total 1.0" in text:
                break
            time.sleep(0.05)
        assert srv.router.pool.by_name["prefill-0"].in_flight == 0
    assert "kvtier_router_client_disconnects_total 1.0" in text
    assert 'kvtier_router_requests_total{endpoint="completions",status="499"} 1.0' in text
