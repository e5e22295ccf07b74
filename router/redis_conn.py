"""One pipelined connection to Redis (RESP2), for the conversation store.

Why not redis-py's asyncio client: per call it takes a connection from its pool, wraps the
command in its retry and parser layers and gives the connection back; measured alone on this
machine's localhost that is ~110 us per Lua script call, against ~35 us for the same script
written on one socket here. The store makes one call per operation, on the request path, so
that difference is most of what a Redis store adds to a turn. This module does only what the
store needs: send a command, match its reply, run a Lua script by SHA (loading it once).

``RedisConn.send`` writes the command to the socket at once, before it returns, when the
connection is up: commands reach Redis in the order they were sent (a turn's write, sent
before its answer goes out, is in Redis's queue ahead of any later lookup from this process),
and concurrent calls share the socket (pipelined; replies are matched first in, first out).

Faults: a call not answered within ``timeout_s``, or a connection that drops, fails every
call in flight on it (``TimeoutError``, ``ConnectionError``) and closes it; the next call
connects again. A deadline is Redis's, not this process's: when the loop itself was held up
past it (a busy or starved router: the deadline's timer runs late), the reply may be waiting
unread in the socket, so the call fails only if it is still unanswered after one more poll
(else a starved router drops writes that Redis answered in time). An error reply raises
``ReplyError`` and leaves the connection up.

URLs: ``redis://[user:password@]HOST[:PORT][/DB]``, ``rediss://`` (TLS, the system's
certificates) and ``unix:///PATH[?db=N]``.

Threading model: one asyncio event loop owns a ``RedisConn``; nothing here blocks.
"""

from __future__ import annotations

import asyncio
import hashlib
import ssl
from collections import deque
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import parse_qs, unquote, urlparse

Reply = Any  # bytes | int | None | list[Reply]: what RESP2 carries
# A deadline seen this late (s) was held up by this process, not Redis (``_Protocol._timed_out``).
_LAG_S = 0.02


class ReplyError(Exception):
    """Redis answered the command with an error (``-ERR ...``, ``-NOSCRIPT ...``)."""


@dataclass(frozen=True)
class Target:
    host: str
    port: int
    path: str | None  # a unix socket
    tls: bool
    db: int
    username: str | None
    password: str | None

    @classmethod
    def from_url(cls, url: str) -> Target:
        p = urlparse(url)
        q = parse_qs(p.query)
        if p.scheme == "unix":
            return cls("", 0, p.path, False, int(q.get("db", ["0"])[0]),
                       unquote(p.username) if p.username else None,
                       unquote(p.password) if p.password else None)
        db = p.path.strip("/") or q.get("db", ["0"])[0]
        return cls(p.hostname or "127.0.0.1", p.port or 6379, None, p.scheme == "rediss",
                   int(db), unquote(p.username) if p.username else None,
                   unquote(p.password) if p.password else None)


class Script:
    """A Lua script, run by its SHA1 (``EVALSHA``), loaded by ``EVAL`` when Redis lacks it."""

    def __init__(self, body: str) -> None:
        self.body = body.encode()
        self.sha = hashlib.sha1(self.body).hexdigest().encode()


def pack(args: tuple[bytes | str | int, ...]) -> bytes:
    """A command as RESP: an array of bulk strings."""
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        b = a if isinstance(a, bytes) else str(a).encode()
        out.append(b"$%d\r\n" % len(b))
        out.append(b)
        out.append(b"\r\n")
    return b"".join(out)


class _Incomplete(Exception):
    pass


def _parse(buf: bytearray, i: int) -> tuple[Reply, int]:
    """One reply starting at ``buf[i]``, and where the next starts; ``_Incomplete`` when
    ``buf`` does not hold all of it yet."""
    e = buf.find(b"\r\n", i)
    if e < 0:
        raise _Incomplete
    kind = buf[i]
    line = bytes(buf[i + 1:e])
    i = e + 2
    if kind == 36:  # $ bulk string
        n = int(line)
        if n < 0:
            return None, i
        if len(buf) < i + n + 2:
            raise _Incomplete
        return bytes(buf[i:i + n]), i + n + 2
    if kind == 42:  # * array
        n = int(line)
        if n < 0:
            return None, i
        out = []
        for _ in range(n):
            v, i = _parse(buf, i)
            out.append(v)
        return out, i
    if kind == 58:  # : integer
        return int(line), i
    if kind == 43:  # + simple string
        return line, i
    if kind == 45:  # - error
        return ReplyError(line.decode(errors="replace")), i
    raise ConnectionError(f"not a RESP reply: {bytes(buf[i:i + 20])!r}")


