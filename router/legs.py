"""Upstream I/O of the router: the HTTP legs to engines and the calls to the indexer.

``Legs`` owns the app's one ``httpx.AsyncClient``. A leg either returns what the engine
answered or raises:

- ``EngineClientError``: the engine answered 4xx; the request itself is bad, the answer is
  relayed to the client as it is.
- ``UpstreamError``: anything else (refused, timed out, broken, 5xx); its ``kind`` is a
  ``retry.Failure`` and ``flow`` decides, by its ``RetryPolicy``, where to try again.

Every failure is counted (``upstream_errors``) and reported to the pool (ejection). A refused
connection means the engine is gone, and with it the KV it retained: ``pod_down`` is told.
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
from kvtier.router.config import RouterConfig
from kvtier.router.indexer_client import IndexerClient
from kvtier.router.metrics import RouterMetrics
from kvtier.router.pool import InstancePool, InstanceState
from kvtier.router.retry import Failure
from kvtier.router.sse import DONE, error_event

from kvtier.ids import PodId
from kvtier.transfer_params import RemoteKVSource
from kvtier.wire.reuse_headers import ReuseReport

log = logging.getLogger("kvtier.router")


class UpstreamError(Exception):
    """A leg failed for a reason that is not the client's fault."""

    def __init__(self, leg: str, inst: InstanceState | None, kind: Failure,
                 detail: str = "") -> None:
        super().__init__(f"{leg} on {inst.name if inst else '-'}: {kind} {detail}".strip())
        self.leg, self.inst, self.kind = leg, inst, kind
        self.reuse: ReuseReport | None = None  # set when a prefill leg had answered


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
        self.client = httpx.AsyncClient(
            transport=transport,
            timeout=httpx.Timeout(t.decode_idle_s, connect=t.connect_s),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=512),
        )
        self.indexer = (IndexerClient(config.indexer, self.client, t.indexer_s)
                        if config.indexer else None)

    async def aclose(self) -> None:
        await self.client.aclose()

    # ---- engines ---------------------------------------------------------
    async def post_json(self, inst: InstanceState, leg: str, path: str, body: dict[str, Any],
                        headers: dict[str, str], timeout_s: float) -> dict[str, Any]:
        """One non-streaming leg: the engine's JSON object answer."""
        with self.pool.busy(inst):
            try:
                r = await self.client.post(inst.url + path, json=body, headers=headers,
                                           timeout=self._timeout(timeout_s))
            except httpx.HTTPError as e:
                raise self._transport_failure(leg, inst, e) from None
        if 400 <= r.status_code < 500:
            raise EngineClientError(r.status_code, _json_or_text(r))
        if r.status_code != 200:
            raise self._fail(leg, inst, Failure.STATUS, r.status_code)
        try:
            out = r.json()
        except ValueError as e:
            raise self._fail(leg, inst, Failure.PROTOCOL, e) from None
        if not isinstance(out, dict):
            raise self._fail(leg, inst, Failure.PROTOCOL, "non-object body")
        if not inst.healthy:
            self.pool.mark_ok(inst)
        return out

    async def open_stream(self, inst: InstanceState, leg: str, path: str, body: dict[str, Any],
                          headers: dict[str, str]) -> AsyncIterator[bytes]:
        """Open a streaming leg. Until its first byte it fails like any leg (and is retried);
        the returned iterator relays the engine's bytes as they are."""
        held = contextlib.AsyncExitStack()
        # The instance counts as busy until the relay ends, not until this returns.
        held.enter_context(self.pool.busy(inst))
        try:
            req = self.client.build_request("POST", inst.url + path, json=body, headers=headers,
                                            timeout=self._timeout(self.cfg.timeouts.decode_idle_s))
            try:
                resp = await self.client.send(req, stream=True)
            except httpx.HTTPError as e:
                raise self._transport_failure(leg, inst, e) from None
            held.push_async_callback(resp.aclose)
            if resp.status_code != 200:
                raw = await resp.aread()
                if 400 <= resp.status_code < 500:
                    try:
                        err: Any = json.loads(raw)
                    except ValueError:
                        err = {"error": {"message": raw.decode(errors="replace")}}
                    raise EngineClientError(resp.status_code, err)
                raise self._fail(leg, inst, Failure.STATUS, resp.status_code)
        except BaseException:
            await held.aclose()
            raise
        return self._relay(inst, leg, resp, held)

    async def _relay(self, inst: InstanceState, leg: str, resp: httpx.Response,
                     held: contextlib.AsyncExitStack) -> AsyncIterator[bytes]:
        async with held:
            try:
                async for chunk in resp.aiter_raw():
                    yield chunk
            except httpx.HTTPError as e:
                # Mid-stream failure: bytes already reached the client, so say so
                # in-band rather than cut the stream silently.
                self._fail(leg, inst, Failure.MIDSTREAM, e)
                yield error_event(f"upstream {leg} failed mid-stream")
                yield DONE

    def _timeout(self, total_s: float) -> httpx.Timeout:
        return httpx.Timeout(total_s, connect=self.cfg.timeouts.connect_s)

    def _transport_failure(self, leg: str, inst: InstanceState,
                           e: httpx.HTTPError) -> UpstreamError:
        if isinstance(e, httpx.ConnectError):
            return self._fail(leg, inst, Failure.CONNECT, e, hard=True)
        if isinstance(e, httpx.TimeoutException):
            return self._fail(leg, inst, Failure.TIMEOUT, e)
        return self._fail(leg, inst, Failure.PROTOCOL, e)

    def _fail(self, leg: str, inst: InstanceState, kind: Failure, detail: object,
              hard: bool = False) -> UpstreamError:
        self.metrics.upstream_errors.labels(leg, kind).inc()
        if kind in (Failure.CONNECT, Failure.TIMEOUT, Failure.PROTOCOL):
            self.pool.mark_failed(inst, hard=hard)
            if hard:
                self._pod_down(inst.name)
        log.warning("upstream %s failed on %s: %s %s", leg, inst.name, kind, detail)
        return UpstreamError(leg, inst, kind, str(detail))

    # ---- indexer ---------------------------------------------------------
    async def lookup(self, model: str, ids: Sequence[int]) -> dict[PodId, int] | None:
        """Cached prefix per pod; None without an indexer or when it is unavailable."""
        if self.indexer is None:
            return None
        matched = await self.indexer.lookup(model, ids)
        if matched is None:
            self.metrics.indexer_unavailable.labels("lookup").inc()
        return matched

    async def source(self, model: str, ids: Sequence[int],
                     target: PodId) -> RemoteKVSource | None:
        """A peer host tier ``target`` should pull the prefix from, if any is worth it."""
        if self.indexer is None:
            return None
        answered, source = await self.indexer.source(
            model, ids, target, self.cfg.min_cached_token_delta, self.cfg.block_size)
        if not answered:
            self.metrics.indexer_unavailable.labels("source").inc()
        return source


def _json_or_text(r: httpx.Response) -> Any:
    try:
        return r.json()
    except ValueError:
        return {"error": {"message": r.text[:2000], "code": r.status_code}}
