"""Upstream I/O of the router: the HTTP legs to engines and the calls to the indexer.

``Legs`` owns the app's upstream HTTP clients: ``upstream.Upstream`` for the engine legs
(the lean client of ``h1.py`` when httptools is installed, else aiohttp, else httpx; one
bounded pool of kept-alive connections per engine instance, ``pool_max_connections`` / ``pool_keepalive_s``) and an httpx client for health
checks, the indexer and ``/v1/models``. A leg either returns what the engine answered or
raises:

- ``EngineClientError``: the engine answered 4xx; the request itself is bad, the answer is
  relayed to the client as it is.
- ``UpstreamError``: anything else (refused, timed out, broken, 5xx); its ``kind`` is a
  ``retry.Failure`` and ``flow`` decides, by its ``RetryPolicy``, where to try again.

Every failure is counted (``upstream_errors``) and reported to the pool: a refused
connection ejects at once (the engine is gone, and with it the KV it retained: ``pod_down``
is told); legs that time out or break count toward a ``legs`` ejection that only a
successful leg lifts (``pool.leg_ok``).

A streaming leg is not handed to the client until its first SSE event arrived and is an
event vLLM would send (a ``data:`` JSON object, not an error): garbage, an error event, a
timeout or a closed connection before it fail the leg like any other (retried, or a 502 with
a message), because the client's 200 is not sent yet.
Indexer calls never raise: an unavailable indexer is counted and the request served anyway.

``ReuseReport`` is what a prefill leg reused; it travels with the answer (and with an error
raised after a prefill answered) to the response headers it defines (see app.py).

Threading model: one ``Legs`` per router app, used from its event loop only; the pool and the
metrics it updates belong to the same loop.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import httpx
import msgspec

from kvtier.ids import PodId
from kvtier.router.config import RouterConfig
from kvtier.router.h1 import H1Upstream, httptools_available
from kvtier.router.indexer_client import IndexerClient, Route
from kvtier.router.metrics import RouterMetrics
from kvtier.router.pool import InstancePool, InstanceState
from kvtier.router.retry import Attempts, Failure
from kvtier.router.sse import first_event_problem
from kvtier.router.upstream import (
    AiohttpUpstream,
    HttpxUpstream,
    Upstream,
    UpstreamIOError,
    aiohttp_available,
)
from kvtier.wire.reuse_headers import ReuseReport

log = logging.getLogger("kvtier.router")


class UpstreamError(Exception):
    """A leg failed for a reason that is not the client's fault."""

    def __init__(self, leg: str, inst: InstanceState | None, kind: Failure,
                 detail: str = "") -> None:
        super().__init__(f"{leg} on {inst.name if inst else '-'}: {kind} {detail}".strip())
        self.leg, self.inst, self.kind = leg, inst, kind
        self.reuse: ReuseReport | None = None  # set when a prefill leg had answered


class StreamBroken(Exception):
    """A relayed stream's connection broke after its first event (already counted)."""


class EngineClientError(Exception):
    """An engine answered 4xx: the request itself is bad; relay it."""

    def __init__(self, status: int, body: Any) -> None:
        super().__init__(f"engine answered {status}")
        self.status, self.body = status, body
        self.reuse: ReuseReport | None = None  # set when a prefill leg had answered


