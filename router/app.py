"""The router's HTTP face: an OpenAI-compatible FastAPI app.

``create_app(config)`` builds a ready app (tests, the demo and the A/B harness
run it in-process); ``kvtier router`` serves it with uvicorn. Routes:
``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``,
``DELETE /v1/conversations/{id}`` (forget a conversation, release its decode blocks),
``POST /v1/responses`` and ``GET /v1/responses/{id}`` (passed through to one instance with
response-id affinity: ``responses.py``),
``GET /healthz``, ``GET /metrics``.

Completions answers carry the router's reuse decision (``legs.ReuseReport``) as
response headers: ``x-kvtier-reuse: PATH; tokens=N`` (PATH a ``ReusePath``, N the
prompt tokens the prefill leg was to reuse from it) and ``x-kvtier-outcome:
OUTCOME`` (an ``Outcome``: what became of the conversation's retained device
KV). Error answers carry them when a prefill leg had answered before the error.

Every client error is a 4xx with an OpenAI-style ``{"error": {...}}`` body;
engine 4xx answers are relayed; only upstream failures the router cannot
recover from become 502/503. A body larger than ``max_body_bytes`` is refused
(413) from its Content-Length, or as soon as that many bytes streamed in, never
read whole. A client that disconnects cancels the upstream request (until the
answer starts: the server's own ``http.disconnect`` message, awaited, not polled;
streaming: the relay generator is closed, which closes the engine connection and
vLLM aborts).

Engines see an allow-list of headers (``requests.forward_headers``): the router's
own request id (also returned as ``x-request-id``; the client's is only logged, as
``client_request_id``), W3C trace context, and the engine API key when configured.

Threading model: one event loop; the ``Router`` (store, pool, metrics) lives in
``app.state.router`` and is only touched from that loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import ClientDisconnect
from starlette.routing import Route

from kvtier.ids import ConversationId
from kvtier.router.config import RouterConfig
from kvtier.router.flow import Reply, Router, tenant_of
from kvtier.router.legs import EngineClientError, UpstreamError, loads
from kvtier.router.metrics import RouterMetrics
from kvtier.router.requests import (
    MAX_CONVERSATION_ID_LEN,
    BadRequest,
    Endpoint,
    Inbound,
    forward_headers,
    parse_inbound,
)
from kvtier.router.responses import add_routes as add_responses_routes
from kvtier.router.retention import Released
from kvtier.wire.reuse_headers import ReuseReport

log = logging.getLogger("kvtier.router")

_UNREAD = object()  # serve(): the body is still to be read


def create_app(config: RouterConfig, transport: httpx.AsyncBaseTransport | None = None,
               health_checks: bool = True) -> FastAPI:
    """Build the router app. ``transport`` replaces the upstream HTTP transport
    (a recording wrapper in tests); ``health_checks=False`` disables the loop."""
    router = Router(config, transport=transport)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await router.start(health_checks)
        try:
            yield
        finally:
            await router.stop()

    app = _App(title="kvtier router", lifespan=lifespan, docs_url=None, redoc_url=None,
               openapi_url=None)
    app.state.router = router
    api = _Api(router)
    # The two completion routes are served straight from ``_App.__call__``; the Starlette
    # routes stay for anything that walks the app's routes.
    app.hot = {"/v1/chat/completions": api.chat, "/v1/completions": api.completions}
    routes = app.router.routes
    routes.append(Route("/v1/chat/completions", api.chat, methods=["POST"]))
    routes.append(Route("/v1/completions", api.completions, methods=["POST"]))
    routes.append(Route("/v1/conversations/{conversation_id:path}", api.close_conversation,
                        methods=["DELETE"]))
    add_responses_routes(app, router, api.authorize, api.error, _read_body, api.serve)
    app.add_api_route("/v1/models", api.models, methods=["GET"])
    app.add_api_route("/healthz", api.healthz, methods=["GET"])
    app.add_api_route("/metrics", api.metrics, methods=["GET"])
    return app


class _App(FastAPI):
    """FastAPI, with ``POST`` to the completion routes handed straight to their handler.

    Starlette's stack (error and exception middleware, FastAPI's exit-stack middleware,
    route matching by regex) was a tenth of the router's CPU per request at 128 streams
    (benchmarks/ROUTER.md); those two routes use none of it. What the stack would do for
    them is done here: an exception before the answer started is a plain 500, re-raised for
    the server to log, like Starlette's ``ServerErrorMiddleware``. Every other request
    (other routes, other methods, lifespan) goes through the whole stack."""

    hot: dict[str, Callable[[Request], Awaitable[Response]]] = {}

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            handler = self.hot.get(scope["path"])
            if handler is not None:
                scope["app"] = self
                if self.root_path:
                    scope["root_path"] = self.root_path
                try:
                    response = await handler(Request(scope, receive, send))
                except Exception:
                    await PlainTextResponse("Internal Server Error", status_code=500)(
                        scope, receive, send)
                    raise
                await response(scope, receive, send)
                return
        await super().__call__(scope, receive, send)


class _Api:
    """The app's handlers over one ``Router``."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self.cfg = router.cfg
        self._keys = tuple(router.cfg.api_keys)

    def authorize(self, request: Request) -> str | None:
        """Tenant of the caller; None if auth is on and the caller has no valid key."""
        if not self._keys:
            return ""
        auth = request.headers.get("authorization", "")
        token = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        if token and any(secrets.compare_digest(token, k) for k in self._keys):
            return tenant_of(token)
        return None

    @staticmethod
    def error(status: int, message: str, kind: str = "invalid_request_error",
              reuse: ReuseReport | None = None) -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": kind, "code": status}},
                            status_code=status, headers=_reuse_headers(reuse))

    def _unauthorized(self) -> JSONResponse:
        return self.error(401, "missing or invalid bearer token", "authentication_error")

    async def chat(self, request: Request) -> Response:
        return await self.serve(request, Endpoint.CHAT)

    async def completions(self, request: Request) -> Response:
        return await self.serve(request, Endpoint.COMPLETIONS)

    async def serve(self, request: Request, endpoint: Endpoint, raw: Any = _UNREAD,
                    after: Callable[[Reply], None] | None = None) -> Response:
        """One request through the P/D flow. ``raw``: its body, when the caller has already
        read and decoded it; ``after``: told of the reply before it is sent."""
        t0 = time.perf_counter()
        rid = secrets.token_hex(12)
        m = self.router.metrics
        tenant = self.authorize(request)
        if tenant is None:
            m.requests.labels(endpoint.value, "401").inc()
            return self._unauthorized()
        try:
            if raw is _UNREAD:
                raw = _json_body(await _read_body(request, self.cfg.max_body_bytes))
            headers = {k.lower(): v for k, v in request.headers.items()}
            inb = parse_inbound(endpoint, raw, headers)
        except BadRequest as e:
            m.bad_requests.inc()
            m.requests.labels(endpoint.value, str(e.status)).inc()
            return JSONResponse(e.body(), status_code=e.status)
        fwd = forward_headers(headers, rid, self.cfg.engine_api_key)
        gone = _Disconnect(request)
        try:
            reply: Reply | None = await self.router.handle(inb, tenant, fwd)
        except asyncio.CancelledError:
            if not gone.left():
                raise
            reply = None  # the client left: the upstream call under us was cancelled
        except EngineClientError as e:
            gone.close()
            m.requests.labels(endpoint.value, str(e.status)).inc()
            return JSONResponse(e.body, status_code=e.status,
                                headers={**_reuse_headers(e.reuse), "x-request-id": rid})
        except UpstreamError as e:
            gone.close()
            m.requests.labels(endpoint.value, "502").inc()
            log.error("request failed", extra={"request_id": rid,
                      "conversation_id": inb.conversation, "error": str(e)})
            return self.error(502, f"no engine could serve the request: {e}",
                              "upstream_error", e.reuse)
        except BaseException:
            gone.close()
            raise
        if reply is None:
            m.client_disconnects.inc()
            m.requests.labels(endpoint.value, "499").inc()
            return Response(status_code=499)
        return self._answer(reply, inb, endpoint, rid, headers, gone, t0, after)

    def _answer(self, reply: Reply, inb: Inbound, endpoint: Endpoint, rid: str,
                headers: dict[str, str], gone: _Disconnect, t0: float,
                after: Callable[[Reply], None] | None) -> Response:
        """The reply as the client gets it, timed and logged (a stream: when it ends)."""
        m = self.router.metrics
        stream_label = "true" if inb.stream else "false"
        fields = self._served_fields(reply, inb, endpoint, rid, headers, t0)
        out_headers = {**_reuse_headers(reply.reuse), "x-request-id": rid}
        if after is not None:
            after(reply)
        if reply.stream is None:
            gone.close()
            dt = time.perf_counter() - t0
            m.ttft.labels(endpoint.value, stream_label).observe(dt)
            m.e2e.labels(endpoint.value, stream_label).observe(dt)
            m.requests.labels(endpoint.value, str(reply.status)).inc()
            if fields is not None:
                log.info("served", extra={**fields, "ms": round(dt * 1e3, 2)})
            return JSONResponse(reply.json, status_code=reply.status, headers=out_headers)
        return _SSEResponse(reply.stream, gone, _Timing(m, endpoint.value, stream_label, t0,
                                                        fields),
                            headers={"cache-control": "no-cache", **out_headers})

    def _served_fields(self, reply: Reply, inb: Inbound, endpoint: Endpoint, rid: str,
                       headers: dict[str, str], t0: float) -> dict[str, object] | None:
        """The ``served`` line's fields, taken when the answer starts; None: not logged.
        ``prefill_ms``: from ``t0`` (the request came in) to its prefill leg's answer."""
        if not (self.cfg.log_requests and log.isEnabledFor(logging.INFO)):
            return None
        fields: dict[str, object] = {
            "request_id": rid, "conversation_id": inb.conversation,
            "endpoint": endpoint.value, "stream": inb.stream, **reply.log.fields(),
            "reuse_path": reply.reuse.path.value, "reuse_tokens": reply.reuse.tokens,
            "outcome": reply.reuse.outcome.value}
        if reply.log.prefill_at is not None:
            fields["prefill_ms"] = round((reply.log.prefill_at - t0) * 1e3, 2)
        client_rid = headers.get("x-request-id")
        if client_rid:
            fields["client_request_id"] = client_rid[:128]
        return fields

    async def close_conversation(self, request: Request) -> Response:
        """Forget a conversation's retained turn and release its decode blocks now (OpenAI's
        ``DELETE /v1/conversations/{id}`` shape). Only the tenant that made it can close it;
        anyone else gets the same 404 as for an unknown id."""
        tenant = self.authorize(request)
        if tenant is None:
            return self._unauthorized()
        conv = request.path_params["conversation_id"]
        if not conv or len(conv) > MAX_CONVERSATION_ID_LEN:
            return self.error(400, "invalid conversation id")
        released = await self.router.close(tenant, ConversationId(conv))
        if released is None:
            return self.error(404, f"no retained conversation {conv!r}", "not_found_error")
        log.info("conversation closed", extra={"conversation_id": conv,
                                               "device_blocks": released.value})
        return JSONResponse({"id": conv, "object": "conversation.deleted", "deleted": True,
                             "device_blocks_released": released is Released.RELEASED,
                             "device_blocks": released.value, "detail": released.detail})

    async def models(self, request: Request) -> Response:
        if self.authorize(request) is None:
            return self._unauthorized()
        pool = self.router.pool
        for inst in [*pool.decode, *pool.prefill]:
            if not inst.healthy:
                continue
            try:
                r = await self.router.client.get(inst.url + "/v1/models", timeout=5.0)
            except httpx.HTTPError:
                continue
            if r.status_code == 200:
                return JSONResponse(r.json())
        return self.error(503, "no healthy engine to list models", "upstream_error")

    async def healthz(self) -> Response:
        """200 while a decode instance is admitted (the router can answer); ``down`` names
        each dependency that is not answering (decode, prefill, store, indexer): without
        the store or the indexer the router serves, without reuse or KV-aware choice."""
        router, indexer = self.router, self.cfg.indexer
        pool = router.pool
        inst = {i.name: {"role": i.cfg.role.value, "url": i.url, "healthy": i.healthy,
                         "ejected": i.ejected, "in_flight": i.in_flight} for i in pool.all()}
        store = router.store
        stats = await store.astats()
        deps = {
            "store": {"backend": store.name, "ok": store.ok, "error": store.error},
            "indexer": ({"url": indexer, "ok": router.legs.indexer_ok} if indexer else None),
        }
        down = [name for name, ok in (
            ("decode", any(i.healthy for i in pool.decode)),
            ("prefill", not pool.prefill or any(i.healthy for i in pool.prefill)),
            ("store", store.ok),
            ("indexer", indexer is None or router.legs.indexer_ok is not False),
        ) if not ok]
        ok = "decode" not in down
        return JSONResponse({"status": "ok" if not down else "degraded", "down": down,
                             "instances": inst, "dependencies": deps,
                             "decode_capabilities": router.capabilities.describe(),
                             "conversations": stats.entries},
                            status_code=200 if ok else 503)

    async def metrics(self) -> Response:
        await self.router.refresh_gauges()
        return Response(generate_latest(self.router.metrics.registry),
                        media_type=CONTENT_TYPE_LATEST)


