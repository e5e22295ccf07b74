"""The HTTP client under the router's engine legs: one small interface, three implementations.

``Upstream.post`` sends one JSON body and returns (status, body bytes); ``Upstream.open``
sends one and returns a ``Stream`` whose status is known and whose body is read chunk by
chunk. Transport trouble is raised as ``UpstreamIOError`` with a ``retry.Failure`` kind
(connect / timeout / protocol), whatever the library said.

- ``h1.H1Upstream`` (used when httptools is installed and no test transport is given): a
  lean HTTP/1.1 client of the router's own, on asyncio and httptools (see h1.py).
- ``AiohttpUpstream`` (used when aiohttp is installed and httptools is not): one
  ``ClientSession`` per engine instance, a bounded connection pool kept alive. aiohttp's
  pool hands out a free connection in O(1); httpcore's walks every pooled connection and
  polls each idle socket on every request, which was a third of the router's time at 128
  streams (benchmarks/ROUTER.md).
- ``HttpxUpstream``: httpx, one ``AsyncClient`` per instance; tests inject an
  ``httpx.AsyncBaseTransport`` here (tests/fakes/engine.py).

Timeouts: ``total_s`` bounds a whole non-streaming leg; a stream's ``idle_s`` bounds the
wait for each read (the first byte included), never the stream's length.

Stale pooled connections: an engine closes a connection that sat idle (vLLM's server after
``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``, 5 s). If it does so just as the next request is written on
it, that request fails before the engine read it (a CI run lost a prefill leg, and with it a
D->P read, this way). Every implementation sends such a request once more, on a new
connection, and call ``on_resend``: only when the connection was a reused one and no answer
had begun. A request that fails on a new connection is never resent (the engine may be
running it). ``RouterConfig.pool_keepalive_s`` stays below the engines' keep-alive so the
race is rare to begin with.

Threading model: used from the app's event loop only; sessions are created lazily inside it.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any, Protocol

import httpx

from kvtier.router.retry import Failure


class UpstreamIOError(Exception):
    def __init__(self, kind: Failure, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind


def _nothing() -> None:
    pass


class Stream(Protocol):
    status: int

    def chunks(self) -> AsyncIterator[bytes]: ...

    async def read(self) -> bytes: ...

    async def close(self) -> None: ...


class Upstream(Protocol):
    name: str
    on_resend: Callable[[], None]  # called when a request is sent again (stale connection)

    async def post(self, url: str, body: bytes, headers: dict[str, str], total_s: float,
                   ) -> tuple[int, bytes]: ...

    async def open(self, url: str, body: bytes, headers: dict[str, str], idle_s: float,
                   ) -> Stream: ...

    async def aclose(self) -> None: ...


# ---- httpx ------------------------------------------------------------------------------
def _httpx_error(e: httpx.HTTPError) -> UpstreamIOError:
    if isinstance(e, httpx.ConnectError):
        return UpstreamIOError(Failure.CONNECT, str(e) or "connection refused")
    if isinstance(e, httpx.TimeoutException):
        return UpstreamIOError(Failure.TIMEOUT, str(e) or "timed out")
    return UpstreamIOError(Failure.PROTOCOL, str(e) or type(e).__name__)


class _HttpxStream:
    def __init__(self, resp: httpx.Response) -> None:
        self.resp = resp
        self.status = resp.status_code

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for c in self.resp.aiter_raw():
                yield c
        except httpx.HTTPError as e:
            raise _httpx_error(e) from None

    async def read(self) -> bytes:
        try:
            return await self.resp.aread()
        except httpx.HTTPError as e:
            raise _httpx_error(e) from None

    async def close(self) -> None:
        await self.resp.aclose()


# Errors of a request written on a connection the peer had already closed.
_HTTPX_STALE = (httpx.RemoteProtocolError, httpx.WriteError, httpx.ReadError)


class _NewConnection:
    """httpcore trace hook: whether the request opened a new TCP connection."""

    __slots__ = ("opened",)

    def __init__(self) -> None:
        self.opened = False

    async def __call__(self, event: str, info: dict[str, Any]) -> None:
        if event.startswith("connection.connect_tcp"):
            self.opened = True


class HttpxUpstream:
    name = "httpx"

    def __init__(self, urls: Iterable[str], connect_s: float, max_connections: int,
                 keepalive_s: float, transport: httpx.AsyncBaseTransport | None = None,
                 on_resend: Callable[[], None] | None = None) -> None:
        self.connect_s = connect_s
        self.on_resend = on_resend or _nothing
        limits = httpx.Limits(max_connections=max_connections,
                              max_keepalive_connections=max_connections,
                              keepalive_expiry=keepalive_s)
        self._shared = httpx.AsyncClient(transport=transport, limits=limits)
        # One bounded pool per engine (a test transport is shared: one client for all).
        self._clients = {} if transport is not None else {
            u: httpx.AsyncClient(limits=limits) for u in urls}

    def _client(self, url: str) -> httpx.AsyncClient:
        for base, c in self._clients.items():
            if url.startswith(base):
                return c
        return self._shared

    async def _send(self, url: str, body: bytes, headers: dict[str, str],
                    timeout: httpx.Timeout) -> httpx.Response:
        """The response, its body not read yet; resent once after a stale connection."""
        c = self._client(url)
        for resend in (False, True):
            hook = _NewConnection()
            req = c.build_request("POST", url, content=body, headers=headers, timeout=timeout,
                                  extensions={"trace": hook})
            try:
                return await c.send(req, stream=True)
            except _HTTPX_STALE as e:
                if resend or hook.opened:
                    raise _httpx_error(e) from None
                self.on_resend()
            except httpx.HTTPError as e:
                raise _httpx_error(e) from None
        raise AssertionError("unreachable")  # pragma: no cover

    async def post(self, url: str, body: bytes, headers: dict[str, str], total_s: float,
                   ) -> tuple[int, bytes]:
        r = await self._send(url, body, headers, httpx.Timeout(total_s, connect=self.connect_s))
        try:
            return r.status_code, await r.aread()
        except httpx.HTTPError as e:
            raise _httpx_error(e) from None
        finally:
            await r.aclose()

    async def open(self, url: str, body: bytes, headers: dict[str, str], idle_s: float,
                   ) -> Stream:
        return _HttpxStream(await self._send(url, body, headers,
                                             httpx.Timeout(idle_s, connect=self.connect_s)))

    async def aclose(self) -> None:
        for c in self._clients.values():
            await c.aclose()
        await self._shared.aclose()


# ---- aiohttp ----------------------------------------------------------------------------
def aiohttp_available() -> bool:
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        return False
    return True


class _AiohttpStream:
    def __init__(self, resp: Any) -> None:
        self.resp = resp
        self.status: int = resp.status

    async def chunks(self) -> AsyncIterator[bytes]:
        import aiohttp

        try:
            async for c in self.resp.content.iter_any():
                yield c
        except (TimeoutError, aiohttp.ClientError) as e:
            raise _aiohttp_error(e) from None
        if not self.resp.content.is_eof():  # pragma: no cover - aiohttp raises first
            raise UpstreamIOError(Failure.PROTOCOL, "body ended early")

    async def read(self) -> bytes:
        import aiohttp

        try:
            out: bytes = await self.resp.read()
        except (TimeoutError, aiohttp.ClientError) as e:
            raise _aiohttp_error(e) from None
        return out

    async def close(self) -> None:
        self.resp.release()


def _aiohttp_error(e: BaseException) -> UpstreamIOError:
    import aiohttp

    if isinstance(e, aiohttp.ClientConnectorError):
        return UpstreamIOError(Failure.CONNECT, str(e) or "connection refused")
    if isinstance(e, (asyncio.TimeoutError, aiohttp.ServerTimeoutError)):
        return UpstreamIOError(Failure.TIMEOUT, str(e) or "timed out")
    return UpstreamIOError(Failure.PROTOCOL, str(e) or type(e).__name__)


class _Reuse:
    """Whether the request was handed a pooled connection (set by ``_connector``'s)."""

    __slots__ = ("reused",)

    def __init__(self) -> None:
        self.reused = False


# The request being sent by this task: aiohttp gets the connection inline in the caller's
# task, so the connector sees the mark of the request it serves.
_MARK: contextvars.ContextVar[_Reuse | None] = contextvars.ContextVar("kvtier_upstream_mark",
                                                                      default=None)


def _connector(**kwargs: Any) -> Any:
    """An aiohttp ``TCPConnector`` that marks a request handed a pooled connection.

    aiohttp says so only through its request tracing, which sends about ten trace signals
    per request (each a coroutine and a params object) for the one we need: a few percent
    of the router's CPU at 128 streams. The pool's private ``_get`` is where a pooled
    connection is handed out; should a later aiohttp rename it, nothing is marked reused
    and no request is ever resent (the safe side: tests/integration/test_router_upstream.py
    then fails)."""
    import aiohttp

    class Connector(aiohttp.TCPConnector):
        async def _get(self, key: Any, traces: Any) -> Any:
            conn = await super()._get(key, traces)
            if conn is not None:
                mark = _MARK.get()
                if mark is not None:
                    mark.reused = True
            return conn

    return Connector(**kwargs)


class AiohttpUpstream:
    name = "aiohttp"

    def __init__(self, urls: Iterable[str], connect_s: float, max_connections: int,
                 keepalive_s: float, on_resend: Callable[[], None] | None = None) -> None:
        self.on_resend = on_resend or _nothing
        self.urls = list(urls)
        self.connect_s = connect_s
        self.max_connections = max_connections
        self.keepalive_s = keepalive_s
        self._sessions: dict[str, Any] = {}
        self._by_url: dict[str, Any] = {}  # full URL -> its instance's session

    def _session(self, url: str) -> Any:
        s = self._by_url.get(url)
        if s is None:
            s = self._new_session(url)
            if len(self._by_url) < 4096:  # engine URLs x paths: a handful
                self._by_url[url] = s
        return s

    def _new_session(self, url: str) -> Any:
        import aiohttp

        base = next((u for u in self.urls if url.startswith(u)), "")
        s = self._sessions.get(base)
        if s is None:
            conn = _connector(limit=self.max_connections, limit_per_host=0,
                              keepalive_timeout=self.keepalive_s,
                              enable_cleanup_closed=False, ttl_dns_cache=300)
            s = self._sessions[base] = aiohttp.ClientSession(
                connector=conn, auto_decompress=False, skip_auto_headers=("User-Agent",))
        return s

    async def _send(self, url: str, body: bytes, headers: dict[str, str], timeout: Any) -> Any:
        """The response, its body not read yet; resent once after a stale connection."""
        import aiohttp

        session = self._session(url)
        for resend in (False, True):
            mark = _Reuse()
            token = _MARK.set(mark)
            try:
                return await session.post(url, data=body, headers=headers, timeout=timeout)
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as e:
                if resend or not mark.reused or isinstance(e, aiohttp.ClientConnectorError):
                    raise _aiohttp_error(e) from None
                self.on_resend()
            except (TimeoutError, aiohttp.ClientError) as e:
                raise _aiohttp_error(e) from None
            finally:
                _MARK.reset(token)
        raise AssertionError("unreachable")  # pragma: no cover

    async def post(self, url: str, body: bytes, headers: dict[str, str], total_s: float,
                   ) -> tuple[int, bytes]:
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=total_s, sock_connect=self.connect_s)
        r = await self._send(url, body, headers, timeout)
        try:
            return r.status, await r.read()
        except (TimeoutError, aiohttp.ClientError) as e:
            raise _aiohttp_error(e) from None
        finally:
            r.release()

    async def open(self, url: str, body: bytes, headers: dict[str, str], idle_s: float,
                   ) -> Stream:
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.connect_s,
                                        sock_read=idle_s)
        return _AiohttpStream(await self._send(url, body, headers, timeout))

    async def aclose(self) -> None:
        for s in self._sessions.values():
            await s.close()
        self._sessions.clear()
        self._by_url.clear()
