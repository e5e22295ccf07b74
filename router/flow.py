"""The P/D flow of one request: prove, prefill, decode, retain.

``Router.handle`` turns a validated request into a ``Turn`` (turn.py) and hands it to the
legs, each an object of its own:

1. If it names a conversation, ``take`` the retained decode params (single use) and prove the
   new prompt starts with the token ids they cover (``store.prove_prefix``); trim or drop
   otherwise. Prompt ids come from the request (completions token prompt) or the engine's
   ``/tokenize``. The proof is the turn's ``ReuseDecision``.
2. ``PrefillLeg`` (prefill.py): one indexer call, the choice of a prefill, the reuse path
   (D->P read, peer pull, local cache) and the one-token prefill leg.
3. ``DecodeLeg`` (decode.py): the choice of a decode, the prefill's params handed over, the
   answer relayed (``relay.py``), and D's params plus ``prompt ids + generated ids`` kept
   for the next turn.
4. ``DirectLeg`` (direct.py): the whole request on one instance, for requests that need it
   and when a leg's retry policy (``retry.py``) says to recompute.

Sessions: a request names its conversation (``conversation_id``, ``session_id``,
``prompt_cache_key``, or their headers), or, with ``implicit_sessions``, continues the
conversation whose retained ids its prompt starts with (``store.find``); an unnamed first
turn is retained under a fresh ``~``-prefixed id.

Decode leases (``retention.py``): a taken turn's lease is renewed right before its params are
offered (fresh deadline), forgotten when the prefill read it, released otherwise (as soon as
the prefill answered: a decode node short of blocks may hold this very turn's decode back for
them); a retained turn is held per ``retention`` (renew / adaptive); ``close`` serves
``DELETE /v1/conversations/{id}``.

Every answer carries a ``ReuseReport``: the reuse path its prefill leg took (``ReusePath``),
the prompt tokens that path was planned to supply, and the ``Outcome`` for the conversation's
retained KV (the proof's, or ``stale`` when the engine refused the params). An error raised
after the prefill answered carries the prefill's report too.

Faults: the legs themselves (HTTP, errors) are in ``legs.py``; where a failed leg is tried
again is ``retry.py``'s ``RetryPolicies``. Engine 4xx answers go back to the client unchanged.

The conversation store is a ``store.ConversationBackend`` (``memory`` or ``redis://``);
an unavailable one finds nothing and keeps nothing, and the turn is served anyway.

Threading model: one ``Router`` per app, driven by its event loop. The store,
pool and metrics are only touched from that loop (a Redis store's calls are awaited
there too).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from dataclasses import replace
from typing import Any

import httpx

from kvtier.ids import ConversationId, Outcome, PodId
from kvtier.router.capabilities import DecodeCapabilities
from kvtier.router.config import RouterConfig
from kvtier.router.costs import RouterCost
from kvtier.router.decode import DecodeLeg
from kvtier.router.direct import DirectLeg
from kvtier.router.feed import ParamsFeed
from kvtier.router.legs import EngineClientError, Legs, UpstreamError
from kvtier.router.metrics import RouterMetrics
from kvtier.router.pool import InstancePool, InstanceState
from kvtier.router.prefill import Prefilled, PrefillLeg
from kvtier.router.relay import Relay
from kvtier.router.reply import Refusal, Reply, tenant_of
from kvtier.router.requests import Inbound
from kvtier.router.retention import Released, Retention
from kvtier.router.retry import RetryPolicies
from kvtier.router.store import (
    ConversationStore,
    RetainedKV,
    ReuseDecision,
    open_store,
    prove_prefix,
)
from kvtier.router.turn import NO_REUSE, Turn, TurnLog
from kvtier.watchdog import LoopWatchdog
from kvtier.wire.leases import ReleaseReason

# Re-exported: the app relays these (see legs.py).
__all__ = ["EngineClientError", "Reply", "Router", "UpstreamError", "tenant_of"]


class Router:
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
            timeout_s=config.timeouts.store_s, on_call=self._store_call,
            on_evict=lambda entry: self.retention.evicted(entry))
        self.metrics.store_backend.labels(self.store.name).set(1)
        self._dropped_seen = (0, 0)  # the store's (evicted, expired) already counted
        self._bg: set[asyncio.Task[Any]] = set()
        self.retry = RetryPolicies.from_max_retries(config.max_retries)
        self.legs = Legs(config, self.pool, self.metrics, self._pod_down, transport)
        self.client = self.legs.client  # health checks and /v1/models share it
        self.feed = ParamsFeed({i.name: i.params_feed for i in config.decode_instances
                                if i.params_feed}, self.metrics)
        self.retention = Retention(config, self.metrics)
        self.capabilities = DecodeCapabilities(config, self.retention.keeper)
        self.cost = RouterCost(config.cost_model, self.metrics, refit=config.cost_refit,
                               window=config.cost_refit_window,
                               min_samples=config.cost_refit_min_samples,
                               on_change=self.retention.set_cost, learn=config.cost_learn,
                               ring=config.cost_learn_ring, explore_share=config.explore_share,
                               explore_margin=config.explore_margin)
        relay = Relay(self.legs, self.metrics)
        self.prefill = PrefillLeg(config, self.pool, self.retry, self.legs, self.metrics,
                                  self.cost, self.retention)
        self.decode = DecodeLeg(config, self.pool, self.retry.decode, self.legs, self.feed,
                                self.metrics, self.store, self.retention, relay)
        self.direct = DirectLeg(config, self.pool, self.retry.direct, self.legs, self.metrics,
                                relay)
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
        self.capabilities.start()
        if health_checks:
            self._health_task = asyncio.create_task(self._health_loop())

    async def stop(self) -> None:
        await self.capabilities.stop()
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
            if self.retention.pressure is not None:
                await self.retention.pressure.sample(self.client, self.cfg.timeouts.health_s)
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
            return await self.direct.serve(Turn(inb, headers, tenant), reason="mode")
        ids = inb.prompt_ids
        decision = NO_REUSE
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
                ids = await self.prefill.tokenize(inb, headers)
            found = await store.afind(tenant, ids) if ids is not None else None
            if found is not None:
                entry, expired = await store.atake(tenant, found)
                self._looked_up(entry, expired, "implicit")
                conv = conv or found
        back = entry.conversation if entry is not None else conv
        prior = 0
        if back is not None:
            # The conversation came back: its wait feeds the hold policy whether or not its
            # turn was still stored. A wait that outlived the store's entry is the one a hold
            # must learn about; counting only the turns found (as before) showed the policy
            # only waits shorter than the entry's TTL, so it never held longer (a host-scarce
            # run: holds of 19-22 s while a third of the waits ran 23-77 s).
            prior = self.retention.arrived(tenant, back)
        if entry is not None:
            if ids is None:
                ids = await self.prefill.tokenize(inb, headers)
            decision, refusal = self._prove(entry, ids)
        if conv is None and self.cfg.implicit_sessions:
            conv = ConversationId("~" + uuid.uuid4().hex[:20])
        turn = Turn(inb, headers, tenant, conv, ids, entry, log=TurnLog(session=conv),
                    left=prior)
        turn.decide(decision, refusal)
        return await self._pd(turn)

    async def close(self, tenant: str, conv: ConversationId) -> Released | None:
        """The client closed ``conv`` (``DELETE /v1/conversations/{id}``): forget its retained
        turn and release its decode blocks now, and say whether they were. None when this
        tenant has no such conversation retained."""
        entry, _ = await self.store.atake(tenant, conv)
        if entry is None:
            return None
        return await self.retention.close(entry)

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
    async def _pd(self, turn: Turn) -> Reply:
        """Prefill, then decode; the taken turn (``turn.entry``) ends once, when the
        prefill answered (read or not) or however the flow ends before that."""
        entry = turn.entry
        ended = False

        def end(read: bool) -> None:
            nonlocal ended
            if entry is not None and not ended:
                ended = True
                self.retention.ended(entry, read, _release_reason(turn.decision.outcome))

        try:
            if entry is not None and turn.decision.params is not None:
                confirmed = await self.retention.confirm(entry, turn.decision.params)
                if confirmed is None:
                    self.metrics.params_dropped.labels("released").inc()
                    turn.decide(ReuseDecision(Outcome.EXPIRED, None, 0), Refusal.RELEASED)
                else:
                    turn.decide(replace(turn.decision, params=confirmed))
            pre = await self.prefill.run(turn)
            if not isinstance(pre, Prefilled):
                return await self.direct.after(pre, turn)
            end(pre.read)
            report = turn.report
            try:
                out = await self.decode.run(turn, pre.handoff)
                return out if isinstance(out, Reply) else await self.direct.after(out, turn)
            except (EngineClientError, UpstreamError) as e:
                e.reuse = report  # the prefill answered: its reuse goes on the error too
                raise
        finally:
            end(False)


def _release_reason(outcome: Outcome) -> ReleaseReason:
    """Why a taken turn that was not read is released."""
    if outcome is Outcome.STALE:
        return ReleaseReason.DROPPED
    if outcome is Outcome.TRIMMED:
        return ReleaseReason.TRIMMED
    return ReleaseReason.MOVED
