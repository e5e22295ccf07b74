"""The indexer's HTTP API (docs/INTERFACES.md): FastAPI over an ``IndexerService``.

Endpoints: ``GET /healthz``, ``GET /metrics``, ``POST /v1/lookup``,
``POST /v1/source``, ``POST /v1/route`` (both from one hashing),
``GET /v1/pods`` (details), ``POST /v1/pods`` (add: ``{"spec": "NAME=tcp://..."}``
or PodSpec fields; with ``stream`` set, another stream of an existing pod),
``DELETE /v1/pods/{name}`` (every stream of it).

The index backend unreachable (Redis down) is a 503 with ``{"error":
"index backend unavailable: ..."}`` on queries, and ``/healthz`` answers 503
with ``"status": "backend_unavailable"``.

Bodies are decoded with msgspec straight from bytes (validation included:
a 128k-token list decodes in about a millisecond). Every client mistake is a
4xx with ``{"error": "..."}``; unknown routes and methods too. Only a bug
in kvtier yields a 5xx.

Threading model: handlers are ``async`` and answer inline on the event-loop
thread (queries are CPU-bound and short; a thread-pool hop would cost more
than the lookup); the service's own threads do ingestion.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import TypeVar

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvtier.ids import ModelName, PodId
from kvtier.indexer.config import PodSpec
from kvtier.indexer.index import BackendUnavailable
from kvtier.indexer.service import IndexerService, InputError
from kvtier.wire.indexer_api import AddPodRequest, LookupRequest, RouteRequest, SourceRequest

log = logging.getLogger(__name__)
_json = msgspec.json.Encoder()
_T = TypeVar("_T")


def _ok(obj: object, status: int = 200) -> Response:
    return Response(_json.encode(obj), status_code=status, media_type="application/json")


def _err(msg: str, status: int = 400) -> Response:
    return _ok({"error": msg}, status)


def _decode(body: bytes, typ: type[_T]) -> _T:
    if not body:
        raise InputError("request body must be a JSON object")
    try:
        return msgspec.json.decode(body, type=typ)
    except msgspec.ValidationError as e:
        raise InputError(f"invalid request: {e}") from None
    except msgspec.DecodeError as e:
        raise InputError(f"malformed JSON: {e}") from None


def build_app(svc: IndexerService, manage_service: bool = False) -> FastAPI:
    """The ASGI app. ``manage_service``: start/stop ``svc`` with the app's lifespan
    (the daemon; shutdown then runs before uvicorn re-raises SIGTERM)."""
    lifespan: Callable[[FastAPI], AbstractAsyncContextManager[None]] | None = None
    if manage_service:
        @asynccontextmanager
        async def _lifespan(_app: FastAPI) -> AsyncIterator[None]:
            svc.start()
            try:
                yield
            finally:
                svc.stop()
                log.info("indexer stopped")

        lifespan = _lifespan

    app = FastAPI(title="kvtier indexer", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=lifespan)

    @app.exception_handler(InputError)
    async def _input_error(_req: Request, e: InputError) -> Response:
        return _err(str(e), e.status)

    @app.exception_handler(BackendUnavailable)
    async def _backend_down(_req: Request, e: BackendUnavailable) -> Response:
        log.warning("index backend unavailable: %s", e)
        return _err(f"index backend unavailable: {e}", 503)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_req: Request, e: StarletteHTTPException) -> Response:
        return _err(str(e.detail), e.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_req: Request, e: RequestValidationError) -> Response:
        return _err(f"invalid request: {e.errors()}", 400)

    @app.get("/healthz")
    async def healthz() -> Response:
        down = svc.backend_error()
        if down is not None:
            return _ok({"status": "backend_unavailable", "error": down,
                        "pods": svc.pod_status()}, 503)
        return _ok({"status": "ok", "pods": svc.pod_status()})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(svc.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/lookup")
    async def lookup(request: Request) -> Response:
        req = _decode(await request.body(), LookupRequest)
        return _ok(svc.lookup(ModelName(req.model), req.token_ids))

    @app.post("/v1/source")
    async def source(request: Request) -> Response:
        req = _decode(await request.body(), SourceRequest)
        return _ok(svc.source(ModelName(req.model), req.token_ids, PodId(req.target_pod),
                              req.min_cached_token_delta, req.loads))

    @app.post("/v1/route")
    async def route(request: Request) -> Response:
        req = _decode(await request.body(), RouteRequest)
        target = None if req.target_pod is None else PodId(req.target_pod)
        return _ok(svc.route(ModelName(req.model), req.token_ids, target,
                             req.min_cached_token_delta, req.loads))

    @app.get("/v1/pods")
    async def pods() -> Response:
        return _ok({"pods": svc.pod_details()})

    @app.post("/v1/pods")
    async def add_pod(request: Request) -> Response:
        req = _decode(await request.body(), AddPodRequest)
        try:
            if req.spec is not None:
                spec = PodSpec.parse(req.spec)
                if req.stream is not None:
                    spec = PodSpec.model_validate({**spec.model_dump(), "stream": req.stream})
            else:
                fields = {k: v for k, v in msgspec.structs.asdict(req).items()
                          if v is not None and k != "spec"}
                spec = PodSpec.model_validate(fields)
        except (ValidationError, ValueError) as e:
            raise InputError(f"invalid pod: {e}") from None
        st = svc.add_pod(spec)
        return _ok({"added": spec.name, "stream": st.name}, 201)

    @app.delete("/v1/pods/{name}")
    async def remove_pod(name: str) -> Response:
        svc.remove_pod(PodId(name))
        return _ok({"removed": name})

    return app


def serve(svc: IndexerService, host: str, port: int) -> None:
    """Run the daemon until SIGINT/SIGTERM (the service starts and stops with the app)."""
    import uvicorn

    uvicorn.run(build_app(svc, manage_service=True), host=host, port=port,
                log_level="warning", access_log=False)