def _json_body(raw: bytes) -> Any:
    try:
        return loads(raw, constants=True)
    except (ValueError, RecursionError):
        raise BadRequest("request body is not valid JSON") from None


def _reuse_headers(reuse: ReuseReport | None) -> dict[str, str]:
    return reuse.headers() if reuse is not None else {}


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused (413) from its Content-Length or once ``limit`` bytes streamed in."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            n = int(declared)
        except ValueError:
            raise BadRequest("invalid Content-Length") from None
        if n > limit:
            raise BadRequest(f"request body too large ({n} > {limit} bytes)", status=413)
    read: bytes | None = getattr(request, "_body", None)  # already read whole (Starlette)
    if read is not None:
        if len(read) > limit:
            raise BadRequest(f"request body too large (> {limit} bytes)", status=413)
        return read
    # The server's messages, read here rather than through ``Request.stream()``: an async
    # generator per request costs its registration with the loop, and this is all it did.
    parts: list[bytes] = []
    size = 0
    receive = request.receive
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BadRequest(f"request body too large (> {limit} bytes)", status=413)
        if chunk:
            parts.append(chunk)
        if not message.get("more_body", False):
            return parts[0] if len(parts) == 1 else b"".join(parts)


class _Disconnect:
    """Cancels the request's task when the client leaves, until ``close()``.

    The body is read, so the next ASGI message the server hands over is
    ``http.disconnect``: one task awaits it (the server wakes it; nothing polls) for the
    whole request, the streamed answer included, instead of a watcher per phase."""

    def __init__(self, request: Request) -> None:
        self.gone = False
        self._task = asyncio.current_task()
        self._watcher: asyncio.Task[None] | None = asyncio.ensure_future(
            self._watch(request.receive))

    async def _watch(self, receive: Any) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.gone = True
        self._watcher = None
        if self._task is not None:
            self._task.cancel()

    def left(self) -> bool:
        """After a CancelledError: True if it was this (then the cancel is absorbed)."""
        if not self.gone:
            return False
        task = self._task
        if task is not None:
            task.uncancel()
        return True

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None
        self._task = None


