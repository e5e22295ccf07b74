"""A lean HTTP/1.1 client for the engine legs: ``upstream.Upstream`` on asyncio and httptools.

The router's legs are small JSON POSTs to a handful of engines, answered with JSON or an SSE
stream, over kept-alive connections; aiohttp spent about a third of the router's CPU per
request at 128 streams on them (its request and response objects, URL parsing, multidicts,
a writer task and timers per request: benchmarks/ROUTER.md). This client does only that:

- one ``_Pool`` per engine (scheme, host, port): idle connections in a deque (the one
  idle longest first; one idle past ``keepalive_s`` is closed, not used), at most
  ``max_connections`` requests at once (a semaphore; more wait for a free one);
- a request is one write of a prebuilt head and the body; the answer is parsed by
  httptools (llhttp, the parser uvicorn serves with): content-length, chunked;
- ``post`` waits for the whole answer within ``total_s`` (connect included); ``open``
  returns once the status line and headers arrived, and each later read waits at most
  ``idle_s`` (as the other implementations);
- a stream's body is buffered up to ``_READ_HIGH`` bytes, then the engine's socket is paused
  until the relay caught up;
- an answer the client did not read to its end (a stream closed early, a cancelled leg, a
  timeout) closes its connection; a complete one that the engine keeps alive goes back.

Errors are ``UpstreamIOError``: a refused or unreachable engine ``connect``, a timeout
(connect or read) ``timeout``, anything else (a closed connection, an answer that is not
HTTP) ``protocol``. Stale pooled connections are handled as ``upstream.py`` says: a request
whose reused connection closed before any byte of an answer is sent once more, on a new
connection, and ``on_resend`` is called.

Threading model: used from the app's event loop only; pools are created lazily inside it.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
import time
from collections.abc import AsyncIterator, Callable, Iterable
from urllib.parse import urlsplit

from kvtier.router.retry import Failure
from kvtier.router.upstream import Stream, UpstreamIOError, _nothing

_READ_HIGH = 1 << 18  # body bytes buffered before the engine's socket is paused


def httptools_available() -> bool:
    try:
        import httptools  # noqa: F401
    except ImportError:
        return False
    return True


class _Lost(Exception):
    """The connection closed, or sent something that is not HTTP, before the answer ended."""


def _expire(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_exception(TimeoutError())


class _Conn(asyncio.Protocol):
    """One connection; one request at a time. The httptools callbacks fill the answer."""

    def __init__(self, pool: _Pool) -> None:
        import httptools

        self.pool = pool
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self.start()

    def start(self) -> None:
        """Ready for the next answer."""
        self.status = 0
        self.answered = False   # a byte of this answer arrived
        self.headers_done = False
        self.complete = False
        self.keep_alive = False
        self.error: str | None = None
        self.chunks: list[bytes] = []
        self.buffered = 0
        self.paused = False
        self.waiter: asyncio.Future[None] | None = None

    # ---- asyncio.Protocol ---------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.answered = True
        try:
            self.parser.feed_data(data)
        except Exception as e:  # httptools.HttpParserError and its kin
            self.error = f"not an HTTP answer: {e}"
            self.abort()
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.complete and self.error is None:
            self.error = "server disconnected" if exc is None else (str(exc) or
                                                                   type(exc).__name__)
        self._wake()

    # ---- httptools ----------------------------------------------------------------------
    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.headers_done = True

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > _READ_HIGH and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def on_message_complete(self) -> None:
        self.complete = True
        # Asked now: llhttp forgets the answer's connection flags once it is over.
        self.keep_alive = self.parser.should_keep_alive()

    # ---- the client's side --------------------------------------------------------------
    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def wait(self, timeout: float) -> None:
        """Until the next event (bytes, the end, an error); ``TimeoutError`` after
        ``timeout`` seconds without one."""
        if self.error is not None:
            raise _Lost(self.error)
        loop = asyncio.get_running_loop()
        fut = self.waiter = loop.create_future()
        timer = loop.call_later(max(timeout, 0.0), _expire, fut)
        try:
            await fut
        finally:
            timer.cancel()
            self.waiter = None
        if self.error is not None and not (self.complete or self.chunks):
            raise _Lost(self.error)

    def take(self) -> bytes:
        """The body bytes buffered so far (resuming a paused socket)."""
        chunks = self.chunks
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self.buffered = 0
        if self.paused and self.transport is not None and not self.closed:
            self.paused = False
            self.transport.resume_reading()
        return data

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    def done(self) -> None:
        """The request is over: a complete answer on a kept-alive connection goes back to
        the pool, any other closes its connection."""
        if self.complete and self.keep_alive and not self.closed and self.error is None:
            self.pool.give_back(self)
        else:
            self.abort()
        self.pool.slots.release()


class _Pool:
    """Connections to one engine (module docstring)."""

    def __init__(self, url: str, limit: int, keepalive_s: float, connect_s: float) -> None:
        u = urlsplit(url)
        self.host = u.hostname or "127.0.0.1"
        self.ssl: ssl.SSLContext | None = (ssl.create_default_context()
                                           if u.scheme == "https" else None)
        self.port = u.port or (443 if self.ssl else 80)
        default = (u.scheme == "https" and self.port == 443) or (u.scheme == "http"
                                                                  and self.port == 80)
        self.host_header = (u.netloc.rpartition("@")[2] if not default else self.host).encode()
        self.keepalive_s = keepalive_s
        self.connect_s = connect_s
        self.slots = asyncio.Semaphore(limit)
        self.idle: collections.deque[_Conn] = collections.deque()

    def idle_conn(self) -> _Conn | None:
        """The idle connection that waited longest and is still fit to use (idle past
        ``keepalive_s`` or closed: closed and skipped). Oldest first, as aiohttp's pool: every
        kept connection stays in use, none idles out while the load dips and has to be
        opened again when it rises (most recent first did: a burst of connects at 128
        streams, each one more chance of a connect timeout on a starved machine)."""
        idle = self.idle
        now = time.monotonic()
        while idle:
            c = idle.popleft()
            if not c.closed and now - c.idle_since <= self.keepalive_s and \
                    c.transport is not None and not c.transport.is_closing():
                return c
            c.abort()
        return None

    def give_back(self, conn: _Conn) -> None:
        conn.idle_since = time.monotonic()
        self.idle.append(conn)

    async def connect(self, timeout: float) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(max(min(timeout, self.connect_s), 0.0)):
                _, conn = await loop.create_connection(lambda: _Conn(self), self.host,
                                                       self.port, ssl=self.ssl)
        except TimeoutError:
            raise UpstreamIOError(Failure.TIMEOUT, f"connect to {self.host}:{self.port} "
                                                   "timed out") from None
        except OSError as e:
            raise UpstreamIOError(Failure.CONNECT, f"cannot connect to {self.host}:"
                                                   f"{self.port}: {e}") from None
        return conn

    def close(self) -> None:
        while self.idle:
            self.idle.pop().abort()


def _head(path: bytes, host: bytes, body: bytes, headers: dict[str, str]) -> bytes:
    lines = [b"POST ", path, b" HTTP/1.1\r\nHost: ", host, b"\r\nContent-Length: ",
             str(len(body)).encode(), b"\r\n"]
    for k, v in headers.items():
        if "\r" in v or "\n" in v or "\r" in k or "\n" in k or ":" in k:
            raise ValueError(f"invalid header {k!r}")
        lines.append(f"{k}: {v}\r\n".encode())
    lines.append(b"\r\n")
    return b"".join(lines)


class _H1Stream:
    """An answer being read (``upstream.Stream``)."""

    def __init__(self, conn: _Conn, idle_s: float) -> None:
        self.conn = conn
        self.status = conn.status
        self.idle_s = idle_s
        self._over = False

    def chunks(self) -> AsyncIterator[bytes]:
        return self

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self

    async def __anext__(self) -> bytes:
        c = self.conn
        while True:
            if c.chunks:
                return c.take()
            if c.complete:
                await self.close()  # the connection goes back before the relay ends
                raise StopAsyncIteration
            try:
                await c.wait(self.idle_s)
            except TimeoutError:
                raise UpstreamIOError(Failure.TIMEOUT, "read timed out") from None
            except _Lost as e:
                raise UpstreamIOError(Failure.PROTOCOL, str(e)) from None

    async def read(self) -> bytes:
        return b"".join([x async for x in self])

    async def close(self) -> None:
        if not self._over:
            self._over = True
            self.conn.done()


class H1Upstream:
    name = "h1"

    def __init__(self, urls: Iterable[str], connect_s: float, max_connections: int,
                 keepalive_s: float, on_resend: Callable[[], None] | None = None) -> None:
        self.on_resend = on_resend or _nothing
        self.urls = list(urls)
        self.connect_s = connect_s
        self.max_connections = max_connections
        self.keepalive_s = keepalive_s
        self._pools: dict[str, _Pool] = {}  # scheme://host:port -> its pool
        self._by_url: dict[str, tuple[_Pool, bytes]] = {}  # full URL -> (pool, path)

    def _route(self, url: str) -> tuple[_Pool, bytes]:
        got = self._by_url.get(url)
        if got is None:
            u = urlsplit(url)
            base = f"{u.scheme}://{u.netloc}"
            pool = self._pools.get(base)
            if pool is None:
                pool = self._pools[base] = _Pool(base, self.max_connections, self.keepalive_s,
                                                 self.connect_s)
            path = (u.path or "/") + (f"?{u.query}" if u.query else "")
            got = (pool, path.encode())
            if len(self._by_url) < 4096:  # engine URLs x paths: a handful
                self._by_url[url] = got
        return got

    async def _send(self, url: str, body: bytes, headers: dict[str, str],
                    deadline: float) -> _Conn:
        """The connection once the answer's status and headers arrived (its slot held until
        ``_Conn.done``); resent once after a stale pooled connection."""
        pool, path = self._route(url)
        head = _head(path, pool.host_header, body, headers)
        loop = asyncio.get_running_loop()
        if pool.slots.locked():
            try:
                async with asyncio.timeout(max(deadline - loop.time(), 0.0)):
                    await pool.slots.acquire()
            except TimeoutError:
                raise UpstreamIOError(Failure.TIMEOUT, "no free connection in time") from None
        else:
            await pool.slots.acquire()  # free: returns at once
        conn: _Conn | None = None
        try:
            for resend in (False, True):
                conn = None if resend else pool.idle_conn()
                reused = conn is not None
                if conn is None:
                    conn = await pool.connect(deadline - loop.time())
                conn.start()
                assert conn.transport is not None
                conn.transport.write(head + body)
                try:
                    while not conn.headers_done:
                        await conn.wait(deadline - loop.time())
                    return conn
                except _Lost as e:
                    if resend or not reused or conn.answered:
                        raise UpstreamIOError(Failure.PROTOCOL, str(e)) from None
                    conn.abort()
                    self.on_resend()
            raise AssertionError("unreachable")  # pragma: no cover
        except TimeoutError:
            if conn is not None:
                conn.abort()
            pool.slots.release()
            raise UpstreamIOError(Failure.TIMEOUT, "timed out") from None
        except BaseException:
            if conn is not None:
                conn.abort()
            pool.slots.release()
            raise

    async def post(self, url: str, body: bytes, headers: dict[str, str], total_s: float,
                   ) -> tuple[int, bytes]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + total_s
        conn = await self._send(url, body, headers, deadline)
        try:
            parts: list[bytes] = []
            while not conn.complete:
                try:
                    await conn.wait(deadline - loop.time())
                except TimeoutError:
                    raise UpstreamIOError(Failure.TIMEOUT, "timed out") from None
                except _Lost as e:
                    raise UpstreamIOError(Failure.PROTOCOL, str(e)) from None
                if conn.chunks:
                    parts.append(conn.take())
            if conn.chunks:
                parts.append(conn.take())
            return conn.status, parts[0] if len(parts) == 1 else b"".join(parts)
        finally:
            conn.done()

    async def open(self, url: str, body: bytes, headers: dict[str, str], idle_s: float,
                   ) -> Stream:
        loop = asyncio.get_running_loop()
        conn = await self._send(url, body, headers, loop.time() + idle_s)
        return _H1Stream(conn, idle_s)

    async def aclose(self) -> None:
        for p in self._pools.values():
            p.close()
        self._pools.clear()
        self._by_url.clear()
