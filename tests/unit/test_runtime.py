"""kvtier.runtime.ServerThread: the port is ours from construction, and a server that does
not come up says why."""

from __future__ import annotations

import contextlib
import socket
import threading
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


def test_a_startup_that_hangs_is_reported_with_the_line_it_waits_on() -> None:
    gate = threading.Event()

    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        _wedged_startup(gate)
        yield

    srv = ServerThread(Starlette(lifespan=lifespan), name="kvtier-test")
    try:
        with pytest.raises(RuntimeError, match=r"(?s)within 0.5 s.*_wedged_startup"):
            srv.start(timeout_s=0.5)
    finally:
        gate.set()
        srv.stop()


def _wedged_startup(gate: threading.Event) -> None:
    gate.wait(2)  # a synchronous wait on the loop: startup hangs past the timeout


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


def _get(conn: socket.socket) -> bytes:
    conn.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    return conn.recv(4096)


def test_an_idle_client_connection_stays_open_for_keepalive_s() -> None:
    """An agent sends its next turn on the connection it kept, after a tool's wait: the server
    must not close it first (the client would see "server disconnected")."""
    import time

    with ServerThread(_app(), keepalive_s=3) as srv, \
            socket.create_connection((srv.host, srv.port), timeout=5) as conn:
        assert b"200 OK" in _get(conn)
        time.sleep(1.5)  # idle, within keepalive_s
        assert b"200 OK" in _get(conn)
    with ServerThread(_app(), keepalive_s=1) as srv, \
            socket.create_connection((srv.host, srv.port), timeout=5) as conn:
        assert b"200 OK" in _get(conn)
        time.sleep(2.0)  # past keepalive_s: the server has closed it
        conn.settimeout(0.5)  # closed answers b"" at once; still open would time out
        assert conn.recv(4096) == b""


def test_the_router_keeps_client_connections_longer_than_clients_do() -> None:
    from kvtier.router.config import RouterConfig

    # longer than httpx's (5 s) and aiohttp's (15 s) idle expiry: the client closes first
    assert RouterConfig.model_fields["client_keepalive_s"].default > 15
