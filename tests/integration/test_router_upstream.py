"""The router's upstream clients (both ``Upstream`` implementations, real sockets) when the
engine closes a pooled connection just as the next request is written on it, the race of a
server's keep-alive timeout (vLLM's: 5 s) against the router reusing the connection. A CI run
lost a prefill leg this way ("Can not write request body"), and with it the D->P read the
test expected.

The engine here is a raw asyncio server that makes the race certain: it answers the first
request of each connection, keep-alive, and closes the connection without a byte on any later
request. A request that fails on a reused connection was never read: it is sent once more,
on a new connection. One that fails on a new connection may be running: it is not."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Self

import pytest

from kvtier.router.h1 import H1Upstream
from kvtier.router.retry import Failure
from kvtier.router.upstream import AiohttpUpstream, HttpxUpstream, Upstream, UpstreamIOError

pytestmark = pytest.mark.integration

BODY = b'{"ok":true}'


class ClosingEngine:
    """Answers ``answer_first`` requests per connection, then closes it unanswered."""

    def __init__(self, answer_first: int = 1) -> None:
        self.answer_first = answer_first
        self.connections = 0
        self.answered = 0
        self.dropped = 0
        self.url = ""
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> Self:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        served = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                await reader.readexactly(length)
                if served >= self.answer_first:
                    self.dropped += 1
                    return  # close without a byte: the request is lost, the client told so
                served += 1
                self.answered += 1
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(BODY), BODY))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            writer.close()


Make = Callable[[str, Callable[[], None]], Upstream]


def _aiohttp(url: str, resent: Callable[[], None]) -> Upstream:
    return AiohttpUpstream([url], connect_s=2.0, max_connections=4, keepalive_s=30.0,
                           on_resend=resent)


def _httpx(url: str, resent: Callable[[], None]) -> Upstream:
    return HttpxUpstream([url], connect_s=2.0, max_connections=4, keepalive_s=30.0,
                         on_resend=resent)


def _h1(url: str, resent: Callable[[], None]) -> Upstream:
    return H1Upstream([url], connect_s=2.0, max_connections=4, keepalive_s=30.0,
                      on_resend=resent)


IMPLEMENTATIONS = [pytest.param(_aiohttp, id="aiohttp"), pytest.param(_httpx, id="httpx"),
                   pytest.param(_h1, id="h1")]


async def _post(up: Upstream, url: str) -> tuple[int, bytes]:
    return await up.post(url + "/v1/completions", b'{"prompt":"hi"}',
                         {"Content-Type": "application/json"}, 5.0)


async def _open(up: Upstream, url: str) -> tuple[int, bytes]:
    stream = await up.open(url + "/v1/completions", b'{"prompt":"hi","stream":true}',
                           {"Content-Type": "application/json"}, 5.0)
    try:
        return stream.status, b"".join([c async for c in stream.chunks()])
    finally:
        await stream.close()


CALLS = [pytest.param(_post, id="post"), pytest.param(_open, id="open")]


def _run(coro: Awaitable[None]) -> None:
    asyncio.run(asyncio.wait_for(coro, 20))


@pytest.mark.parametrize("make", IMPLEMENTATIONS)
@pytest.mark.parametrize("call", CALLS)
def test_a_request_on_a_closed_pooled_connection_is_sent_again(make: Make, call) -> None:
    async def go() -> None:
        resends: list[int] = []
        async with ClosingEngine() as engine:
            up = make(engine.url, lambda: resends.append(1))
            try:
                for _ in range(3):
                    assert await call(up, engine.url) == (200, BODY)
            finally:
                await up.aclose()
        # each later request met a closed pooled connection, then got a new one
        assert (engine.answered, engine.dropped, engine.connections) == (3, 2, 3)
        assert len(resends) == 2

    _run(go())


@pytest.mark.parametrize("make", IMPLEMENTATIONS)
@pytest.mark.parametrize("call", CALLS)
def test_a_request_lost_on_a_new_connection_is_not_sent_again(make: Make, call) -> None:
    """The engine may have read it (and be running it): the leg fails, as a protocol error,
    and the router's retry policy decides what to do."""
    async def go() -> None:
        resends: list[int] = []
        async with ClosingEngine(answer_first=0) as engine:
            up = make(engine.url, lambda: resends.append(1))
            try:
                with pytest.raises(UpstreamIOError) as err:
                    await call(up, engine.url)
            finally:
                await up.aclose()
        assert err.value.kind is Failure.PROTOCOL
        assert (engine.answered, engine.dropped, engine.connections) == (0, 1, 1)
        assert resends == []

    _run(go())


@pytest.mark.parametrize("make", IMPLEMENTATIONS)
def test_a_request_is_sent_again_once_at_most(make: Make) -> None:
    """Two stale connections in the pool and the resend lands on the second: the leg fails
    rather than walk the pool (a new connection is what the resend is for)."""
    async def go() -> None:
        resends: list[int] = []
        async with ClosingEngine() as engine:
            up = make(engine.url, lambda: resends.append(1))
            try:
                # two connections in the pool, both answered once
                got = await asyncio.gather(_post(up, engine.url), _post(up, engine.url))
                assert got == [(200, BODY)] * 2
                conns = engine.connections
                outcome = await _post(up, engine.url)
            except UpstreamIOError as e:
                outcome = e.kind
            finally:
                await up.aclose()
        # either the resend opened a new connection (answered), or it drew the second
        # stale one and the leg failed: never a third try
        assert len(resends) == 1
        if outcome == (200, BODY):
            assert engine.connections == conns + 1
        else:
            assert outcome is Failure.PROTOCOL and engine.dropped == 2

    _run(go())


