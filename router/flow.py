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

Every answer carries a ``ReuseReport``: the reuse path its prefill leg took (``ReusePath``),
the prompt tokens that path was planned to supply, and the ``Outcome`` for the conversation's
retained KV (the proof's, or ``stale`` when the engine refused the params).

Faults: the legs themselves (HTTP, errors) are in ``legs.py``; where a failed leg
is tried again is ``retry.py``'s ``RetryPolicies``: a leg that cannot connect,
times out or answers 5xx is retried on another instance (reuse params dropped
when they may be the cause); when no prefill works the request is recomputed
on one instance (direct mode); when no decode works, the same. Engine 4xx
answers go back to the client unchanged.

Threading model: one ``Router`` per app, driven by its event loop. The store,
pool and metrics are only touched from that loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from kvtier.router.config import RouterConfig
from kvtier.router.legs import EngineClientError, Legs, UpstreamError
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
from kvtier.router.retry import Attempts, Exhausted, Failure, RetryPolicies
from kvtier.router.sse import chat_events, completion_events
from kvtier.router.store import ConversationStore, RetainedKV, ReuseDecision, prove_prefix

from kvtier.cost.decide import Offer, decide
from kvtier.cost.model import CostModel
from kvtier.ids import ConversationId, Outcome, PodId, ReusePath
from kvtier.transfer_params import KVTransferParams, NixlParams, RemoteKVSource
from kvtier.wire.reuse_headers import ReuseReport

# Re-exported: the app relays these (see legs.py).
__all__ = ["EngineClientError", "Reply", "Router", "UpstreamError", "tenant_of"]

log = logging.getLogger("kvtier.router")

_NO_REUSE = ReuseDecision(Outcome.NONE, None, 0)


@dataclass
class Reply:
    status: int = 200
    json: Any = None
    stream: AsyncIterator[bytes] | None = None
    info: dict[str, Any] = field(default_factory=dict)  # log fields
    reuse: ReuseReport = field(default_factory=ReuseReport)


def tenant_of(api_key: str | None) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()[:16] if api_key else ""


class Router:
    def __init__(self, config: RouterConfig,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.cfg = config
        self.metrics = RouterMetrics()
        self.pool = InstancePool(config.prefill_instances, config.decode_instances,
                                 config.eject_after_failures)
        self.store = ConversationStore(config.store_max_entries, config.store_max_bytes)
        self.retry = RetryPolicies.from_max_retries(config.max_retries)
        self.legs = Legs(config, self.pool, self.metrics, self._pod_down, transport)
        self.client = self.legs.client  # health checks and /v1/models share it
        self._health_task: asyncio.Task[None] | None = None

    # ---- lifecycle -------------------------------------------------------
    async def start(self) -> None:
        self._health_task = asyncio.create_task(self._health_loop())

    async def stop(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            # Shutting down: whatever the health loop died of no longer matters.
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._health_task
        await self.legs.aclose()

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

    def _pod_down(self, pod: PodId) -> None:
        """``pod`` refused a connection: it is gone, and the KV it retained with it."""
        dropped = self.store.discard_pod(pod)
        if dropped:
            self.metrics.params_dropped.labels("decode_down").inc(dropped)

    # ---- entry point -----------------------------------------------------
    async def handle(self, inb: Inbound, tenant: str, headers: dict[str, str]) -> Reply:
        if inb.mode == "direct":
            # The store is not consulted: whatever is retained stays for a later turn.
            return await self._direct(inb, headers, reason="mode", outcome=Outcome.NONE)
        ids = inb.prompt_ids
        decision = _NO_REUSE
        if inb.conversation is not None:
            entry, expired = self.store.take(tenant, inb.conversation)
            if expired:
                self.metrics.params_dropped.labels("expired").inc()
                decision = ReuseDecision(Outcome.EXPIRED, None, 0)
            if entry is not None:
                if ids is None:
                    ids = await self._tokenize(inb, headers)
                decision = self._prove(entry, ids)
        return await self._pd(inb, headers, tenant, ids, decision)

    def _prove(self, entry: RetainedKV, ids: tuple[int, ...] | None) -> ReuseDecision:
        if ids is None:
            self.metrics.params_dropped.labels("untokenized").inc()
            return ReuseDecision(Outcome.STALE, None, 0)
        holder = self.pool.by_name.get(entry.decode_pod)
        if holder is None or not holder.healthy:
            self.metrics.params_dropped.labels("decode_down").inc()
            return ReuseDecision(Outcome.STALE, None, 0)
        d = prove_prefix(entry, ids, self.cfg.block_size)
        if d.outcome is Outcome.STALE:
            self.metrics.params_dropped.labels("stale").inc()
        elif d.outcome is Outcome.TRIMMED:
            self.metrics.params_trimmed.inc()
        return d

    # ---- the P/D flow ----------------------------------------------------
    async def _pd(self, inb: Inbound, headers: dict[str, str], tenant: str,
                  ids: tuple[int, ...] | None, decision: ReuseDecision) -> Reply:
        info: dict[str, Any] = {"reuse": decision.outcome.value}
        model_ns = self.cfg.indexer_model or inb.model
        matched = await self.legs.lookup(model_ns, ids) if ids is not None else None
        reuse = decision.params
        run = Attempts(self.retry.prefill)
        pre: dict[str, Any] | None = None
        report = ReuseReport(outcome=decision.outcome)
        for _ in run:
            p_inst = self.pool.choose(self.pool.prefill, matched, exclude=run.tried)
            if p_inst is None:
                break
            source = (await self.legs.source(model_ns, ids, p_inst.name)
                      if ids is not None else None)
            path, tokens, reuse, source = _plan(reuse, decision, source, matched, p_inst.name,
                                                len(ids) if ids is not None else 0,
                                                self.cfg.cost_model)
            kvp = KVTransferParams.prefill_request(reuse=reuse, source=source).to_wire()
            body = prefill_body(inb, kvp, ids)
            if inb.conversation is not None and ids is None:
                body["return_token_ids"] = True  # learn the prompt ids for the next turn
            try:
                pre = await self.legs.post_json(p_inst, "prefill", inb.endpoint.path, body,
                                                headers, self.cfg.timeouts.prefill_s)
            except EngineClientError:
                if not run.policy.retry_refusal_without_reuse or (reuse is None
                                                                  and source is None):
                    raise
                # Our reuse params may be what the engine refused: retry without.
                if reuse is not None:
                    self._drop_reuse("rejected", reuse)
                    reuse, decision = None, ReuseDecision(Outcome.STALE, None, 0)
                continue
            except UpstreamError as e:
                self._retrying(run, p_inst, e)
                if not run.kv_usable:
                    self._drop_reuse("rejected", reuse)
                    reuse = None
                continue
            self.metrics.reuse.labels(path).inc()
            if reuse is not None:
                self.metrics.reused_tokens.inc(decision.reused_tokens)
            info.update(prefill=p_inst.name, path=path.value)
            report = ReuseReport(path, tokens, decision.outcome)
            break
        if pre is None:
            return await self._exhausted(run, None, inb, headers, decision.outcome)
        if ids is None and inb.conversation is not None:
            ids = _prompt_ids_of(inb.endpoint, pre)
        p_params = KVTransferParams.from_wire(pre.get("kv_transfer_params"))
        p_wire = p_params.nixl.model_dump(exclude_none=True) if p_params and p_params.nixl else None
        try:
            return await self._decode(inb, headers, tenant, ids, p_wire, info, report)
        except (EngineClientError, UpstreamError) as e:
            e.reuse = report  # the prefill answered: its reuse goes on the error too
            raise

    def _drop_reuse(self, reason: str, reuse: NixlParams | None) -> None:
        if reuse is not None:
            self.metrics.params_dropped.labels(reason).inc()

    def _retrying(self, run: Attempts, inst: InstanceState, e: UpstreamError) -> None:
        self.metrics.retries.labels(run.policy.leg, "elsewhere").inc()
        run.failed(inst.name, e.kind)

    async def _exhausted(self, run: Attempts, last: UpstreamError | None, inb: Inbound,
                         headers: dict[str, str], outcome: Outcome) -> Reply:
        """``run`` ended without an answer: do what its policy says."""
        p = run.policy
        if p.on_exhausted is Exhausted.RECOMPUTE:
            self.metrics.retries.labels(p.leg, Exhausted.RECOMPUTE).inc()
            return await self._direct(inb, headers, reason=f"{p.leg}_failed", outcome=outcome,
                                      avoid=run.tried)
        raise last or UpstreamError(p.leg, None, Failure.NO_INSTANCE)

    async def _decode(self, inb: Inbound, headers: dict[str, str], tenant: str,
                      ids: tuple[int, ...] | None, p_params: dict[str, Any] | None,
                      info: dict[str, Any], report: ReuseReport) -> Reply:
        capture = inb.conversation is not None and ids is not None and p_params is not None
        if inb.stream and self.cfg.stream_capture == "passthrough":
            capture = False
        upstream_stream = inb.stream and not capture
        run = Attempts(self.retry.decode)
        for _ in run:
            d = self.pool.choose(self.pool.decode, exclude=run.tried)
            if d is None:
                break
            params = p_params if run.kv_usable else None
            body = decode_body(inb, params, ids, stream=upstream_stream, want_ids=capture)
            info["decode"] = d.name
            try:
                if upstream_stream:
                    stream = await self.legs.open_stream(d, "decode", inb.endpoint.path, body,
                                                         headers)
                    return Reply(200, stream=stream, info=info, reuse=report)
                resp = await self.legs.post_json(d, "decode", inb.endpoint.path, body, headers,
                                                 self.cfg.timeouts.decode_idle_s)
            except UpstreamError as e:
                self._retrying(run, d, e)
                continue
            if capture and inb.conversation is not None and ids is not None:
                self._retain(inb.conversation, tenant, d, ids, resp)
            return self._answer(inb, resp, info, report)
        return await self._exhausted(run, None, inb, headers, report.outcome)

    def _retain(self, conv: ConversationId, tenant: str, d: InstanceState,
                ids: tuple[int, ...], resp: dict[str, Any]) -> None:
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

    def _answer(self, inb: Inbound, resp: dict[str, Any], info: dict[str, Any],
                report: ReuseReport) -> Reply:
        _clean_response(resp, inb.client_wants_token_ids)
        if not inb.stream:
            return Reply(200, json=resp, info=info, reuse=report)
        events = (chat_events if inb.endpoint is Endpoint.CHAT else completion_events)(
            resp, inb.include_usage)
        return Reply(200, stream=_aiter(events), info=info, reuse=report)

    async def _direct(self, inb: Inbound, headers: dict[str, str], reason: str,
                      outcome: Outcome, avoid: Iterable[PodId] = ()) -> Reply:
        """Serve the whole request on one instance (no P/D, no KV params).

        Decode instances first (serving whole requests is their job), then
        prefills; instances that already failed this request are skipped."""
        run = Attempts(self.retry.direct, avoid)
        info: dict[str, Any] = {"direct": reason, "reuse": "none"}
        report = ReuseReport(outcome=outcome)
        self.metrics.reuse.labels(ReusePath.NONE).inc()
        last: UpstreamError | None = None
        for _ in run:
            inst = (self.pool.choose([d for d in self.pool.decode if d.healthy],
                                     exclude=run.tried)
                    or self.pool.choose(self.pool.decode + self.pool.prefill, exclude=run.tried))
            if inst is None:
                break
            body = direct_body(inb)
            info["decode"] = inst.name
            try:
                if inb.stream:
                    stream = await self.legs.open_stream(inst, "direct", inb.endpoint.path,
                                                         body, headers)
                    return Reply(200, stream=stream, info=info, reuse=report)
                resp = await self.legs.post_json(inst, "direct", inb.endpoint.path, body,
                                                 headers, self.cfg.timeouts.decode_idle_s)
            except UpstreamError as e:
                last = e
                self._retrying(run, inst, e)
                continue
            _clean_response(resp, True)
            return Reply(200, json=resp, info=info, reuse=report)
        return await self._exhausted(run, last, inb, headers, outcome)

    async def _tokenize(self, inb: Inbound, headers: dict[str, str]) -> tuple[int, ...] | None:
        """The prompt's token ids as the engines see them; None: serve without a proof."""
        run = Attempts(self.retry.tokenize)
        for _ in run:
            inst = self.pool.choose(self.pool.prefill or self.pool.decode, exclude=run.tried)
            if inst is None:
                return None
            try:
                out = await self.legs.post_json(inst, "tokenize", "/tokenize",
                                                tokenize_body(inb), headers,
                                                self.cfg.timeouts.tokenize_s)
            except UpstreamError as e:
                # Not a leg of the answer: its failures are not counted as retries.
                run.failed(inst.name, e.kind)
                continue
            toks = out.get("tokens")
            if isinstance(toks, list) and all(isinstance(t, int) for t in toks):
                return tuple(toks)
            return None
        return None


def _plan(reuse: NixlParams | None, decision: ReuseDecision, source: RemoteKVSource | None,
          matched: dict[PodId, int] | None, pod: PodId, prompt_tokens: int,
          cost: CostModel | None,
          ) -> tuple[ReusePath, int, NixlParams | None, RemoteKVSource | None]:
    """The reuse path of a prefill leg on ``pod``, the prompt tokens it is to supply, and the
    params to hand the prefill, by ``kvtier.cost.decide`` over what the decode node retains
    (D->P), what a peer's host tier holds (p2p) and what the pod itself holds (local: the
    indexer does not say whether in its device cache or its own host tier, so it is an offer,
    not tokens the engine is known to skip).

    With a cost model the chosen path's params alone go to the prefill (a read that does not
    pay is not attempted); without one every path's params go, and the engine's connector
    picks (vLLM's MultiConnector: the first child that offers tokens), which is the order
    offered here."""
    offers = []
    if reuse is not None:
        offers.append(Offer(ReusePath.DP_READ, decision.reused_tokens))
    if source is not None:
        offers.append(Offer(ReusePath.P2P, source.num_tokens))
    local = (matched or {}).get(pod, 0)
    if local:
        offers.append(Offer(ReusePath.LOCAL, local))
    if not offers or prompt_tokens <= 0:
        return ReusePath.NONE, 0, reuse, source
    d = decide(prompt_tokens, offers, cost=cost)
    if cost is not None:
        reuse = reuse if d.path == ReusePath.DP_READ else None
        source = source if d.path == ReusePath.P2P else None
    if d.path is None:
        return ReusePath.NONE, 0, reuse, source
    return ReusePath(d.path), d.tokens, reuse, source


def _prompt_ids_of(endpoint: Endpoint, resp: dict[str, Any]) -> tuple[int, ...] | None:
    if endpoint is Endpoint.CHAT:
        ids = resp.get("prompt_token_ids")
    else:
        ch = resp.get("choices") or [{}]
        ids = ch[0].get("prompt_token_ids")
    if isinstance(ids, list) and ids and all(isinstance(t, int) for t in ids):
        return tuple(ids)
    return None


def _clean_response(resp: dict[str, Any], keep_ids: bool) -> None:
    """Never show clients the engines' transfer params (block ids, hosts)."""
    resp.pop("kv_transfer_params", None)
    if keep_ids:
        return
    resp.pop("prompt_token_ids", None)
    for ch in resp.get("choices") or []:
        if isinstance(ch, dict):
            ch.pop("token_ids", None)
            ch.pop("prompt_token_ids", None)


async def _aiter(it: Iterator[bytes]) -> AsyncIterator[bytes]:
    for x in it:
        yield x