class _Protocol(asyncio.Protocol):
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.buf = bytearray()
        self.waiting: deque[tuple[asyncio.Future[Reply], asyncio.TimerHandle]] = deque()
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.gone = asyncio.get_running_loop().create_future()  # the socket is closed

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but have its methods.
        self.transport = cast(asyncio.Transport, transport)

    def send(self, data: bytes) -> asyncio.Future[Reply]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Reply] = loop.create_future()
        if self.closed or self.transport is None:
            fut.set_exception(ConnectionError("redis connection closed"))
            return fut
        timer = loop.call_later(self.timeout_s, self._timed_out, fut, loop.time() + self.timeout_s)
        self.waiting.append((fut, timer))
        self.transport.write(data)
        return fut

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        pos = 0
        try:
            while self.waiting and pos < len(buf):
                value, pos_next = _parse(buf, pos)
                pos = pos_next
                fut, timer = self.waiting.popleft()
                timer.cancel()
                if fut.done():
                    continue
                if isinstance(value, ReplyError):
                    fut.set_exception(value)
                else:
                    fut.set_result(value)
        except _Incomplete:
            pass
        except (ConnectionError, ValueError) as e:
            self._fail(ConnectionError(f"redis sent garbage: {e}"))
            return
        if pos:
            del buf[:pos]

    def _timed_out(self, fut: asyncio.Future[Reply], due: float | None) -> None:
        """``fut``'s deadline ``due`` passed (None: its second look, after a poll)."""
        if fut.done() or self.closed:
            return
        loop = asyncio.get_running_loop()
        if due is not None and loop.time() - due > _LAG_S:
            # This process was held up past the deadline (its loop busy, or the process not
            # scheduled), not necessarily Redis: the reply may be in the socket unread, and
            # uvloop runs due timers before it polls its sockets. Look again after one poll.
            loop.call_later(_LAG_S, self._timed_out, fut, None)
            return
        self._fail(TimeoutError(f"redis did not answer within {self.timeout_s} s"))

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(ConnectionError(f"redis connection lost: {exc or 'closed'}"))
        if not self.gone.done():
            self.gone.set_result(None)

    def _fail(self, exc: BaseException) -> None:
        self.closed = True
        while self.waiting:
            fut, timer = self.waiting.popleft()
            timer.cancel()
            if not fut.done():
                fut.set_exception(exc)
        if self.transport is not None:
            self.transport.abort()


class RedisConn:
    def __init__(self, url: str, timeout_s: float, scripts: tuple[Script, ...] = ()) -> None:
        """``scripts`` are loaded on every connect, so their ``EVALSHA`` is answered at once
        (a ``NOSCRIPT`` retry would run after commands sent meanwhile)."""
        self.target = Target.from_url(url)
        self.timeout_s = timeout_s
        self.scripts = scripts
        self._proto: _Protocol | None = None
        self._connecting: asyncio.Task[_Protocol] | None = None

    @property
    def connected(self) -> bool:
        return self._proto is not None and not self._proto.closed

    async def _connect(self) -> _Protocol:
        t = self.target
        loop = asyncio.get_running_loop()

        def factory() -> _Protocol:
            return _Protocol(self.timeout_s)
        if t.path is not None:
            conn = loop.create_unix_connection(factory, t.path)
        else:
            conn = loop.create_connection(factory, t.host, t.port,
                                          ssl=ssl.create_default_context() if t.tls else None)
        _, proto = await asyncio.wait_for(conn, self.timeout_s)
        hello: list[asyncio.Future[Reply]] = []
        if t.password is not None:
            auth = (t.username, t.password) if t.username else (t.password,)
            hello.append(proto.send(pack(("AUTH", *auth))))
        if t.db:
            hello.append(proto.send(pack(("SELECT", t.db))))
        hello.extend(proto.send(pack(("SCRIPT", "LOAD", s.body))) for s in self.scripts)
        try:
            for f in hello:
                await f
        except BaseException:
            proto._fail(ConnectionError("redis handshake failed"))
            raise
        self._proto = proto
        return proto

    async def _connected(self) -> _Protocol:
        if self._connecting is None:
            self._connecting = asyncio.get_running_loop().create_task(self._connect())
        task = self._connecting
        try:
            return await asyncio.shield(task)
        finally:
            if task.done() and self._connecting is task:
                self._connecting = None

    def send(self, *args: bytes | str | int) -> asyncio.Future[Reply] | None:
        """Write the command now and return its reply's future; None when not connected
        (``call`` connects)."""
        p = self._proto
        if p is None or p.closed:
            return None
        return p.send(pack(args))

    async def call(self, *args: bytes | str | int) -> Reply:
        fut = self.send(*args)
        if fut is None:
            fut = (await self._connected()).send(pack(args))
        return await fut

    def send_script(self, script: Script, keys: list[str],
                    args: list[bytes | str | int]) -> asyncio.Future[Reply] | None:
        """``EVALSHA`` written now (``send``); a script Redis lacks needs ``run_script``."""
        return self.send(b"EVALSHA", script.sha, len(keys), *keys, *args)

    async def run_script(self, script: Script, keys: list[str],
                         args: list[bytes | str | int],
                         sent: asyncio.Future[Reply] | None = None) -> Reply:
        """The reply of ``script``; ``sent``: its ``EVALSHA`` already written."""
        try:
            if sent is None:
                return await self.call(b"EVALSHA", script.sha, len(keys), *keys, *args)
            return await sent
        except ReplyError as e:
            if not str(e).startswith("NOSCRIPT"):
                raise
        return await self.call(b"EVAL", script.body, len(keys), *keys, *args)

    async def aclose(self) -> None:
        if self._connecting is not None:
            self._connecting.cancel()
            try:
                await self._connecting
            except BaseException:  # noqa: BLE001 - closing: how the connect ended is moot
                pass
            self._connecting = None
        p, self._proto = self._proto, None
        if p is not None and p.transport is not None:
            p.closed = True
            p.transport.close()
            # The socket is closed by the loop after this call: wait for it.
            await asyncio.wait([p.gone], timeout=self.timeout_s)
