"""OpenAI's Responses API through the router: P/D with reuse where it can, else passed through.

vLLM 0.32 serves ``POST /v1/responses`` and accepts ``kv_transfer_params`` there. A request
that sends its whole conversation as ``input`` (``pd_eligible``) goes through the same P/D
flow as chat (``Endpoint.RESPONSES``): a one-token prefill leg, then decode. The prefill is
asked for ``enable_response_messages``, whose raw token ids are the prompt as vLLM rendered
it; the router retains those plus the answer's ids (a non-streamed decode leg's
``output_messages``; a streamed one's from the decode node's params feed, matched by the
feed tag in the leg's ``request_id``) and proves the next turn against them, named (a
conversation id) or by content, so the next turn reads the decode node's KV as a chat turn
does. The prompt is tokenized through ``/tokenize`` with the input mapped to chat messages
(``requests.responses_messages``, plain text messages only); the prefill's own prompt ids
are checked against that before anything it read is trusted. A streamed decode leg is
relayed event by event (``relay.Relay``), its closing event held until the
feed's params are retained; without a feed on that decode node it is relayed without reuse.

The rest is passed through: ``previous_response_id`` names a response stored in one engine
process (the chain lives there), a ``conversation`` object likewise, and ``background``
responses are polled there. Those are served as direct mode serves: the whole request on one
instance (decode nodes first), with:

- **affinity**: a response's id is remembered with its tenant and instance (bounded, oldest
  forgotten), so ``previous_response_id`` and ``GET /v1/responses/{id}`` go where the
  response is stored; another tenant's id is a 404, as an unknown one (responses answered
  through P/D are remembered with their decode instance, where they are stored);
- the same allow-list of headers as every leg (``requests.forward_headers``), client
  ``kv_transfer_params`` refused and engine ``kv_transfer_params`` taken out of answers,
  streamed or not;
- streams relayed as they come (Responses events are named SSE events and end without
  ``[DONE]``); a client that leaves closes the engine's stream (vLLM aborts).

The reuse a passed-through turn gets is the engine's own prefix cache (and its host tier,
when the instance runs kvtier's connector); no D->P read.

Threading model: the router's event loop; the affinity map is only touched there.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvtier.ids import PodId
from kvtier.router.flow import Router
from kvtier.router.pool import InstanceState
from kvtier.router.reply import Reply
from kvtier.router.requests import Endpoint, forward_headers
from kvtier.router.sse import (
    clean_named_event,
    named_events,
    responses_error_event,
    strip_transfer_params,
)

log = logging.getLogger("kvtier.router")

MAX_REMEMBERED = 100_000
_ID_MAX = 256


class Affinity:
    """Response id -> (tenant, instance name), bounded."""

    def __init__(self, limit: int = MAX_REMEMBERED) -> None:
        self._m: OrderedDict[str, tuple[str, str]] = OrderedDict()
        self.limit = limit

    def put(self, rid: str, tenant: str, inst: str) -> None:
        self._m[rid] = (tenant, inst)
        self._m.move_to_end(rid)
        while len(self._m) > self.limit:
            self._m.popitem(last=False)

    def get(self, rid: str, tenant: str) -> str | None:
        v = self._m.get(rid)
        return v[1] if v is not None and v[0] == tenant else None


def pd_eligible(body: dict[str, Any]) -> bool:
    """Whether a Responses request goes through the P/D flow: a whole conversation sent as
    input (no ``previous_response_id``, which names a response stored in one engine, and
    no ``conversation`` object), not in the background."""
    return not (body.get("previous_response_id") or body.get("conversation")
                or body.get("background"))


async def _ids_seen(stream: AsyncIterator[bytes],
                    seen: Callable[[str], None]) -> AsyncIterator[bytes]:
    """``stream`` as it is, telling ``seen`` the id of its ``response.created`` event."""
    told = False
    async for chunk in stream:
        if not told and b"response.created" in chunk:
            for event in chunk.split(b"\n\n"):
                _, _, rid = clean_named_event(event)
                if rid is not None:
                    seen(rid)
                    told = True
        yield chunk


def add_routes(app: FastAPI, router: Router, authorize: Callable[[Request], str | None],
               error: Callable[..., JSONResponse], read_body: Callable[..., Any],
               serve: Callable[..., Awaitable[Response]] | None = None) -> None:
    """``serve``: the app's P/D flow (``serve(request, Endpoint.RESPONSES, raw=body,
    after=...)``), for the requests it takes (module docstring); None: pass everything
    through."""
    cfg = router.cfg
    affinity = Affinity()
    app.state.responses_affinity = affinity

    def choose(pinned: str | None) -> InstanceState | None:
        if pinned is not None:
            inst = router.pool.by_name.get(PodId(pinned))
            if inst is not None and inst.healthy:
                return inst
        pool = router.pool
        return (pool.choose([d for d in pool.decode if d.healthy])
                or pool.choose(pool.decode + pool.prefill))

    async def create(request: Request) -> Response:
        tenant = authorize(request)
        if tenant is None:
            return error(401, "missing or invalid bearer token", "authentication_error")
        try:
            body = json.loads(await read_body(request, cfg.max_body_bytes))
        except ValueError:
            return error(400, "request body is not valid JSON")
        if not isinstance(body, dict) or not isinstance(body.get("model"), str):
            return error(400, "a Responses request needs a JSON object with 'model'")
        if "kv_transfer_params" in body:
            return error(400, "kv_transfer_params is set by the router, not by clients")
        prev = body.get("previous_response_id")
        if prev is not None and not (isinstance(prev, str) and 0 < len(prev) <= _ID_MAX):
            return error(400, "invalid previous_response_id")
        if serve is not None and pd_eligible(body):
            def remember(reply: Reply) -> None:
                out, inst = reply.json, reply.log.decode
                if not inst:
                    return
                if isinstance(out, dict) and isinstance(out.get("id"), str):
                    affinity.put(out["id"], tenant, str(inst))
                elif reply.stream is not None:
                    reply.stream = _ids_seen(reply.stream,
                                             lambda rid: affinity.put(rid, tenant, str(inst)))
            return await serve(request, Endpoint.RESPONSES, raw=body, after=remember)
        pinned = affinity.get(prev, tenant) if prev else None
        if prev and pinned is None:
            return error(404, f"no response {prev!r}", "not_found_error")
        inst = choose(pinned)
        if inst is None:
            return error(503, "no healthy engine", "upstream_error")
        rid = uuid.uuid4().hex[:24]
        headers = forward_headers({k.lower(): v for k, v in request.headers.items()}, rid,
                                  cfg.engine_api_key)
        url = inst.url + "/v1/responses"
        if body.get("stream"):
            return await _stream(url, body, headers, inst, tenant, rid)
        try:
            r = await router.client.post(url, json=body, headers=headers,
                                         timeout=cfg.timeouts.decode_idle_s)
        except httpx.HTTPError as e:
            return error(502, f"no engine could serve the request: {type(e).__name__}",
                         "upstream_error")
        try:
            out = strip_transfer_params(r.json())
        except ValueError:
            return error(502, "upstream answered garbage", "upstream_error")
        if r.status_code == 200 and isinstance(out, dict) and isinstance(out.get("id"), str):
            affinity.put(out["id"], tenant, inst.name)
        log.info("served", extra={"request_id": rid, "endpoint": "responses",
                                  "decode": inst.name, "direct": "responses"})
        return JSONResponse(out, status_code=r.status_code,
                            headers={"x-request-id": rid, "x-kvtier-reuse": "none; tokens=0"})

    async def _stream(url: str, body: dict[str, Any], headers: dict[str, str],
                      inst: InstanceState, tenant: str, rid: str) -> Response:
        req = router.client.build_request("POST", url, json=body, headers=headers,
                                          timeout=httpx.Timeout(cfg.timeouts.decode_idle_s))
        try:
            resp = await router.client.send(req, stream=True)
        except httpx.HTTPError as e:
            return error(502, f"no engine could serve the request: {type(e).__name__}",
                         "upstream_error")
        if resp.status_code != 200:
            raw = await resp.aread()
            await resp.aclose()
            try:
                return JSONResponse(strip_transfer_params(json.loads(raw)),
                                    status_code=resp.status_code)
            except ValueError:
                return error(502, "upstream answered garbage", "upstream_error")

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for event in named_events(resp.aiter_bytes()):
                    yield remembered(event, tenant, inst.name)
            except httpx.HTTPError:
                yield responses_error_event("upstream stream broke")
            finally:
                await resp.aclose()

        return StreamingResponse(relay(), media_type="text/event-stream",
                                 headers={"x-request-id": rid, "cache-control": "no-cache",
                                          "x-kvtier-reuse": "none; tokens=0"})

    def remembered(event: bytes, tenant: str, inst: str) -> bytes:
        out, _, rid = clean_named_event(event)
        if rid is not None:
            affinity.put(rid, tenant, inst)
        return out

    async def get(request: Request) -> Response:
        tenant = authorize(request)
        if tenant is None:
            return error(401, "missing or invalid bearer token", "authentication_error")
        rid = request.path_params["response_id"]
        pinned = affinity.get(rid, tenant) if len(rid) <= _ID_MAX else None
        inst = router.pool.by_name.get(PodId(pinned)) if pinned else None
        if inst is None:
            return error(404, f"no response {rid!r}", "not_found_error")
        headers = forward_headers({}, uuid.uuid4().hex[:24], cfg.engine_api_key)
        try:
            r = await router.client.get(f"{inst.url}/v1/responses/{rid}", headers=headers,
                                        timeout=cfg.timeouts.health_s)
            out = strip_transfer_params(r.json())
        except (httpx.HTTPError, ValueError):
            return error(502, "the engine holding this response did not answer",
                         "upstream_error")
        return JSONResponse(out, status_code=r.status_code)

    app.router.routes.append(Route("/v1/responses", create, methods=["POST"]))
    app.router.routes.append(Route("/v1/responses/{response_id}", get, methods=["GET"]))

