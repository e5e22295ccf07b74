"""What the router holds on decode devices between turns, and for how long.

With decode leases (a decode node running ``KVTierNixlConnector`` with ``decode_lease_s``, and
the instance's ``lease`` endpoint in the router config) a retained turn's blocks live only as
long as somebody renews their lease. ``Retention`` is the flow's one handle on that:

- ``lease_s`` is the router's lease (``decode_lease_s``) each decode leg asks for in its
  params (``requests.decode_body``), so the node grants that lease whatever its own default;
- ``plan`` chooses a turn's hold before its decode leg; ``retained`` starts holding the turn
  the store kept: with ``retention: renew`` for as long as
  the store keeps the entry, with ``retention: adaptive`` for what ``HoldPolicy`` chose from the
  cost model, the waits observed so far and how often host copies survived (``host_seen``,
  from the indexer at each continuation turn) (0 s: released at once, the host copy or a
  recompute serves the next turn), with ``hold_pressure`` priced by the decode node's current
  KV pressure (``pressure``: ``router/pressure.py``, sampled by the health loop). The choice
  and its inputs go to the log and the metrics. A hold of 0 s planned for a named
  conversation is not retained at all: its decode leg asks the node to keep nothing
  (``kvtier_decode_retain: false``), so its blocks are never pinned and no release is sent
  (``not_retained``). ``finished`` starts the conversation's wait either way;
- ``confirm`` renews a taken turn's lease right before its params are offered to a prefill
  (one round trip; for at least ``READ_WINDOW_S``: a prefill declines a read within 5 s of
  the deadline) and patches the fresh deadline into ``remote_blocks_expiry_time``, so a
  turn held longer than its first lease is still read; a lease found gone, or held with less
  than ``MIN_READ_LEFT_S`` left (vLLM's TTL ends first), refuses the reuse (``released``)
  instead of offering a read the prefill would decline;
- ``ended`` is called once per taken turn: a read frees the blocks in vLLM (forget the lease),
  anything else releases them now, with the reason (``moved``, ``dropped``, ``trimmed``);
- ``close`` releases a conversation the client closed (``DELETE /v1/conversations/{id}``);
- ``evicted`` releases a turn the store let go untaken (its entry or byte cap, its expiry, a
  newer turn stored over it): nobody will offer those blocks again, so they are not renewed
  until the hold ends. The memory store calls it; the Redis store calls it for a turn whose
  write failed after the answer, and otherwise expires entries on Redis's clock, which ends
  them when their hold ends anyway (``router/redis_store.py``).

Release calls on the request path run in the background: a slow decode node never delays an
answer. A decode node without a ``lease`` endpoint is left to vLLM's TTL, as before.

Threading model: one asyncio loop (the router's); ``LeaseKeeper`` serializes calls per node.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from kvtier.cost.hold import HOST_HELD_FRACTION, HoldChoice, HoldPolicy
from kvtier.cost.model import CostModel
from kvtier.ids import PodId
from kvtier.router.config import RouterConfig
from kvtier.router.leases import LeaseKeeper
from kvtier.router.metrics import RouterMetrics
from kvtier.router.pressure import DecodePressure
from kvtier.router.store import RetainedKV
from kvtier.transfer_params import NixlParams
from kvtier.wire.leases import LeaseRequest, Op, ReleaseReason

log = logging.getLogger("kvtier.router.retention")


class Released(StrEnum):
    """What became of a closed conversation's device blocks (``DELETE`` answers it)."""

    RELEASED = "released"                    # the decode node's lease server freed them
    NO_LEASE_ENDPOINT = "no_lease_endpoint"  # no lease server known: vLLM's TTL frees them
    UNAVAILABLE = "lease_server_unavailable"  # it did not answer: its lease frees them
    NOTHING_HELD = "nothing_held"            # the turn kept no device blocks

    @property
    def detail(self) -> str:
        return _RELEASED_DETAIL[self]


_RELEASED_DETAIL = {
    Released.RELEASED: "the decode node freed the conversation's blocks",
    Released.NO_LEASE_ENDPOINT: (
        "the decode node has no lease endpoint known to the router: its blocks stay until "
        "vLLM's decoder_kv_blocks_ttl; start it with kvtier's connector "
        "(configs/nixl-bidirectional-lease.json) and give the router its lease endpoint"),
    Released.UNAVAILABLE: ("the decode node's lease server did not answer: the blocks are "
                           "freed when their lease runs out"),
    Released.NOTHING_HELD: "the conversation held no device blocks",
}

