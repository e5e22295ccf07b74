"""The reuse path of one prefill leg: which retained or cached KV to hand the prefill.

Threading model: pure functions; no shared state (``explore``, when given, is the caller's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from kvtier.cost.decide import Offer, TtftCost
from kvtier.cost.learned import Explore, choose_path
from kvtier.ids import PodId, ReusePath
from kvtier.router.store import ReuseDecision
from kvtier.transfer_params import NixlParams, RemoteKVSource


@dataclass(frozen=True, slots=True)
class PlanChoice:
    """What the cost-based choice weighed, for the ``served`` log line."""

    expected_s: dict[str, float]  # expected TTFT per offered path and "none" (recompute)
    explored: bool                # taken to keep an estimate alive, not as the cheapest

    def fields(self) -> dict[str, object]:
        out: dict[str, object] = {"expected_ms": {p: round(s * 1e3, 2)
                                                  for p, s in self.expected_s.items()}}
        if self.explored:
            out["explored"] = True
        return out


class Plan(NamedTuple):
    path: ReusePath
    tokens: int                      # prompt tokens the path is to supply
    reuse: NixlParams | None         # the D->P params to hand the prefill
    source: RemoteKVSource | None    # the peer host source to hand the prefill
    choice: PlanChoice | None        # None: no cost model, or nothing offered


def plan(reuse: NixlParams | None, decision: ReuseDecision, source: RemoteKVSource | None,
         matched: dict[PodId, int] | None, pod: PodId, prompt_tokens: int,
         cost: TtftCost | None, explore: Explore | None = None) -> Plan:
    """The reuse path of a prefill leg on ``pod``, the prompt tokens it is to supply, and the
    params to hand the prefill, by ``kvtier.cost.decide`` over what the decode node retains
    (D->P), what a peer's host tier holds (p2p) and what the pod itself holds (local: the
    indexer does not say whether in its device cache or its own host tier, so it is an offer,
    not tokens the engine is known to skip).

    ``cost`` is the calibrated model or the router's live estimate of it
    (``RouterCost.decision_cost``); ``explore`` may then take another path for this turn.
    With a cost the chosen path's params alone go to the prefill (a read that does not pay
    is not attempted); without one every path's params go, and the engine's connector picks
    (vLLM's MultiConnector: the first child that offers tokens), which is the order offered
    here."""
    offers = []
    if reuse is not None:
        offers.append(Offer(ReusePath.DP_READ, decision.reused_tokens))
    if source is not None:
        offers.append(Offer(ReusePath.P2P, source.num_tokens))
    local = (matched or {}).get(pod, 0)
    if local:
        offers.append(Offer(ReusePath.LOCAL, local))
    if not offers or prompt_tokens <= 0:
        return Plan(ReusePath.NONE, 0, reuse, source, None)
    d, explored = choose_path(prompt_tokens, offers, cost, explore)  # as the simulator does
    choice = None
    if cost is not None:
        expected = {ReusePath.NONE.value: cost.ttft_s(None, prompt_tokens, 0)}
        for o in offers:
            expected[o.path] = cost.ttft_s(o.path, prompt_tokens, o.tokens)
        choice = PlanChoice(expected, explored)
        reuse = reuse if d.path == ReusePath.DP_READ else None
        source = source if d.path == ReusePath.P2P else None
    if d.path is None:
        return Plan(ReusePath.NONE, 0, reuse, source, choice)
    return Plan(ReusePath(d.path), d.tokens, reuse, source, choice)