@pytest.mark.parametrize("client", ["aiohttp", "httpx", "auto"])
def test_the_router_counts_its_resends(client: str) -> None:
    from kvtier.router.config import RouterConfig
    from kvtier.router.server import RouterServer

    cfg = RouterConfig.model_validate({
        "instances": [{"name": "prefill-0", "url": "http://127.0.0.1:9", "role": "prefill"},
                      {"name": "decode-0", "url": "http://127.0.0.1:9", "role": "decode"}],
        "port": 0, "log_json": False, "upstream_client": client})
    assert cfg.pool_keepalive_s < 5  # below vLLM's own keep-alive
    srv = RouterServer(cfg, health_checks=False)
    upstream = srv.router.legs.upstream
    assert upstream.name == ("h1" if client == "auto" else client)  # httptools is installed
    upstream.on_resend()
    upstream.on_resend()
    got = srv.router.metrics.registry.get_sample_value("kvtier_router_upstream_stale_resends_total")
    assert got == 2


# ---- what every implementation says of other engine trouble --------------------------------
class RawEngine:
    """Answers every request with ``reply(n)`` (bytes to write, then ``close`` or not), the
    ``n``-th request of the engine; counts connections."""

    def __init__(self, reply: Callable[[int], Awaitable[tuple[list[bytes], bool]]]) -> None:
        self.reply = reply
        self.connections = 0
        self.requests = 0
        self.url = ""
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> Self:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                await reader.readexactly(length)
                self.requests += 1
                parts, close = await self.reply(self.requests)
                for p in parts:
                    writer.write(p)
                    await writer.drain()
                    await asyncio.sleep(0.01)
                if close:
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            writer.close()


def _chunked(*events: bytes) -> list[bytes]:
    head = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    return [head, *(b"%x\r\n%s\r\n" % (len(e), e) for e in events), b"0\r\n\r\n"]


EVENTS = [b'data: {"a":1}\n\n', b'data: {"a":2}\n\n', b"data: [DONE]\n\n"]


@pytest.mark.parametrize("make", IMPLEMENTATIONS)
def test_a_stream_is_relayed_as_it_comes_and_its_connection_kept(make: Make) -> None:
    async def go() -> None:
        async def reply(n: int) -> tuple[list[bytes], bool]:
            return _chunked(*EVENTS), False

        async with RawEngine(reply) as engine:
            up = make(engine.url, lambda: None)
            try:
                for _ in range(2):
                    assert await _open(up, engine.url) == (200, b"".join(EVENTS))
                assert await _post(up, engine.url) == (200, b"".join(EVENTS))
            finally:
                await up.aclose()
        assert (engine.requests, engine.connections) == (3, 1)

    _run(go())


@pytest.mark.parametrize("make", IMPLEMENTATIONS)
def test_a_stream_closed_early_does_not_leave_its_connection_for_the_next(make: Make) -> None:
    async def go() -> None:
        async def reply(n: int) -> tuple[list[bytes], bool]:
            return _chunked(*EVENTS), False

        async with RawEngine(reply) as engine:
            up = make(engine.url, lambda: None)
            try:
                s = await up.open(engine.url + "/v1/completions", b"{}", {}, 5.0)
                first = await anext(s.chunks())
                assert first.startswith(b"data:")
                await s.close()  # the relay's client left
                assert await _post(up, engine.url) == (200, b"".join(EVENTS))
            finally:
                await up.aclose()
        assert engine.requests == 2

    _run(go())


@pytest.mark.parametrize("make", IMPLEMENTATIONS)
@pytest.mark.parametrize("call", CALLS)
def test_an_engine_that_breaks_mid_answer_or_answers_garbage_is_a_protocol_error(
        make: Make, call) -> None:
    async def go() -> None:
        async def reply(n: int) -> tuple[list[bytes], bool]:
            if n == 1:  # chunked, cut after one event
                return _chunked(*EVENTS)[:2], True
            return [b"\x00\xffnot http at all\r\n\r\n"], True

        async with RawEngine(reply) as engine:
            up = make(engine.url, lambda: None)
            try:
                for _ in range(2):
                    with pytest.raises(UpstreamIOError) as err:
                        await call(up, engine.url)
                    assert err.value.kind is Failure.PROTOCOL
            finally:
                await up.aclose()

    _run(go())


@pytest.mark.parametrize("make", IMPLEMENTATIONS)
@pytest.mark.parametrize("call", CALLS)
def test_an_engine_that_never_answers_times_out(make: Make, call) -> None:
    async def go() -> None:
        async def reply(n: int) -> tuple[list[bytes], bool]:
            await asyncio.sleep(30)
            return [], True

        async def short(up: Upstream, url: str) -> tuple[int, bytes]:
            if call is _post:
                return await up.post(url + "/v1/completions", b"{}", {}, 0.3)
            s = await up.open(url + "/v1/completions", b"{}", {}, 0.3)
            await s.close()
            return s.status, b""

        async with RawEngine(reply) as engine:
            up = make(engine.url, lambda: None)
            try:
                with pytest.raises(UpstreamIOError) as err:
                    await short(up, engine.url)
            finally:
                await up.aclose()
        assert err.value.kind is Failure.TIMEOUT

    _run(go())


@pytest.mark.parametrize("make", IMPLEMENTATIONS)
@pytest.mark.parametrize("call", CALLS)
def test_a_refused_connection_is_a_connect_failure(make: Make, call) -> None:
    async def go() -> None:
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        server.close()
        await server.wait_closed()  # nothing listens there now
        up = make(url, lambda: None)
        try:
            with pytest.raises(UpstreamIOError) as err:
                await call(up, url)
        finally:
            await up.aclose()
        assert err.value.kind is Failure.CONNECT

    _run(go())