_MAX_TRACKED = 100_000  # lost leases and last-turn times remembered (oldest forgotten)
# A prefill declines a D->P read whose deadline is within 5 s (vLLM's
# _KV_BLOCKS_EXPIRY_SAFETY_MARGIN); the renewal before an offer covers that margin plus the
# time the prefill may take to reach the read (queueing), whatever the lease.
READ_WINDOW_S = 15.0
# A renewed lease with less than this left is not offered: vLLM's TTL (the lease's upper
# bound) ends too soon for the read to clear that 5 s margin once the prefill reaches it;
# a live A/B run saw such reads declined (HTTP 500 from the prefill, then retried).
MIN_READ_LEFT_S = 8.0


@dataclass(frozen=True, slots=True)
class Held:
    """The hold chosen for a retained turn, as logged (``hold`` and ``served`` lines)."""

    hold_s: float
    basis: str         # renew, conversation, fleet, default
    samples: int       # waits the choice was made from
    host_odds: float | None = None  # with ``host_copy``: how often host copies survived
    pressure: float | None = None   # with ``hold_pressure``: the decode node's price factor
    why: str = ""      # the policy's explanation (the ``hold`` line's ``why``)

    @property
    def retains(self) -> bool:
        """Whether the decode node is to keep the turn at all (a hold of 0 s: it keeps
        nothing; ``kvtier_decode_retain: false`` in the decode leg)."""
        return self.hold_s > 0

    def fields(self) -> dict[str, object]:
        out: dict[str, object] = {"hold_s": self.hold_s, "hold_basis": self.basis,
                                  "hold_samples": self.samples}
        if self.host_odds is not None:
            out["host_odds"] = self.host_odds
        if self.pressure is not None:
            out["hold_pressure"] = self.pressure
        return out


