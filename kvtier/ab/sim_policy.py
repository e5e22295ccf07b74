"""What a simulated strategy decides, as its deployed router and engines would (`kvtier.ab.simulator`).

`SimPolicy` is the part of a `StrategySpec` the simulator needs, parsed once. `Decisions`
holds what the strategy decides from as the replay goes on, and makes the decisions:

- the reuse path of each turn (`choose`): for adaptive strategies by expected cost, with
  `kvtier.cost.learned.LearnedCost` -- the object the live router decides with
  (``kvtier.router.costs``), configured from the settings the strategy hands its router
  (`LearnSettings.of_router` over ``StrategySpec.router_settings``): with ``cost_learn`` the
  estimates of what each path really cost and the counted exploration, with ``cost_refit``
  the online refit, each fed every simulated prefill leg when it answers
  (`observe_leg`, as the router's ``prefill_leg``); else by vLLM's
  ``kv_recompute_threshold`` (D->P) and the router's ``min_cached_token_delta`` (peer host);
- the device TTL, re-chosen online from the tool waits seen so far (`observe_wait`;
  `kvtier.cost.retention.choose_device_ttl`, last ``ADAPTIVE_WINDOW`` waits, every
  ``ADAPTIVE_REFIT_EVERY`` new ones once ``ADAPTIVE_MIN_WAITS`` were seen; 0 when no TTL pays
  for its memory), or with decode leases the hold per conversation and turn
  (`kvtier.cost.hold.HoldPolicy`, capped at the router's entry TTL: `hold_after`), priced by
  the decode node's pressure where the router's ``hold_pressure`` is on (the caller passes
  ``kvtier.cost.hold.pressure_factor`` of the simulated node's KV in use and turns waiting);
- the cost model holds are priced with: the deployed one, or its online refit.

Threading model: plain mutable state, owned by one `_Sim` on one thread.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kvtier.ab.records import TurnRecord
from kvtier.ab.strategies import StrategySpec, router_ttl_margin_s
from kvtier.cost.decide import Offer, decide
from kvtier.cost.hold import HOST_HELD_FRACTION, HoldPolicy
from kvtier.cost.learned import LearnedCost, LearnSettings
from kvtier.cost.model import CostModel
from kvtier.cost.retention import WaitSample, choose_device_ttl
from kvtier.ids import ConversationId, ReusePath

# Adaptive device TTL: re-choose it from the last ADAPTIVE_WINDOW waits once
# ADAPTIVE_MIN_WAITS were seen, then every ADAPTIVE_REFIT_EVERY new ones.
ADAPTIVE_WINDOW, ADAPTIVE_MIN_WAITS, ADAPTIVE_REFIT_EVERY = 512, 8, 8


@dataclass(frozen=True)
class SimPolicy:
    """What the simulator needs from a StrategySpec, parsed once."""

    name: str
    ttl_s: float  # 0: no device retention
    dp_read: bool
    host_copy: bool
    p2p: bool
    local_cache: bool
    threshold: int
    delta: int
    adaptive: bool
    horizon_s: float = 60.0  # adaptive: kvtier.cost.retention's holding price
    online_ttl: bool = False  # adaptive: re-choose the device TTL as waits are observed
    leases: bool = False  # decode leases: the hold is chosen per conversation and turn
    # adaptive: what its router learns from the prefill legs (cost_refit, cost_learn, ...)
    learn: LearnSettings = LearnSettings()
    hold_pressure: bool = False  # holds priced by the decode node's pressure
    hold_waiting_ref: float = 4.0  # requests waiting that halve the price horizon

    @classmethod
    def of(cls, s: StrategySpec, online_ttl: bool = True) -> SimPolicy:
        ttl = float(s.decode_ttl_s or 0.0) if s.device_retention else 0.0
        # the live router's settings, where the strategy deploys one that decides by cost
        router = s.router_settings() if s.adaptive_retention else {}
        learn = (LearnSettings.of_router(router) if router
                 else LearnSettings(refit=s.cost_refit and s.adaptive))
        return cls(s.name, ttl, s.dp_reuse and ttl > 0, s.host_tier, s.peer_fetch, s.prefix_caching,
                   s.kv_recompute_threshold, s.min_cached_token_delta, s.adaptive,
                   s.retention_horizon_s, online_ttl and s.adaptive, leases=s.leases,
                   learn=learn if s.adaptive else LearnSettings(),
                   hold_pressure=bool(router.get("hold_pressure", False)),
                   hold_waiting_ref=float(router.get("hold_waiting_ref", 4.0)))


class Decisions:
    """The strategy's decisions and what they are made from (see the module docstring).

    ``cost`` is what the deployed strategy decides with (paths, holds, TTLs); the simulator
    times the work with its own model."""

    def __init__(self, policy: SimPolicy, cost: CostModel) -> None:
        self.p = policy
        self.cost = cost
        # adaptive: what the router decides paths with and learns from its legs (the same
        # object as the live router's, kvtier.cost.learned)
        self.learned = LearnedCost(cost, policy.learn) if policy.adaptive else None
        # adaptive: tool waits seen so far (bounded window) -> the device TTL, re-chosen online
        self.waits: deque[WaitSample] = deque(maxlen=ADAPTIVE_WINDOW)
        self.ttl_s = policy.ttl_s
        self.ttl_history: list[tuple[float, float]] = [(0.0, policy.ttl_s)]
        # decode leases (adaptive, online): the router's per-conversation hold policy, capped
        # like the router's at its entry TTL (the device TTL less the router's margin)
        self.hold: HoldPolicy | None = None
        self.hold_cap = policy.ttl_s - router_ttl_margin_s(policy.ttl_s)
        if policy.leases and policy.online_ttl and policy.ttl_s > 0 and "dp_read" in cost.reads:
            self.hold = HoldPolicy(cost, host_copy=policy.host_copy and policy.p2p,
                                   default_hold_s=self.hold_cap, horizon_s=policy.horizon_s)
        self._record_of: dict[tuple[ConversationId, int], TurnRecord] = {}

    def choose(self, prompt: int, local: int, offers: list[Offer]) -> tuple[str | None, int]:
        """kvtier.cost.decide, as the deployed strategy would: by expected cost (adaptive), or
        by vLLM's ``kv_recompute_threshold`` and the router's ``min_cached_token_delta``."""
        if self.learned is not None:
            d, _ = self.learned.choose(prompt, offers, local_tokens=local)
        else:
            d = decide(prompt, offers, local_tokens=local,
                       thresholds={ReusePath.DP_READ: self.p.threshold, ReusePath.P2P: self.p.delta})
        return d.path, d.tokens

    def observe_host(self, conv: ConversationId, held_tokens: int, prior_context: int) -> None:
        """As the router does from the indexer: did a host tier keep the previous turn
        (``prior_context`` tokens)?"""
        if self.hold is not None and self.hold.host_copy:
            self.hold.observe_host(str(conv), held_tokens >= HOST_HELD_FRACTION * prior_context)

    def observe_wait(self, conv: ConversationId, now: float, wait_s: float, tokens: int) -> None:
        """``conv`` came back after ``wait_s`` with ``tokens`` of context: a hold sample, or a
        wait the device TTL is re-chosen from."""
        if self.hold is not None:
            self.hold.observe(str(conv), wait_s, tokens)
            return
        self.waits.append(WaitSample(wait_s, tokens))
        n = len(self.waits)
        if n >= ADAPTIVE_MIN_WAITS and (n - ADAPTIVE_MIN_WAITS) % ADAPTIVE_REFIT_EVERY == 0:
            choice = choose_device_ttl(self.cost, list(self.waits),
                                       host_copy=self.p.host_copy and self.p.p2p,
                                       horizon_s=self.p.horizon_s)
            ttl = choice.ttl_s if choice.retain else 0.0  # 0: keep nothing on the device
            if ttl != self.ttl_s:
                self.ttl_s = ttl
                self.ttl_history.append((now, ttl))

    def observe_leg(self, prompt: int, path: ReusePath, reused: int, seconds: float) -> None:
        """A prefill leg answered after ``seconds`` (arrival to answer, queueing included, as
        the router times it): the router's ``prefill_leg``. A refit reprices the holds, as the
        router's ``on_change`` does."""
        if self.learned is None:
            return
        if self.learned.observe(prompt, path, reused, seconds).refitted:
            assert self.learned.model is not None  # a refit needs a model to start from
            self.cost = self.learned.model
            if self.hold is not None:
                self.hold.cost = self.cost

    def observe_turn(self, conv: ConversationId, turn: int, rec: TurnRecord) -> None:
        """``rec`` started decoding: keep it for the hold chosen when it finishes (decode
        leases)."""
        if self.hold is not None:
            self._record_of[(conv, turn)] = rec

    def learned_meta(self) -> dict[str, int]:
        """What the router's learning did in this replay (for the run's meta)."""
        out: dict[str, int] = {}
        if self.learned is not None and self.learned.estimator is not None:
            est = self.learned.estimator
            out.update(legs_observed=est.seen, decided=est.decided, explored=est.explored)
        if self.learned is not None and self.learned.online is not None:
            out["cost_refits"] = self.learned.online.refits
        return out

    def hold_after(self, conv: ConversationId, turn: int, pressure: float = 1.0) -> float:
        """Seconds to keep ``turn``'s device KV now that it finished: the device TTL, or with
        decode leases the hold chosen for it (recorded in its ``hold_s`` / ``hold_basis``).
        ``pressure``: the decode node's price factor (``hold_pressure`` only; 1: idle)."""
        if self.hold is None:
            return self.ttl_s
        c = self.hold.choose(str(conv), pressure if self.p.hold_pressure else 1.0)
        ttl = min(c.hold_s, self.hold_cap)
        rec = self._record_of.pop((conv, turn), None)
        if rec is not None:
            rec.hold_s, rec.hold_basis, rec.hold_samples = round(ttl, 1), c.basis, c.samples
        return ttl
