"""The P/D flow of one request: prove, choose, prefill, decode, retain.

For a request in P/D mode:

1. If it names a conversation, ``take`` the retained decode params (single
   use) and prove the new prompt starts with the token ids they cover
   (``store.prove_prefix``); trim or drop otherwise. Prompt ids come from the
   request (completions token prompt) or the engine's ``/tokenize``.
2. Choose a prefill (indexer lookup -> least in-flight -> round robin), ask the
   indexer for a peer source, run the prefill leg (``max_tokens=1``,
   non-streaming, ``do_remote_decode``, D->P params and/or ``remote_kv_source``)
   with the verified ids so no engine re-tokenizes differently.
3. Choose a decode, hand it the prefill's params, relay its answer. A tracked
   conversation runs decode non-streaming (vLLM returns ``kv_transfer_params``
   only there) with ``return_token_ids`` and keeps D's params plus
   ``prompt ids + generated ids`` for the next turn; a streaming client then
   gets the answer re-emitted as SSE (``stream_capture: buffered``).

Faults: a leg that cannot connect, times out or answers 5xx is retried on
another instance (reuse params dropped when they may be the cause); when no
prefill works the request is recomputed on one instance (direct mode); when no
decode works, the same. Engine 4xx answers go back to the client unchanged.

Threading model: one ``Router`` per app, driven by its event loop. The store,
pool and metrics are only touched from that loop.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from kvtier.router.config import RouterConfig
from kvtier.router.indexer_client import IndexerClient
from kvtier.router.metrics import RouterMetrics
from kvtier.router.pool import InstancePool, InstanceState
from kvtier.router.requests import (
    Endpoint,
    Inbound,
    decode_body,
    direct_body,
    prefill_body,
    tokenize_body,
)
from kvtier.router.sse import DONE, chat_events, completion_events, error_event
from kvtier.router.store import (
    ConversationStore,
    RetainedKV,
    ReuseDecision,
    ReuseOutcome,
    prove_prefix,
)

from kvtier.ids import ConversationId, PodId
from kvtier.transfer_params import KVTransferParams, NixlParams

log = logging.getLogger("kvtier.router")


class UpstreamError(Exception):
    """A leg failed for a reason that is not the client's fault."""

    def __init__(self, leg: str, inst: InstanceState | None, kind: str, detail: str = ""):
        super().__init__(f"{leg} on {inst.name if inst else '-'}: {kind} {detail}".strip())
        self.leg, self.inst, self.kind = leg, inst, kind


class EngineClientError(Exception):
    """An engine answered 4xx: the request itself is bad; relay it."""

    def __init__(self, status: int, body: Any):
        super().__init__(f"engine answered {status}")
        self.status, self.body = status, body


@dataclass
class Reply:
    status: int = 200
    json: Any = None
    stream: AsyncIterator[bytes] | None = None
    info: dict[str, Any] = field(default_factory=dict)


def tenant_of(api_key: str | None) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()[:16] if api_key else ""