class Legs:
    def __init__(self, config: RouterConfig, pool: InstancePool, metrics: RouterMetrics,
                 pod_down: Callable[[PodId], None],
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.cfg = config
        self.pool = pool
        self.metrics = metrics
        self._pod_down = pod_down
        t = config.timeouts
        n = config.pool_max_connections
        limits = httpx.Limits(max_connections=n, max_keepalive_connections=n,
                              keepalive_expiry=config.pool_keepalive_s)
        # Health checks, the indexer and /v1/models: light traffic, httpx.
        self.client = httpx.AsyncClient(transport=transport, limits=limits,
                                        timeout=httpx.Timeout(t.health_s, connect=t.connect_s))
        urls = [i.url for i in pool.all()]
        kind: str = config.upstream_client
        if kind == "auto":
            # The lean client (h1.py) where httptools is installed (uvicorn's standard
            # extras bring it), else aiohttp, else httpx; a test transport means httpx.
            kind = ("httpx" if transport is not None else "h1" if httptools_available()
                    else "aiohttp" if aiohttp_available() else "httpx")
        resent = metrics.stale_resends.inc
        self.upstream: Upstream
        if kind == "h1":
            self.upstream = H1Upstream(urls, t.connect_s, n, config.pool_keepalive_s, resent)
        elif kind == "aiohttp" and transport is None:
            self.upstream = AiohttpUpstream(urls, t.connect_s, n, config.pool_keepalive_s,
                                            resent)
        else:
            self.upstream = HttpxUpstream(urls, t.connect_s, n, config.pool_keepalive_s,
                                          transport, resent)
        self.indexer = (IndexerClient(config.indexer, self.client, t.indexer_s)
                        if config.indexer else None)
        self.indexer_ok: bool | None = None  # the last indexer call's fate (None: none yet)

    async def aclose(self) -> None:
        await self.upstream.aclose()
        await self.client.aclose()

    # ---- engines ---------------------------------------------------------
    async def post_json(self, inst: InstanceState, leg: str, path: str, body: dict[str, Any],
                        headers: dict[str, str], timeout_s: float) -> dict[str, Any]:
        """One non-streaming leg: the engine's JSON object answer."""
        with self.pool.busy(inst):
            try:
                status, raw = await self.upstream.post(inst.url + path, _dumps(body), headers,
                                                       timeout_s)
            except UpstreamIOError as e:
                raise self._io_failure(leg, inst, e) from None
        if 400 <= status < 500:
            raise EngineClientError(status, _json_or_text(status, raw))
        if status != 200:
            raise self._fail(leg, inst, Failure.STATUS, status)
        try:
            out = loads(raw)
        except ValueError as e:
            raise self._fail(leg, inst, Failure.PROTOCOL, e) from None
        if not isinstance(out, dict) or (path.endswith("completions")
                                          and not isinstance(out.get("choices"), list)):
            raise self._fail(leg, inst, Failure.PROTOCOL, "not a completion object")
        self.pool.leg_ok(inst)
        return out

    async def open_stream(self, inst: InstanceState, leg: str, path: str, body: dict[str, Any],
                          headers: dict[str, str]) -> AsyncIterator[bytes]:
        """Open a streaming leg. Until its first event it fails like any leg (and is retried);
        the returned iterator relays the engine's bytes as they are."""
        held = contextlib.AsyncExitStack()
        # The instance counts as busy until the relay ends, not until this returns.
        held.enter_context(self.pool.busy(inst))
        try:
            try:
                resp = await self.upstream.open(inst.url + path, _dumps(body), headers,
                                                self.cfg.timeouts.decode_idle_s)
            except UpstreamIOError as e:
                raise self._io_failure(leg, inst, e) from None
            held.push_async_callback(resp.close)
            if resp.status != 200:
                try:
                    raw = await resp.read()
                except UpstreamIOError:
                    raw = b""
                if 400 <= resp.status < 500:
                    raise EngineClientError(resp.status, _json_or_text(resp.status, raw))
                raise self._fail(leg, inst, Failure.STATUS, resp.status)
            chunks = resp.chunks()
            head = await self._first_event(inst, leg, chunks)
        except BaseException:
            await held.aclose()
            raise
        self.pool.leg_ok(inst)
        return self._relay(inst, leg, head, chunks, held)

    async def _first_event(self, inst: InstanceState, leg: str,
                           chunks: AsyncIterator[bytes]) -> bytes:
        """Read up to the end of the stream's first SSE event and check it is one vLLM
        would send; the bytes read so far (to be relayed first)."""
        head = b""
        try:
            while b"\n\n" not in head:
                try:
                    head += await anext(chunks)
                except StopAsyncIteration:
                    raise self._fail(leg, inst, Failure.PROTOCOL,
                                     "stream ended before its first event") from None
                if len(head) > _MAX_FIRST_EVENT:
                    raise self._fail(leg, inst, Failure.PROTOCOL, "no event boundary")
        except UpstreamIOError as e:
            raise self._io_failure(leg, inst, e) from None
        problem = first_event_problem(head[:head.index(b"\n\n")])
        if problem is not None:
            kind = Failure.STATUS if problem == "error event" else Failure.PROTOCOL
            raise self._fail(leg, inst, kind, f"first event: {problem}")
        return head

    async def _relay(self, inst: InstanceState, leg: str, head: bytes,
                     chunks: AsyncIterator[bytes],
                     held: contextlib.AsyncExitStack) -> AsyncIterator[bytes]:
        async with held:
            yield head
            try:
                async for chunk in chunks:
                    yield chunk
            except UpstreamIOError as e:
                # Mid-stream failure: bytes already reached the client; the relay above
                # says so in-band (an error event and [DONE]) rather than cut it silently.
                self._fail(leg, inst, Failure.MIDSTREAM, e)
                raise StreamBroken(f"upstream {leg} failed mid-stream") from None

    def _io_failure(self, leg: str, inst: InstanceState, e: UpstreamIOError) -> UpstreamError:
        return self._fail(leg, inst, e.kind, e, hard=e.kind is Failure.CONNECT)

    def _fail(self, leg: str, inst: InstanceState, kind: Failure, detail: object,
              hard: bool = False) -> UpstreamError:
        self.metrics.upstream_errors.labels(leg, kind).inc()
        if kind is Failure.CONNECT:
            self.pool.mark_failed(inst, hard=hard)
            if hard:
                self._pod_down(inst.name)
        elif kind in (Failure.TIMEOUT, Failure.PROTOCOL, Failure.MIDSTREAM):
            self.pool.leg_failed(inst)
        log.warning("upstream %s failed on %s: %s %s", leg, inst.name, kind, detail)
        return UpstreamError(leg, inst, kind, str(detail))

    def retrying(self, run: Attempts, inst: InstanceState, e: UpstreamError) -> None:
        """A leg of ``run`` failed on ``inst``: count the retry elsewhere (its policy says
        whether there is one) and keep ``inst`` out of it where the failure says so."""
        self.metrics.retries.labels(run.policy.leg, "elsewhere").inc()
        run.failed(inst.name, e.kind)

    def midstream(self, leg: str, inst: InstanceState, detail: str) -> None:
        """A relayed stream broke after its first event (seen by the caller)."""
        self._fail(leg, inst, Failure.MIDSTREAM, detail)

    # ---- indexer ---------------------------------------------------------
    async def route(self, model: str, ids: Sequence[int],
                    loads: dict[str, int] | None = None) -> Route | None:
        """Cached prefix per pod and the best peer source, from one indexer call; None
        without an indexer or when it is unavailable."""
        if self.indexer is None:
            return None
        found = await self.indexer.route(model, ids, loads)
        self.indexer_ok = found is not None
        if found is None:
            self.metrics.indexer_unavailable.labels("route").inc()
        return found


_MAX_FIRST_EVENT = 1 << 20


class NonFinite:
    """``NaN``, ``Infinity`` or ``-Infinity`` as a client's JSON body had it (``loads``):
    sent on to the engines as it came, which answer for it as before. Standard JSON has no
    such numbers and msgspec writes a non-finite float as ``null``, so they are kept as
    they were written, not as floats."""

    __slots__ = ("raw",)

    def __init__(self, text: str) -> None:
        self.raw = msgspec.Raw(text.encode())

    def __repr__(self) -> str:
        return bytes(self.raw).decode()


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, NonFinite):
        return obj.raw
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


# Leg bodies are encoded and answers decoded with msgspec: 5-10x json's time per body, three
# bodies and two answers per request (benchmarks/ROUTER.md).
_ENCODE = msgspec.json.Encoder(enc_hook=_enc_hook).encode
_DECODE = msgspec.json.Decoder().decode


def loads(raw: bytes, constants: bool = False) -> Any:
    """JSON as ``json.loads`` reads it, msgspec's speed for standard JSON. What msgspec
    refuses (``NaN`` and the like, a BOM, another UTF) is read by ``json.loads``: a
    ``ValueError`` (or ``RecursionError``) when that refuses it too; ``constants``: its
    non-finite numbers as ``NonFinite`` (a client's body, sent on as it came)."""
    try:
        return _DECODE(raw)
    except msgspec.DecodeError:
        pass
    return json.loads(raw, parse_constant=NonFinite) if constants else json.loads(raw)


def _dumps(body: dict[str, Any]) -> bytes:
    return _ENCODE(body)


def _json_or_text(status: int, raw: bytes) -> Any:
    try:
        return loads(raw)
    except ValueError:
        return {"error": {"message": raw[:2000].decode(errors="replace"), "code": status}}
