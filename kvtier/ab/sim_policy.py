"""What a simulated strategy decides, as its deployed router and engines would (`kvtier.ab.simulator`).

`SimPolicy` is the part of a `StrategySpec` the simulator needs, parsed once. `Decisions`
holds what the strategy decides from as the replay goes on, and makes the decisions:

- the reuse path of each turn (`choose`): `kvtier.cost.decide` by expected cost for adaptive
  strategies, else by vLLM's ``kv_recompute_threshold`` (D->P) and the router's
  ``min_cached_token_delta`` (peer host);
- the device TTL, re-chosen online from the tool waits seen so far (`observe_wait`;
  `kvtier.cost.retention.choose_device_ttl`, last ``ADAPTIVE_WINDOW`` waits, every
  ``ADAPTIVE_REFIT_EVERY`` new ones once ``ADAPTIVE_MIN_WAITS`` were seen; 0 when no TTL pays
  for its memory), or with decode leases the hold per conversation and turn
  (`kvtier.cost.hold.HoldPolicy`, capped at the router's entry TTL: `hold_after`);
- with ``cost_refit``, the cost model it decides with, refitted from each turn's TTFT
  (`kvtier.cost.online.OnlineCost`: `observe_turn`).

Threading model: plain mutable state, owned by one `_Sim` on one thread.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kvtier.ab.records import TurnRecord
from kvtier.ab.strategies import StrategySpec, router_ttl_margin_s
from kvtier.cost.decide import Offer, decide
from kvtier.cost.hold import HOST_HELD_FRACTION, HoldPolicy
from kvtier.cost.model import CostModel
from kvtier.cost.online import OnlineCost
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

    @classmethod
    def of(cls, s: StrategySpec, online_ttl: bool = True) -> SimPolicy:
        ttl = float(s.decode_ttl_s or 0.0) if s.device_retention else 0.0
        return cls(s.name, ttl, s.dp_reuse and ttl > 0, s.host_tier, s.peer_fetch, s.prefix_caching,
                   s.kv_recompute_threshold, s.min_cached_token_delta, s.adaptive,
                   s.retention_horizon_s, online_ttl and s.adaptive, leases=s.leases)


class Decisions:
    """The strategy's decisions and what they are made from (see the module docstring).

    ``cost`` is what the deployed strategy decides with (paths, holds, TTLs); the simulator
    times the work with its own model."""

    def __init__(self, policy: SimPolicy, cost: CostModel, refit: bool = False) -> None:
        self.p = policy
        self.cost = cost
        # cost_refit: the router refits what it decides with from the TTFTs it sees
        self.online = OnlineCost(cost) if refit and policy.adaptive else None
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
        if self.p.adaptive:
            d = decide(prompt, offers, local_tokens=local, cost=self.cost)
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

    def observe_turn(self, conv: ConversationId, turn: int, rec: TurnRecord) -> None:
        """``rec`` started decoding: refit the cost model from its TTFT (``cost_refit``) and
        keep it for the hold chosen when it finishes (decode leases)."""
        if self.online is not None and self.online.observe(
                rec.computed_tokens, rec.reused_tokens, rec.reuse_path, rec.ttft_s):
            self.cost = self.online.model
            if self.hold is not None:
                self.hold.cost = self.cost
        if self.hold is not None:
            self._record_of[(conv, turn)] = rec

    def hold_after(self, conv: ConversationId, turn: int) -> float:
        """Seconds to keep ``turn``'s device KV now that it finished: the device TTL, or with
        decode leases the hold chosen for it (recorded in its ``hold_s`` / ``hold_basis``)."""
        if self.hold is None:
            return self.ttl_s
        c = self.hold.choose(str(conv))
        ttl = min(c.hold_s, self.hold_cap)
        rec = self._record_of.pop((conv, turn), None)
        if rec is not None:
            rec.hold_s, rec.hold_basis, rec.hold_samples = round(ttl, 1), c.basis, c.samples
        return ttl