class Router:
    def __init__(self, config: RouterConfig, transport: httpx.AsyncBaseTransport | None = None):
        self.cfg = config
        self.metrics = RouterMetrics()
        self.pool = InstancePool(config.prefill_instances, config.decode_instances,
                                 config.eject_after_failures)
        self.store = ConversationStore(config.store_max_entries, config.store_max_bytes)
        t = config.timeouts
        self.client = httpx.AsyncClient(
            transport=transport,
            timeout=httpx.Timeout(t.decode_idle_s, connect=t.connect_s),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=512),
        )
        self.indexer = (IndexerClient(config.indexer, self.client, t.indexer_s)
                        if config.indexer else None)
        self._health_task: asyncio.Task | None = None

    # ---- lifecycle -------------------------------------------------------
    async def start(self) -> None:
        self._health_task = asyncio.create_task(self._health_loop())

    async def stop(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            try:
                await self._health_task
            except (asyncio.CancelledError, Exception):
                pass
        await self.client.aclose()

    async def _health_loop(self) -> None:
        while True:
            await self.pool.check_all(self.client, self.cfg.timeouts.health_s)
            self._refresh_gauges()
            await asyncio.sleep(self.cfg.health_interval_s)

    def _refresh_gauges(self) -> None:
        m = self.metrics
        for inst in self.pool.all():
            m.healthy.labels(inst.name, inst.cfg.role.value).set(1 if inst.healthy else 0)
            m.in_flight.labels(inst.name).set(inst.in_flight)
        m.conversations.set(len(self.store))
        m.store_bytes.set(self.store.nbytes)

    # ---- entry point -----------------------------------------------------
    async def handle(self, inb: Inbound, tenant: str, headers: dict[str, str]) -> Reply:
        if inb.mode == "direct":
            return await self._direct(inb, headers, reason="mode")
        ids = inb.prompt_ids
        decision = ReuseDecision(ReuseOutcome.NONE, None, 0)
        if inb.conversation is not None:
            entry, expired = self.store.take(tenant, inb.conversation)
            if expired:
                self.metrics.params_dropped.labels("expired").inc()
                decision = ReuseDecision(ReuseOutcome.EXPIRED, None, 0)
            if entry is not None:
                if ids is None:
                    ids = await self._tokenize(inb, headers)
                decision = self._prove(entry, ids)
        return await self._pd(inb, headers, tenant, ids, decision)

    def _prove(self, entry: RetainedKV, ids: tuple[int, ...] | None) -> ReuseDecision:
        if ids is None:
            self.metrics.params_dropped.labels("untokenized").inc()
            return ReuseDecision(ReuseOutcome.STALE, None, 0)
        if not self.pool.by_name.get(entry.decode_pod, None) or \
                not self.pool.by_name[entry.decode_pod].healthy:
            self.metrics.params_dropped.labels("decode_down").inc()
            return ReuseDecision(ReuseOutcome.STALE, None, 0)
        d = prove_prefix(entry, ids, self.cfg.block_size)
        if d.outcome is ReuseOutcome.STALE:
            self.metrics.params_dropped.labels("stale").inc()
        elif d.outcome is ReuseOutcome.TRIMMED:
            self.metrics.params_trimmed.inc()
        return d

    # ---- the P/D flow ----------------------------------------------------
    async def _pd(self, inb: Inbound, headers: dict[str, str], tenant: str,
                  ids: tuple[int, ...] | None, decision: ReuseDecision) -> Reply:
        info: dict[str, Any] = {"reuse": decision.outcome.value}
        model_ns = self.cfg.indexer_model or inb.model
        matched: dict[PodId, int] | None = None
        if ids is not None and self.indexer is not None:
            matched = await self.indexer.lookup(model_ns, ids)
            if matched is None:
                self.metrics.indexer_unavailable.labels("lookup").inc()
        reuse = decision.params
        tried: set[PodId] = set()
        pre: dict | None = None
        p_inst: InstanceState | None = None
        status_failures = 0
        for _ in range(self.cfg.max_retries + 1):
            p_inst = self.pool.choose(self.pool.prefill, matched, exclude=tried)
            if p_inst is None:
                break
            source = None
            if ids is not None and self.indexer is not None:
                answered, source = await self.indexer.source(
                    model_ns, ids, p_inst.name, self.cfg.min_cached_token_delta,
                    self.cfg.block_size)
                if not answered:
                    self.metrics.indexer_unavailable.labels("source").inc()
            path = ("dp_read" if reuse is not None else "p2p" if source is not None
                    else "local" if (matched or {}).get(p_inst.name) else "none")
            kvp = KVTransferParams.prefill_request(reuse=reuse, source=source).to_wire()
            body = prefill_body(inb, kvp, ids)
            if inb.conversation is not None and ids is None:
                body["return_token_ids"] = True  # learn the prompt ids for the next turn
            try:
                pre = await self._post_json(p_inst, "prefill", inb.endpoint.path, body, headers,
                                            self.cfg.timeouts.prefill_s)
                self.metrics.reuse.labels(path).inc()
                if reuse is not None:
                    self.metrics.reused_tokens.inc(decision.reused_tokens)
                info.update(prefill=p_inst.name, path=path)
                break
            except EngineClientError:
                if reuse is None and source is None:
                    raise
                # Our reuse params may be what the engine refused: retry without.
                self._drop_reuse("rejected", reuse)
                reuse, decision = None, ReuseDecision(ReuseOutcome.STALE, None, 0)
            except UpstreamError as e:
                self.metrics.retries.labels("prefill", "elsewhere").inc()
                # A 5xx from a failed D->P read (e.g. a NIXL handshake that timed
                # out under load) leaves D's blocks pinned: retry them once. Any
                # other failure may have consumed them: recompute instead.
                if e.kind == "status" and status_failures == 0:
                    status_failures += 1
                elif e.kind != "connect":
                    self._drop_reuse("rejected", reuse)
                    reuse = None
                if e.kind in ("connect", "timeout", "protocol"):
                    tried.add(p_inst.name)
        if pre is None:
            self.metrics.retries.labels("prefill", "recompute").inc()
            return await self._direct(inb, headers, reason="prefill_failed", avoid=tried)
        if ids is None and inb.conversation is not None:
            ids = _prompt_ids_of(inb.endpoint, pre)
        p_params = KVTransferParams.from_wire(pre.get("kv_transfer_params"))
        p_wire = p_params.nixl.model_dump(exclude_none=True) if p_params and p_params.nixl else None
        return await self._decode(inb, headers, tenant, ids, p_wire, info)

    def _drop_reuse(self, reason: str, reuse: NixlParams | None) -> None:
        if reuse is not None:
            self.metrics.params_dropped.labels(reason).inc()

    async def _decode(self, inb: Inbound, headers: dict[str, str], tenant: str,
                      ids: tuple[int, ...] | None, p_params: dict | None,
                      info: dict[str, Any]) -> Reply:
        capture = inb.conversation is not None and ids is not None and p_params is not None
        if inb.stream and self.cfg.stream_capture == "passthrough":
            capture = False
        upstream_stream = inb.stream and not capture
        tried: set[PodId] = set()
        timed_out = False
        for attempt in range(self.cfg.max_retries + 1):
            d = self.pool.choose(self.pool.decode, exclude=tried)
            if d is None:
                break
            # P keeps the prompt's blocks until a decode reads them (or its lease
            # ends): after a refused/5xx read they are still there, so the first
            # retry reuses them; after that the decode recomputes the prompt.
            params = p_params if attempt <= 1 and not timed_out else None
            body = decode_body(inb, params, ids, stream=upstream_stream, want_ids=capture)
            info["decode"] = d.name
            try:
                if upstream_stream:
                    return await self._relay(d, "decode", inb, body, headers, info)
                resp = await self._post_json(d, "decode", inb.endpoint.path, body, headers,
                                             self.cfg.timeouts.decode_idle_s)
            except UpstreamError as e:
                self.metrics.retries.labels("decode", "elsewhere").inc()
                timed_out = timed_out or e.kind in ("timeout", "protocol")
                if e.kind in ("connect", "timeout", "protocol"):
                    tried.add(d.name)
                continue
            if capture:
                self._retain(inb.conversation, tenant, d, ids, resp)  # type: ignore[arg-type]
            return self._answer(inb, resp, info)
        self.metrics.retries.labels("decode", "recompute").inc()
        return await self._direct(inb, headers, reason="decode_failed", avoid=tried)

    def _retain(self, conv: ConversationId, tenant: str, d: InstanceState,
                ids: tuple[int, ...], resp: dict) -> None:
        params = KVTransferParams.from_wire(resp.get("kv_transfer_params"))
        choices = resp.get("choices") or []
        if not params or not params.nixl or not params.nixl.has_remote_blocks or not choices:
            return
        gen = choices[0].get("token_ids")
        if not isinstance(gen, list):
            return
        entry = RetainedKV.build(conv, tenant, d.name, params.nixl, [*ids, *gen],
                                 time.monotonic() + self.cfg.entry_ttl_s)
        self.store.put(entry)

    def _answer(self, inb: Inbound, resp: dict, info: dict[str, Any]) -> Reply:
        _clean_response(resp, inb.client_wants_token_ids)
        if not inb.stream:
            return Reply(200, json=resp, info=info)
        events = (chat_events if inb.endpoint is Endpoint.CHAT else completion_events)(
            resp, inb.include_usage)
        return Reply(200, stream=_aiter(events), info=info)

    async def _direct(self, inb: Inbound, headers: dict[str, str], reason: str,
                      avoid: set[PodId] | None = None) -> Reply:
        """Serve the whole request on one instance (no P/D, no KV params).

        Decode instances first (serving whole requests is their job), then
        prefills; instances that already failed this request are skipped."""
        tried: set[PodId] = set(avoid or ())
        info: dict[str, Any] = {"direct": reason, "reuse": "none"}
        self.metrics.reuse.labels("none").inc()
        last: UpstreamError | None = None
        for _ in range(self.cfg.max_retries + 1):
            inst = (self.pool.choose([d for d in self.pool.decode if d.healthy], exclude=tried)
                    or self.pool.choose(self.pool.decode + self.pool.prefill, exclude=tried))
            if inst is None:
                break
            body = direct_body(inb)
            info["decode"] = inst.name
            try:
                if inb.stream:
                    return await self._relay(inst, "direct", inb, body, headers, info)
                resp = await self._post_json(inst, "direct", inb.endpoint.path, body, headers,
                                             self.cfg.timeouts.decode_idle_s)
                _clean_response(resp, True)
                return Reply(200, json=resp, info=info)
            except UpstreamError as e:
                last = e
                self.metrics.retries.labels("direct", "elsewhere").inc()
                tried.add(inst.name)
        raise last or UpstreamError("direct", None, "no_instance")

    # ---- upstream I/O ----------------------------------------------------
    async def _tokenize(self, inb: Inbound, headers: dict[str, str]) -> tuple[int, ...] | None:
        tried: set[PodId] = set()
        for _ in range(2):
            inst = self.pool.choose(self.pool.prefill or self.pool.decode, exclude=tried)
            if inst is None:
                return None
            try:
                out = await self._post_json(inst, "tokenize", "/tokenize", tokenize_body(inb),
                                            headers, self.cfg.timeouts.tokenize_s)
            except UpstreamError:
                tried.add(inst.name)
                continue
            toks = out.get("tokens")
            if isinstance(toks, list) and all(isinstance(t, int) for t in toks):
                return tuple(toks)
            return None
        return None

    async def _post_json(self, inst: InstanceState, leg: str, path: str, body: dict,
                         headers: dict[str, str], timeout_s: float) -> dict:
        with self.pool.busy(inst):
            try:
                r = await self.client.post(
                    inst.url + path, json=body, headers=headers,
                    timeout=httpx.Timeout(timeout_s, connect=self.cfg.timeouts.connect_s))
            except httpx.ConnectError as e:
                raise self._fail(leg, inst, "connect", e, hard=True) from None
            except httpx.TimeoutException as e:
                raise self._fail(leg, inst, "timeout", e) from None
            except httpx.HTTPError as e:
                raise self._fail(leg, inst, "protocol", e) from None
        if 400 <= r.status_code < 500:
            raise EngineClientError(r.status_code, _json_or_text(r))
        if r.status_code != 200:
            raise self._fail(leg, inst, "status", r.status_code)
        try:
            out = r.json()
        except ValueError as e:
            raise self._fail(leg, inst, "protocol", e) from None
        if not isinstance(out, dict):
            raise self._fail(leg, inst, "protocol", "non-object body")
        self.pool.mark_ok(inst) if not inst.healthy else None
        return out

    def _fail(self, leg: str, inst: InstanceState, kind: str, detail: Any,
              hard: bool = False) -> UpstreamError:
        self.metrics.upstream_errors.labels(leg, kind).inc()
        if kind in ("connect", "timeout", "protocol"):
            self.pool.mark_failed(inst, hard=hard)
            if hard:
                dropped = self.store.discard_pod(inst.name)
                if dropped:
                    self.metrics.params_dropped.labels("decode_down").inc(dropped)
        log.warning("upstream %s failed on %s: %s %s", leg, inst.name, kind, detail)
        return UpstreamError(leg, inst, kind, str(detail))

    async def _relay(self, inst: InstanceState, leg: str, inb: Inbound, body: dict,
                     headers: dict[str, str], info: dict[str, Any]) -> Reply:
        """Open a streaming leg; retryable until the first byte, relayed as-is after."""
        busy = self.pool.busy(inst)
        busy.__enter__()
        req = self.client.build_request(
            "POST", inst.url + inb.endpoint.path, json=body, headers=headers,
            timeout=httpx.Timeout(self.cfg.timeouts.decode_idle_s,
                                  connect=self.cfg.timeouts.connect_s))
        try:
            resp = await self.client.send(req, stream=True)
        except httpx.ConnectError as e:
            busy.__exit__(None, None, None)
            raise self._fail(leg, inst, "connect", e, hard=True) from None
        except httpx.TimeoutException as e:
            busy.__exit__(None, None, None)
            raise self._fail(leg, inst, "timeout", e) from None
        except httpx.HTTPError as e:
            busy.__exit__(None, None, None)
            raise self._fail(leg, inst, "protocol", e) from None
        if resp.status_code != 200:
            raw = await resp.aread()
            await resp.aclose()
            busy.__exit__(None, None, None)
            if 400 <= resp.status_code < 500:
                try:
                    err: Any = json.loads(raw)
                except ValueError:
                    err = {"error": {"message": raw.decode(errors="replace")}}
                raise EngineClientError(resp.status_code, err)
            raise self._fail(leg, inst, "status", resp.status_code)

        async def gen() -> AsyncIterator[bytes]:
            try:
                async for chunk in resp.aiter_raw():
                    yield chunk
            except httpx.HTTPError as e:
                # Mid-stream failure: bytes already reached the client, so say so
                # in-band rather than cut the stream silently.
                self._fail(leg, inst, "midstream", e)
                yield error_event(f"upstream {leg} failed mid-stream")
                yield DONE
            finally:
                await resp.aclose()
                busy.__exit__(None, None, None)

        return Reply(200, stream=gen(), info=info)


def _prompt_ids_of(endpoint: Endpoint, resp: dict) -> tuple[int, ...] | None:
    if endpoint is Endpoint.CHAT:
        ids = resp.get("prompt_token_ids")
    else:
        ch = resp.get("choices") or [{}]
        ids = ch[0].get("prompt_token_ids")
    if isinstance(ids, list) and ids and all(isinstance(t, int) for t in ids):
        return tuple(ids)
    return None


def _clean_response(resp: dict, keep_ids: bool) -> None:
    """Never show clients the engines' transfer params (block ids, hosts)."""
    resp.pop("kv_transfer_params", None)
    if keep_ids:
        return
    resp.pop("prompt_token_ids", None)
    for ch in resp.get("choices") or []:
        if isinstance(ch, dict):
            ch.pop("token_ids", None)
            ch.pop("prompt_token_ids", None)


def _json_or_text(r: httpx.Response) -> Any:
    try:
        return r.json()
    except ValueError:
        return {"error": {"message": r.text[:2000], "code": r.status_code}}


async def _aiter(it: Iterator[bytes]) -> AsyncIterator[bytes]:
    for x in it:
        yield x