class _SSEResponse(Response):
    """A text/event-stream answer sent from the request's own task (Starlette's
    StreamingResponse runs two more tasks in an anyio task group per response to hear a
    disconnect; ``_Disconnect`` already does), timed as it goes (``_Timing``)."""

    media_type = "text/event-stream"

    def __init__(self, body: AsyncIterator[bytes], gone: _Disconnect, timing: _Timing,
                 headers: dict[str, str]) -> None:
        # No body attribute: no Content-Length (Response.__init__ would set 0).
        self.status_code = 200
        self.background = None
        self.init_headers(headers)
        self.body_iterator = body
        self.gone = gone
        self.timing = timing

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        body = self.body_iterator
        timing = self.timing
        status = "200"
        try:
            await send({"type": "http.response.start", "status": 200,
                        "headers": self.raw_headers})
            first = True
            async for chunk in body:
                if first:
                    timing.first()
                    first = False
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            # Stop listening first: the server answers "disconnect" once the response is
            # complete, and that must not cancel us.
            self.gone.close()
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            status = "499"
            timing.metrics.client_disconnects.inc()
            if not self.gone.left():
                raise
        except OSError:
            pass  # the client's connection broke: the relay is closed below
        finally:
            self.gone.close()
            timing.end(status)
            aclose = getattr(body, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(BaseException):
                    await aclose()


class _Timing:
    """A streamed answer's metrics and ``served`` line: time to its first chunk, and when it
    ended with what status (499: the client left)."""

    __slots__ = ("metrics", "endpoint", "stream_label", "t0", "fields")

    def __init__(self, metrics: RouterMetrics, endpoint: str, stream_label: str, t0: float,
                 fields: dict[str, object] | None) -> None:
        self.metrics, self.endpoint, self.stream_label = metrics, endpoint, stream_label
        self.t0, self.fields = t0, fields

    def first(self) -> None:
        self.metrics.ttft.labels(self.endpoint, self.stream_label).observe(
            time.perf_counter() - self.t0)

    def end(self, status: str) -> None:
        m = self.metrics
        dt = time.perf_counter() - self.t0
        m.e2e.labels(self.endpoint, self.stream_label).observe(dt)
        m.requests.labels(self.endpoint, status).inc()
        if self.fields is not None:
            log.info("served", extra={**self.fields, "ms": round(dt * 1e3, 2)})
