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
3. Choose a decode, hand it the prefill's params, relay its answer, and keep D's
   params plus ``prompt ids + generated ids`` for the next turn (``decode.py``, a part of
   ``Router`` in its own file). A streaming
   client with ``stream_capture: stream`` (default) gets decode's own stream, relayed
   event by event (engine transfer params taken out); D's params come from the decode
   node's params feed (``feed.py``), matched by a tag in the leg's ``X-Request-Id``,
   while the final ``[DONE]`` is held. Otherwise decode runs non-streaming (vLLM
   returns ``kv_transfer_params`` only there) with ``return_token_ids``, and a
   streaming client gets the answer re-emitted as SSE (``buffered``).

Sessions: a request names its conversation (``conversation_id``, ``session_id``,
``prompt_cache_key``, or their headers), or, with ``implicit_sessions``, continues the
conversation whose retained ids its prompt starts with (``store.find``); an unnamed first
turn is retained under a fresh ``~``-prefixed id.

Decode leases (``retention.py``): a taken turn's lease is renewed right before its params are
offered (fresh deadline), forgotten when the prefill read it, released otherwise; a retained
turn is held per ``retention`` (renew / adaptive); ``close`` serves
``DELETE /v1/conversations/{id}``.

Every answer carries a ``ReuseReport``: the reuse path its prefill leg took (``ReusePath``),
the prompt tokens that path was planned to supply, and the ``Outcome`` for the conversation's
retained KV (the proof's, or ``stale`` when the engine refused the params).

Faults: the legs themselves (HTTP, errors) are in ``legs.py``; where a failed leg
is tried again is ``retry.py``'s ``RetryPolicies``: a leg that cannot connect,
times out or answers 5xx is retried on another instance (reuse params dropped
when they may be the cause); when no prefill works the request is recomputed
on one instance (direct mode); when no decode works, the same. Engine 4xx
answers go back to the client unchanged.

Streams: a streaming leg reaches the client only after its first event proved sane
(``legs.open_stream``); after that, garbage, a broken connection or an end without
``[DONE]`` become an in-band error event and ``[DONE]``, never a silently cut 200.

The conversation store is a ``store.ConversationBackend`` (``memory`` or ``redis://``);
an unavailable one finds nothing and keeps nothing, and the turn is served anyway.

Threading model: one ``Router`` per app, driven by its event loop. The store,
pool and metrics are only touched from that loop (a Redis store's calls are awaited
there too).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any

import httpx
from kvtier.router.config import RouterConfig
from kvtier.router.costs import RouterCost
from kvtier.router.decode import DecodeLeg
from kvtier.router.feed import ParamsFeed
from kvtier.router.legs import EngineClientError, Legs, UpstreamError
from kvtier.router.metrics import RouterMetrics
from kvtier.router.plan import plan as _plan
from kvtier.router.pool import InstancePool, InstanceState
from kvtier.router.reply import Refusal, Reply, clean_response, raw_message_tokens, tenant_of
from kvtier.router.requests import (
    Endpoint,
    Inbound,
    direct_body,
    prefill_body,
    tokenize_body,
)
from kvtier.router.retention import Retention
from kvtier.router.retry import Attempts, Exhausted, Failure, RetryPolicies
from kvtier.router.store import (
    ConversationStore,
    RetainedKV,
    ReuseDecision,
    open_store,
    prove_prefix,
)

from kvtier.ids import ConversationId, Outcome, PodId, ReusePath
from kvtier.transfer_params import KVTransferParams, NixlParams
from kvtier.watchdog import LoopWatchdog
from kvtier.wire.leases import ReleaseReason
from kvtier.wire.reuse_headers import ReuseReport

# Re-exported: the app relays these (see legs.py).
__all__ = ["EngineClientError", "Reply", "Router", "UpstreamError", "tenant_of"]

log = logging.getLogger("kvtier.router")

_NO_REUSE = ReuseDecision(Outcome.NONE, None, 0)


class Router(DecodeLeg):
    def __init__(self, config: RouterConfig,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.cfg = config
        self.metrics = RouterMetrics()
        self.pool = InstancePool(config.prefill_instances, config.decode_instances,
                                 config.eject_after_failures, config.readmit_probe_s,
                                 on_eject=self._ejected)
        self.store = open_store(
            config.store, max_entries=config.store_max_entries,
            max_bytes=config.store_max_bytes, block_size=config.block_size,
            ttl_s=config.entry_ttl_s, namespace=config.store_namespace,
            timeout_s=config.timeouts.store_s, on_call=self._store_call)
        self.metrics.store_backend.labels(self.store.name).set(1)
        self._dropped_seen = (0, 0)  # the store's (evicted, expired) already counted
        self._bg: set[asyncio.Task[Any]] = set()
        self.retry = RetryPolicies.from_max_retries(config.max_retries)
        self.legs = Legs(config, self.pool, self.metrics, self._pod_down, transport)
        self.client = self.legs.client  # health checks and /v1/models share it
        self.feed = ParamsFeed({i.name: i.params_feed for i in config.decode_instances
                                if i.params_feed}, self.metrics)
        self.retention = Retention(config, self.metrics)
        self.cost = RouterCost(config.cost_model, self.metrics, refit=config.cost_refit,
                               window=config.cost_refit_window,
                               min_samples=config.cost_refit_min_samples,
                               on_change=self.retention.set_cost)
        self._health_task: asyncio.Task[None] | None = None
        self.watchdog = (LoopWatchdog("router", config.loop_stall_warn_s,
                                      on_stall=self.metrics.loop_stalls.observe)
                         if config.loop_stall_warn_s > 0 else None)

    # ---- lifecycle -------------------------------------------------------
    async def start(self, health_checks: bool = True) -> None:
        if self.watchdog is not None:
            self.watchdog.start()
        await self.feed.start()
        await self.retention.start()
        if health_checks:
            self._health_task = asyncio.create_task(self._health_loop())

    async def stop(self) -> None:
        await self.feed.stop()
        # A memory store dies with this process: nobody will offer its turns again.
        await self.retention.stop(release_all=isinstance(self.store, ConversationStore))
        if self._health_task is not None:
            self._health_task.cancel()
            # Shutting down: whatever the health loop died of no longer matters.
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._health_task
        await self.legs.aclose()
        for t in list(self._bg):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        await self.store.aclose()
        if self.watchdog is not None:
            await self.watchdog.stop()

    async def _health_loop(self) -> None:
        while True:
            await self.pool.check_all(self.client, self.cfg.timeouts.health_s)
            await self.refresh_gauges()
            await asyncio.sleep(self.cfg.health_interval_s)

    async def refresh_gauges(self) -> None:
        m = self.metrics
        for inst in self.pool.all():
            m.healthy.labels(inst.name, inst.cfg.role.value).set(1 if inst.healthy else 0)
            m.in_flight.labels(inst.name).set(inst.in_flight)
            if self.retention.has(inst.name):
                m.leases_held.labels(inst.name).set(self.retention.keeper.held(inst.name))
        st = await self.store.astats()
        m.conversations.set(st.entries)
        if st.nbytes is not None:
            m.store_bytes.set(st.nbytes)
        ev, ex = self._dropped_seen
        if st.evicted > ev:
            m.store_dropped.labels("evicted").inc(st.evicted - ev)
        if st.expired > ex:
            m.store_dropped.labels("expired").inc(st.expired - ex)
        self._dropped_seen = (max(ev, st.evicted), max(ex, st.expired))
        m.store_up.set(1 if self.store.ok else 0)
        m.dependency_up.labels("store").set(1 if self.store.ok else 0)
        if self.legs.indexer_ok is not None:
            m.dependency_up.labels("indexer").set(1 if self.legs.indexer_ok else 0)

    def _store_call(self, op: str, seconds: float | None) -> None:
        if seconds is None:
            self.metrics.store_errors.labels(op).inc()
        else:
            self.metrics.store_latency.labels(op).observe(seconds)

    def _ejected(self, inst: InstanceState, reason: str) -> None:
        self.metrics.ejections.labels(inst.name, reason).inc()
        self.metrics.healthy.labels(inst.name, inst.cfg.role.value).set(0)

    def _pod_down(self, pod: PodId) -> None:
        """``pod`` refused a connection: it is gone, and the KV it retained with it."""
        self.retention.pod_down(pod)
        if isinstance(self.store, ConversationStore):
            self._dropped_pod(self.store.discard_pod(pod))
            return

        async def discard() -> None:
            self._dropped_pod(await self.store.adiscard_pod(pod))
        t = asyncio.get_running_loop().create_task(discard())
        self._bg.add(t)
        t.add_done_callback(self._bg.discard)

    def _dropped_pod(self, dropped: int) -> None:
        if dropped:
            self.metrics.params_dropped.labels("decode_down").inc(dropped)
            self.metrics.store_dropped.labels("decode_down").inc(dropped)

    # ---- entry point -----------------------------------------------------
    async def handle(self, inb: Inbound, tenant: str, headers: dict[str, str]) -> Reply:
        if inb.mode == "direct":
            # The store is not consulted: whatever is retained stays for a later turn.
            return await self._direct(inb, headers, reason="mode", outcome=Outcome.NONE)
        ids = inb.prompt_ids
        decision = _NO_REUSE
        conv = inb.conversation
        entry: RetainedKV | None = None
        refusal: str | None = None
        store = self.store
        if conv is not None:
            entry, expired = await store.atake(tenant, conv)
            self._looked_up(entry, expired, "named")
            if expired:
                self.metrics.params_dropped.labels("expired").inc()
                decision = ReuseDecision(Outcome.EXPIRED, None, 0)
                refusal = Refusal.EXPIRED
        if entry is None and self.cfg.implicit_sessions and store.ok and store.may_hold():
            # No (live) named entry: the conversation this prompt provably continues, if any.
            if ids is None:
                ids = await self._tokenize(inb, headers)
            found = await store.afind(tenant, ids) if ids is not None else None
            if found is not None:
                entry, expired = await store.atake(tenant, found)
                self._looked_up(entry, expired, "implicit")
                conv = conv or found
        if entry is not None:
            self.retention.arrived(tenant, entry.conversation)
            if ids is None:
                ids = await self._tokenize(inb, headers)
            decision, refusal = self._prove(entry, ids)
        if conv is None and self.cfg.implicit_sessions:
            conv = ConversationId("~" + uuid.uuid4().hex[:20])
        return await self._pd(inb, headers, tenant, conv, ids, decision, refusal, entry)

    async def close(self, tenant: str, conv: ConversationId) -> bool:
        """The client closed ``conv`` (``DELETE /v1/conversations/{id}``): forget its retained
        turn and release its decode blocks now. False when this tenant has no such
        conversation retained."""
        entry, _ = await self.store.atake(tenant, conv)
        if entry is None:
            return False
        await self.retention.close(entry)
        return True

    def _looked_up(self, entry: RetainedKV | None, expired: bool, session: str) -> None:
        result = ("hit" if entry is not None else "expired" if expired
                  else "miss" if self.store.ok else "unavailable")
        self.metrics.store_lookups.labels(result, session).inc()

    def _prove(self, entry: RetainedKV, ids: tuple[int, ...] | None,
               ) -> tuple[ReuseDecision, str | None]:
        """The reuse the retained ``entry`` allows for prompt ``ids``, and why it allows
        none (a ``Refusal``) when it does not."""
        if ids is None:
            self.metrics.params_dropped.labels("untokenized").inc()
            return ReuseDecision(Outcome.STALE, None, 0), Refusal.UNPROVEN
        holder = self.pool.by_name.get(entry.decode_pod)
        if holder is None or not holder.healthy:
            self.metrics.params_dropped.labels("decode_down").inc()
            return ReuseDecision(Outcome.STALE, None, 0), Refusal.STALE
        if self.retention.gone(entry):
            self.metrics.params_dropped.labels("released").inc()
            return ReuseDecision(Outcome.EXPIRED, None, 0), Refusal.RELEASED
        d = prove_prefix(entry, ids, self.cfg.block_size)
        if d.outcome is Outcome.STALE:
            self.metrics.params_dropped.labels("stale").inc()
            return d, Refusal.UNPROVEN
        if d.outcome is Outcome.TRIMMED:
            self.metrics.params_trimmed.inc()
        return d, None

    # ---- the P/D flow ----------------------------------------------------
    async def _pd(self, inb: Inbound, headers: dict[str, str], tenant: str,
                  conv: ConversationId | None, ids: tuple[int, ...] | None,
                  decision: ReuseDecision, refusal: str | None = None,
                  entry: RetainedKV | None = None) -> Reply:
        read = ended = False

        def prefilled(read_now: bool) -> None:
            # The prefill has answered: the retained turn was read (vLLM frees it) or is not
            # needed any more. Release it now, not after the decode: a decode node short of
            # blocks may be holding this very turn's decode back for them (a live decode-scarce
            # A/B waited out whole leases that way).
            nonlocal ended
            if entry is not None and not ended:
                ended = True
                self.retention.ended(entry, read_now, _release_reason(decision.outcome))

        try:
            if entry is not None and decision.params is not None:
                confirmed = await self.retention.confirm(entry, decision.params)
                if confirmed is None:
                    self.metrics.params_dropped.labels("released").inc()
                    decision, refusal = ReuseDecision(Outcome.EXPIRED, None, 0), Refusal.RELEASED
                else:
                    decision = ReuseDecision(decision.outcome, confirmed, decision.reused_tokens)
            reply, read = await self._pd_legs(inb, headers, tenant, conv, ids, decision, refusal,
                                              len(entry.covered) if entry is not None else 0,
                                              prefilled)
            return reply
        finally:
            if entry is not None and not ended:
                self.retention.ended(entry, read, _release_reason(decision.outcome))

    async def _pd_legs(self, inb: Inbound, headers: dict[str, str], tenant: str,
                       conv: ConversationId | None, ids: tuple[int, ...] | None,
                       decision: ReuseDecision, refusal: str | None, prior_tokens: int = 0,
                       prefilled: Callable[[bool], None] | None = None,
                       ) -> tuple[Reply, bool]:
        """Prefill then decode; the reply, and whether the prefill read the retained KV.
        ``prior_tokens``: what the conversation's previous turn left (0: not a continuation);
        ``prefilled(read)`` is called once the prefill has answered, before the decode."""
        info: dict[str, Any] = {"reuse": decision.outcome.value}
        if conv is not None:
            info["session"] = conv
        if refusal is not None:
            info["refusal"] = refusal
        model_ns = self.cfg.indexer_model or inb.model
        if ids is None and self.legs.indexer is not None:
            # KV-aware choice and peer sources need the prompt's ids: tokenize once.
            ids = await self._tokenize(inb, headers)
        route = (await self.legs.route(model_ns, ids, self.pool.loads())
                 if ids is not None else None)
        matched = route.matched if route is not None else None
        if route is not None and prior_tokens and conv is not None:
            self.retention.host_seen(str(conv), route.host_tokens, prior_tokens)
        reuse = decision.params
        run = Attempts(self.retry.prefill)
        pre: dict[str, Any] | None = None
        report = ReuseReport(outcome=decision.outcome)
        for _ in run:
            p_inst = self.pool.choose(self.pool.prefill, matched, exclude=run.tried)
            if p_inst is None:
                break
            source = (route.source_for(p_inst.name, self.cfg.min_cached_token_delta, model_ns,
                                       self.cfg.block_size) if route is not None else None)
            offered = reuse is not None
            path, tokens, reuse, source = _plan(reuse, decision, source, matched, p_inst.name,
                                                len(ids) if ids is not None else 0,
                                                self.cost.model)
            if offered and path is not ReusePath.DP_READ:
                info["refusal"] = Refusal.BELOW_THRESHOLD  # another path (or none) was cheaper
            kvp = KVTransferParams.prefill_request(reuse=reuse, source=source).to_wire()
            body = prefill_body(inb, kvp, ids)
            if conv is not None and ids is None and inb.endpoint is not Endpoint.RESPONSES:
                body["return_token_ids"] = True  # learn the prompt ids for the next turn
            try:
                sent = time.monotonic()
                pre = await self.legs.post_json(p_inst, "prefill", inb.endpoint.path, body,
                                                headers, self.cfg.timeouts.prefill_s)
                self.cost.prefill_leg(_prompt_tokens(ids, pre), path, tokens,
                                      time.monotonic() - sent)
            except EngineClientError:
                if not run.policy.retry_refusal_without_reuse or (reuse is None
                                                                  and source is None):
                    raise
                # Our reuse params may be what the engine refused: retry without.
                if reuse is not None:
                    self._drop_reuse("rejected", reuse)
                    reuse, decision = None, ReuseDecision(Outcome.STALE, None, 0)
                    info["refusal"] = Refusal.STALE
                continue
            except UpstreamError as e:
                self._retrying(run, p_inst, e)
                if not run.kv_usable:
                    self._drop_reuse("rejected", reuse)
                    reuse = None
                continue
            if inb.endpoint is Endpoint.RESPONSES:
                seen = _prompt_ids_of(inb.endpoint, pre)
                if reuse is not None and (seen is None or ids is None
                                          or seen[:tokens] != ids[:tokens]):
                    # vLLM rendered this input otherwise than /tokenize did: the KV it read
                    # from D may not be this prompt's. Prefill again, without it.
                    self.metrics.params_dropped.labels("render_mismatch").inc()
                    log.warning("responses prompt rendered unlike /tokenize; prefilling again "
                                "without reuse", extra={"conversation_id": conv})
                    reuse, decision = None, ReuseDecision(Outcome.STALE, None, 0)
                    info["refusal"] = Refusal.UNPROVEN
                    pre = None
                    continue
                if seen is not None:
                    ids = seen  # what the engines really computed: retained for the next turn
            self.metrics.reuse.labels(path).inc()
            if reuse is not None:
                self.metrics.reused_tokens.inc(decision.reused_tokens)
            info.update(prefill=p_inst.name, path=path.value)
            report = ReuseReport(path, tokens, decision.outcome)
            break
        if pre is None:
            return await self._exhausted(run, None, inb, headers, decision.outcome), False
        read = reuse is not None and report.path is ReusePath.DP_READ
        if prefilled is not None:
            prefilled(read)
        if ids is None and conv is not None:
            ids = _prompt_ids_of(inb.endpoint, pre)
        p_params = KVTransferParams.from_wire(pre.get("kv_transfer_params"))
        p_wire = p_params.nixl.model_dump(exclude_none=True) if p_params and p_params.nixl else None
        try:
            return await self._decode(inb, headers, tenant, conv, ids, p_wire, info,
                                      report), read
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
                    return Reply(200, stream=self._relay_for(inb)(stream, inst, None, None,
                                                                  "", None),
                                 info=info, reuse=report)
                resp = await self.legs.post_json(inst, "direct", inb.endpoint.path, body,
                                                 headers, self.cfg.timeouts.decode_idle_s)
            except UpstreamError as e:
                last = e
                self._retrying(run, inst, e)
                continue
            clean_response(resp, True)
            return Reply(200, json=resp, info=info, reuse=report)
        return await self._exhausted(run, last, inb, headers, outcome)

    async def _tokenize(self, inb: Inbound, headers: dict[str, str]) -> tuple[int, ...] | None:
        """The prompt's token ids as the engines see them; None: serve without a proof."""
        body = tokenize_body(inb)
        if body is None:
            return None
        run = Attempts(self.retry.tokenize)
        for _ in run:
            inst = self.pool.choose(self.pool.prefill or self.pool.decode, exclude=run.tried)
            if inst is None:
                return None
            try:
                out = await self.legs.post_json(inst, "tokenize", "/tokenize", body, headers,
                                                self.cfg.timeouts.tokenize_s)
            except EngineClientError:
                if inb.endpoint is Endpoint.RESPONSES:
                    return None  # our chat rendering of its input; the request may still be fine
                raise
            except UpstreamError as e:
                # Not a leg of the answer: its failures are not counted as retries.
                run.failed(inst.name, e.kind)
                continue
            toks = out.get("tokens")
            if isinstance(toks, list) and all(isinstance(t, int) for t in toks):
                return tuple(toks)
            return None
        return None


def _release_reason(outcome: Outcome) -> ReleaseReason:
    """Why a taken turn that was not read is released."""
    if outcome is Outcome.STALE:
        return ReleaseReason.DROPPED
    if outcome is Outcome.TRIMMED:
        return ReleaseReason.TRIMMED
    return ReleaseReason.MOVED


def _prompt_ids_of(endpoint: Endpoint, resp: dict[str, Any]) -> tuple[int, ...] | None:
    if endpoint is Endpoint.RESPONSES:
        ids = raw_message_tokens(resp.get("input_messages"))
    elif endpoint is Endpoint.CHAT:
        ids = resp.get("prompt_token_ids")
    else:
        ch = resp.get("choices") or [{}]
        ids = ch[0].get("prompt_token_ids")
    if isinstance(ids, list) and ids and all(isinstance(t, int) for t in ids):
        return tuple(ids)
    return None


def _prompt_tokens(ids: tuple[int, ...] | None, resp: dict[str, Any]) -> int:
    """The prompt's length: its ids when the router has them, else the engine's usage."""
    if ids is not None:
        return len(ids)
    usage = resp.get("usage")
    n = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    return n if isinstance(n, int) else 0
