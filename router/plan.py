"""The reuse path of one prefill leg: which retained or cached KV to hand the prefill.

Threading model: a pure function; no shared state.
"""

from __future__ import annotations

from kvtier.cost.decide import Offer, decide
from kvtier.cost.model import CostModel
from kvtier.ids import PodId, ReusePath
from kvtier.router.store import ReuseDecision
from kvtier.transfer_params import NixlParams, RemoteKVSource


def plan(reuse: NixlParams | None, decision: ReuseDecision, source: RemoteKVSource | None,
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
