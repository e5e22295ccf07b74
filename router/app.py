"""The router's HTTP face: an OpenAI-compatible FastAPI app.

``create_app(config)`` builds a ready app (tests, the demo and the A/B harness
run it in-process); ``kvtier router`` serves it with uvicorn. Routes:
``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``,
``GET /healthz``, ``GET /metrics``.

Completions answers carry the router's reuse decision (``legs.ReuseReport``) as
response headers: ``x-kvtier-reuse: PATH; tokens=N`` (PATH a ``ReusePath``, N the
prompt tokens the prefill leg was to reuse from it) and ``x-kvtier-outcome:
OUTCOME`` (an ``Outcome``: what became of the conversation's retained device
KV). Error answers carry them when a prefill leg had answered before the error.

Every client error is a 4xx with an OpenAI-style ``{"error": {...}}`` body;
engine 4xx answers are relayed; only upstream failures the router cannot
recover from become 502/503. A client that disconnects cancels the upstream
request (non-streaming: the awaiting task is cancelled; streaming: the relay
generator is closed, which closes the engine connection and vLLM aborts).

Threading model: one event loop; the ``Router`` (store, pool, metrics) lives in
``app.state.router`` and is only touched from that loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from kvtier.router.config import RouterConfig
from kvtier.router.flow import Reply, Router, tenant_of
from kvtier.router.legs import EngineClientError, UpstreamError
from kvtier.router.metrics import RouterMetrics
from kvtier.router.requests import BadRequest, Endpoint, parse_inbound, strip_headers
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvtier.wire.reuse_headers import ReuseReport

log = logging.getLogger("kvtier.router")


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

    app = FastAPI(title="kvtier router", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.router = router
    keys = tuple(config.api_keys)

    def authorize(request: Request) -> str | None:
        """Tenant of the caller; None if auth is on and the caller has no valid key."""
        if not keys:
            return ""
        auth = request.headers.get("authorization", "")
        token = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        if token and any(secrets.compare_digest(token, k) for k in keys):
            return tenant_of(token)
        return None

    def error(status: int, message: str, kind: str = "invalid_request_error",
              reuse: ReuseReport | None = None) -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": kind, "code": status}},
                            status_code=status, headers=_reuse_headers(reuse))

    async def serve(request: Request, endpoint: Endpoint) -> Response:
        t0 = time.perf_counter()
        rid = request.headers.get("x-request-id") or uuid.uuid4().hex[:16]
        m = router.metrics
        tenant = authorize(request)
        if tenant is None:
            m.requests.labels(endpoint.value, "401").inc()
            return error(401, "missing or invalid bearer token", "authentication_error")
        raw_bytes = await request.body()
        try:
            if len(raw_bytes) > config.max_body_bytes:
                raise BadRequest("request body too large", status=413)
            try:
                raw = json.loads(raw_bytes)
            except (ValueError, RecursionError):
                raise BadRequest("request body is not valid JSON") from None
            headers = {k.lower(): v for k, v in request.headers.items()}
            inb = parse_inbound(endpoint, raw, headers)
        except BadRequest as e:
            m.bad_requests.inc()
            m.requests.labels(endpoint.value, str(e.status)).inc()
            return JSONResponse(e.body(), status_code=e.status)
        fwd = strip_headers(dict(request.headers))
        fwd["x-request-id"] = rid
        stream_label = "true" if inb.stream else "false"
        task = asyncio.ensure_future(router.handle(inb, tenant, fwd))
        try:
            reply = await _until_disconnect(request, task)
        except EngineClientError as e:
            m.requests.labels(endpoint.value, str(e.status)).inc()
            return JSONResponse(e.body, status_code=e.status, headers=_reuse_headers(e.reuse))
        except UpstreamError as e:
            m.requests.labels(endpoint.value, "502").inc()
            log.error("request failed", extra={"request_id": rid,
                      "conversation_id": inb.conversation, "error": str(e)})
            return error(502, f"no engine could serve the request: {e}", "upstream_error",
                         e.reuse)
        if reply is None:
            m.client_disconnects.inc()
            m.requests.labels(endpoint.value, "499").inc()
            return Response(status_code=499)
        fields = {"request_id": rid, "conversation_id": inb.conversation,
                  "endpoint": endpoint.value, "stream": inb.stream, **reply.info,
                  "reuse_path": reply.reuse.path.value, "reuse_tokens": reply.reuse.tokens,
                  "outcome": reply.reuse.outcome.value}
        if reply.stream is None:
            dt = time.perf_counter() - t0
            m.ttft.labels(endpoint.value, stream_label).observe(dt)
            m.e2e.labels(endpoint.value, stream_label).observe(dt)
            m.requests.labels(endpoint.value, str(reply.status)).inc()
            log.info("served", extra={**fields, "ms": round(dt * 1e3, 2)})
            return JSONResponse(reply.json, status_code=reply.status,
                                headers=_reuse_headers(reply.reuse))
        return StreamingResponse(_timed(reply.stream, m, endpoint, stream_label, t0, fields),
                                 media_type="text/event-stream",
                                 headers={"cache-control": "no-cache",
                                          **_reuse_headers(reply.reuse)})

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await serve(request, Endpoint.CHAT)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serve(request, Endpoint.COMPLETIONS)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        if authorize(request) is None:
            return error(401, "missing or invalid bearer token", "authentication_error")
        for inst in [*router.pool.decode, *router.pool.prefill]:
            if not inst.healthy:
                continue
            try:
                r = await router.client.get(inst.url + "/v1/models", timeout=5.0)
            except httpx.HTTPError:
                continue
            if r.status_code == 200:
                return JSONResponse(r.json())
        return error(503, "no healthy engine to list models", "upstream_error")

    @app.get("/healthz")
    async def healthz() -> Response:
        pool = router.pool
        inst = {i.name: {"role": i.cfg.role.value, "url": i.url, "healthy": i.healthy,
                         "in_flight": i.in_flight} for i in pool.all()}
        ok = any(i.healthy for i in pool.decode)
        return JSONResponse({"status": "ok" if ok else "degraded", "instances": inst,
                             "conversations": len(router.store)},
                            status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        router._refresh_gauges()
        return Response(generate_latest(router.metrics.registry),
                        media_type=CONTENT_TYPE_LATEST)

    return app


def _reuse_headers(reuse: ReuseReport | None) -> dict[str, str]:
    return reuse.headers() if reuse is not None else {}


async def _until_disconnect(request: Request, task: asyncio.Future[Reply]) -> Reply | None:
    """Await ``task``; cancel it (and the engine call under it) if the client leaves."""
    async def watch() -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(0.05)

    watcher = asyncio.ensure_future(watch())
    both: set[asyncio.Future[Any]] = {task, watcher}
    try:
        done, _ = await asyncio.wait(both, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    return None


async def _timed(stream: AsyncIterator[bytes], m: RouterMetrics, endpoint: Endpoint,
                 stream_label: str, t0: float, fields: dict[str, Any]) -> AsyncIterator[bytes]:
    first = True
    status = "200"
    try:
        async for chunk in stream:
            if first:
                m.ttft.labels(endpoint.value, stream_label).observe(time.perf_counter() - t0)
                first = False
            yield chunk
    except asyncio.CancelledError:
        status = "499"
        m.client_disconnects.inc()
        raise
    finally:
        dt = time.perf_counter() - t0
        m.e2e.labels(endpoint.value, stream_label).observe(dt)
        m.requests.labels(endpoint.value, status).inc()
        log.info("served", extra={**fields, "ms": round(dt * 1e3, 2)})
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(Exception):
                await aclose()
