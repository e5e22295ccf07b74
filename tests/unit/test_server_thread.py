"""kvtier.runtime.ServerThread: the port is ours from construction, and a server that does
not come up says why."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import AsyncIterator

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from kvtier.runtime import ServerThread, listen, listen_on_free_port


def _app(fail_startup: bool = False) -> Starlette:
    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        if fail_startup:
            raise ValueError("indexer at http://nowhere unreachable")
        yield

    async def hello(_request: object) -> PlainTextResponse:
        return PlainTextResponse("hi")

    return Starlette(routes=[Route("/", hello)], lifespan=lifespan)


def test_serves_and_stops() -> None:
    with ServerThread(_app()) as srv:
        assert httpx.get(srv.url + "/").text == "hi"
    with pytest.raises(httpx.ConnectError):
        httpx.get(srv.url + "/", timeout=2)


def test_port_is_held_from_construction() -> None:
    srv = ServerThread(_app())
    try:
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", srv.port))
        srv.start()
        assert httpx.get(srv.url + "/").status_code == 200
    finally:
        srv.stop()


def test_startup_failure_is_reported_with_its_cause() -> None:
    srv = ServerThread(_app(fail_startup=True), name="kvtier-test")
    with pytest.raises(RuntimeError, match="kvtier-test did not start.*unreachable"):
        srv.start(timeout_s=20)


def test_taken_port_is_an_oserror_at_construction() -> None:
    with listen() as held:
        held.listen()
        with pytest.raises(OSError):
            ServerThread(_app(), port=held.getsockname()[1])


def test_stop_before_start_frees_the_port() -> None:
    srv = ServerThread(_app())
    port = srv.port
    srv.stop()
    with listen(port=port) as again:
        assert again.getsockname()[1] == port


def test_listen_on_free_port_serves_a_router_style_socket() -> None:
    sock = listen_on_free_port()
    with ServerThread(_app(), sock=sock) as srv:
        assert srv.port == sock.getsockname()[1]
        assert httpx.get(srv.url + "/").text == "hi"