class Retention:
    def __init__(self, cfg: RouterConfig, metrics: RouterMetrics) -> None:
        self.cfg, self.metrics = cfg, metrics
        endpoints = {i.name: i.lease for i in cfg.decode_instances if i.lease}
        self.keeper = LeaseKeeper(endpoints, cfg.decode_lease_s, on_lost=self._lost,
                                  on_result=self._result, on_release=self._released)
        self.policy: HoldPolicy | None = None
        if cfg.retention == "adaptive" and endpoints:
            assert cfg.cost_model is not None  # the config validates this
            self.policy = HoldPolicy(cfg.cost_model, host_copy=cfg.host_copy,
                                     default_hold_s=min(cfg.hold_default_s
                                                        if cfg.hold_default_s is not None
                                                        else cfg.entry_ttl_s, cfg.entry_ttl_s),
                                     horizon_s=cfg.hold_horizon_s)
        # The decode nodes' KV pressure, sampled by the health loop (hold_pressure).
        self.pressure = (DecodePressure(((i.name, i.url) for i in cfg.decode_instances),
                                        metrics, interval_s=cfg.health_interval_s,
                                        waiting_ref=cfg.hold_waiting_ref)
                         if self.policy is not None and cfg.hold_pressure else None)
        # (pod, engine request id) of leases a renewal found gone.
        self._gone: OrderedDict[tuple[PodId, str], None] = OrderedDict()
        # (tenant, conversation) -> (monotonic end of its last turn, tokens it left)
        self._last: OrderedDict[tuple[str, str], tuple[float, int]] = OrderedDict()
        self._bg: set[asyncio.Task[Any]] = set()

    def set_cost(self, cost: CostModel) -> None:
        """Decide holds with ``cost`` from now on (an online refit, ``router/costs.py``)."""
        if self.policy is not None:
            self.policy.cost = cost

    @property
    def enabled(self) -> bool:
        return bool(self.keeper.endpoints)

    def has(self, pod: PodId) -> bool:
        return self.keeper.has(pod)

    async def start(self) -> None:
        await self.keeper.start()

    async def stop(self, release_all: bool) -> None:
        """Stop renewing. ``release_all`` (a store that dies with this process): free every
        turn held now, since no router will ever offer them again."""
        if release_all:
            for pod in list(self.keeper.endpoints):
                ids = self.keeper.tracked(pod)
                if ids:
                    await self.keeper.release(pod, ids, ReleaseReason.DROPPED)
        for t in list(self._bg):
            t.cancel()
        await self.keeper.stop()

    # ---- decode leg ------------------------------------------------------------
    def lease_s(self, pod: PodId) -> float | None:
        """The lease a decode leg on ``pod`` asks for (None: the node has no leases)."""
        return self.cfg.decode_lease_s if self.has(pod) else None

    # ---- a turn is decoded, then kept ----------------------------------------------------
    def plan(self, conversation: str, pod: PodId) -> Held | None:
        """The hold of the turn a decode leg on ``pod`` is about to finish (None: the node
        has no leases). Decided before the leg, so a turn the policy would release at once
        is not retained at all (``Held.retains``: the leg asks the node to keep nothing);
        ``retained`` or ``not_retained`` logs and counts it once the leg is over."""
        if not self.has(pod):
            return None
        choice = self._choose(conversation, pod)
        hold = min(choice.hold_s, self.cfg.entry_ttl_s)
        return Held(round(hold, 1), choice.basis, choice.samples,
                    round(choice.host_odds, 2)
                    if self.policy is not None and self.policy.host_copy else None,
                    round(choice.pressure, 3) if self.pressure is not None else None,
                    choice.explanation)

    def finished(self, tenant: str, conversation: str, tokens: int) -> None:
        """A conversation's turn finished, leaving ``tokens`` of KV behind (retained or not):
        the start of the wait its next turn ends (``arrived``)."""
        self._remember(self._last, (tenant, conversation), (time.monotonic(), tokens))

    def retained(self, entry: RetainedKV, held: Held | None = None) -> Held | None:
        """Start holding ``entry``'s blocks for ``held`` (``plan``'s choice; None: choose
        now); the choice (None: not held under a lease)."""
        pod, rid = entry.decode_pod, entry.params.remote_request_id
        if rid is None or not self.has(pod):
            return None
        if held is None:
            held = self.plan(str(entry.conversation), pod)
            assert held is not None  # has(pod)
        self._chosen(str(entry.conversation), pod, held)
        if not held.retains:  # a node that kept the turn though asked not to
            self._release_soon(pod, [rid], ReleaseReason.MOVED)
            return held
        self.keeper.track(pod, rid, held.hold_s)
        return held

    def not_retained(self, conversation: str, pod: PodId, held: Held) -> None:
        """The decode leg asked ``pod`` to keep nothing (``held`` releases at once), and it
        did not: counted and logged as that release."""
        self._chosen(conversation, pod, held)

    def _chosen(self, conversation: str, pod: PodId, held: Held) -> None:
        self.metrics.hold_choices.labels(held.basis, "hold" if held.retains else "release").inc()
        self.metrics.hold_seconds.observe(held.hold_s)
        if self.policy is not None:
            log.info("hold", extra={"conversation_id": conversation, "pod": pod,
                                    **held.fields(), "why": held.why})

    def _choose(self, conversation: str, pod: PodId) -> HoldChoice:
        if self.policy is None:
            return HoldChoice(self.cfg.entry_ttl_s, "renew", 0, 0.0,
                              "retention: renew: hold while the store keeps the turn")
        f = self.pressure.factor(pod) if self.pressure is not None else 1.0
        return self.policy.choose(conversation, f)

    # ---- a turn was taken ------------------------------------------------------------
    def arrived(self, tenant: str, conversation: str) -> int:
        """A conversation's next turn arrived, whether or not its turn was still stored: its
        wait feeds the adaptive policy (the waits that outlive a hold are the ones it must
        see). Returns the tokens its previous turn left (0: none known here)."""
        last = self._last.pop((tenant, conversation), None)
        if last is None:
            return 0
        if self.policy is not None:
            self.policy.observe(conversation, time.monotonic() - last[0], last[1])
        return last[1]

    def host_seen(self, conversation: str, host_tokens: int, prior_tokens: int) -> None:
        """At a continuation turn: the indexer says a host tier holds ``host_tokens`` of this
        prompt, of the ``prior_tokens`` the turn before left. Feeds the adaptive policy's
        estimate of whether host copies survive (module docstring of kvtier.cost.hold)."""
        if self.policy is None or not self.policy.host_copy or prior_tokens <= 0:
            return
        held = host_tokens >= HOST_HELD_FRACTION * prior_tokens
        self.policy.observe_host(conversation, held)
        self.metrics.host_copy_checks.labels("held" if held else "gone").inc()

    def gone(self, entry: RetainedKV) -> bool:
        """The lease of ``entry`` is known to be gone (released or expired)."""
        rid = entry.params.remote_request_id
        return rid is not None and (entry.decode_pod, rid) in self._gone

    async def confirm(self, entry: RetainedKV, params: NixlParams) -> NixlParams | None:
        """``params`` with the lease's fresh deadline, after renewing it; None when the lease
        is gone (one already known gone is refused earlier, by ``gone``). A node that does
        not answer leaves ``params`` as they are (the prefill still checks their deadline)."""
        pod, rid = entry.decode_pod, entry.params.remote_request_id
        if rid is None or not self.has(pod):
            return params
        lease_s = max(self.cfg.decode_lease_s, READ_WINDOW_S)
        reply = await self.keeper.call(pod, LeaseRequest(Op.RENEW, (rid,), lease_s))
        if reply is None or not reply.ok:
            return params
        state = reply.leases.get(rid)
        if state is None or not state.held:
            self._remember(self._gone, (pod, rid), None)
            return None
        if state.expires_in_s < MIN_READ_LEFT_S:
            # held, but vLLM's TTL ends before a read could clear its margin: the prefill
            # would decline it (and fail the request); the caller releases it instead
            self.metrics.lease_calls.labels("renew", "too_late").inc()
            return None
        return params.model_copy(update={"remote_blocks_expiry_time": state.deadline})

    def ended(self, entry: RetainedKV, read: bool, reason: ReleaseReason) -> None:
        """The taken ``entry``'s turn is over: ``read`` (vLLM frees the blocks after the
        prefill's read) or released now for ``reason``."""
        pod, rid = entry.decode_pod, entry.params.remote_request_id
        if rid is None or not self.has(pod):
            return
        if read:
            self.keeper.forget(pod, rid)
            return
        self._release_soon(pod, [rid], reason)

    async def close(self, entry: RetainedKV) -> Released:
        """The client closed the conversation: release its turn now (awaited), and say
        whether the decode node freed its blocks."""
        rid = entry.params.remote_request_id
        self._last.pop((entry.tenant, str(entry.conversation)), None)
        if rid is None:
            return Released.NOTHING_HELD
        if not self.has(entry.decode_pod):
            return Released.NO_LEASE_ENDPOINT
        if await self.keeper.release(entry.decode_pod, [rid], ReleaseReason.CLOSED):
            return Released.RELEASED
        return Released.UNAVAILABLE

    def evicted(self, entry: RetainedKV) -> None:
        """The store let ``entry`` go untaken: release its blocks now (in the background; the
        store calls this inside its update) unless its lease is no longer renewed here
        (already released, read, lost, or its hold over)."""
        pod, rid = entry.decode_pod, entry.params.remote_request_id
        if rid is not None and self.keeper.holds(pod, rid):
            self.keeper.forget(pod, rid)  # no renewal of it from now on
            self._release_soon(pod, [rid], ReleaseReason.DROPPED)

    def pod_down(self, pod: PodId) -> None:
        """``pod`` is gone, and its leases with it: stop renewing them."""
        for rid in self.keeper.tracked(pod):
            self.keeper.forget(pod, rid)

    # ---- internals ---------------------------------------------------------------------
    def _release_soon(self, pod: PodId, ids: list[str], reason: ReleaseReason) -> None:
        t = asyncio.get_running_loop().create_task(self.keeper.release(pod, ids, reason))
        self._bg.add(t)
        t.add_done_callback(self._bg.discard)

    def _released(self, reason: ReleaseReason, n: int) -> None:
        self.metrics.lease_releases.labels(reason.value).inc(n)

    def _lost(self, pod: PodId, rid: str) -> None:
        self._remember(self._gone, (pod, rid), None)
        self.metrics.lease_lost.inc()

    def _result(self, op: str, result: str) -> None:
        self.metrics.lease_calls.labels(op, result).inc()

    @staticmethod
    def _remember(d: OrderedDict[Any, Any], key: Any, value: Any) -> None:
        d[key] = value
        d.move_to_end(key)
        while len(d) > _MAX_TRACKED:
            d.popitem(last=False)
