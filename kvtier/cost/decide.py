"""The one pull-or-recompute decision: which offered KV path serves a prefill, or none.

The CostAwareConnector (per request, over its children's offers), the router (per turn,
over the decode node's retained KV and a peer's host copy) and the simulator (per simulated
turn) all call ``decide``; so they agree, and they break ties the same way.

Inputs: the prompt (``prompt_tokens``), what the engine already holds locally
(``local_tokens``: its prefix cache) and the offers, in preference order, each a read path
and the tokens beyond ``local_tokens`` it can supply. Then:

1. **Admission.** An offer of no tokens is out. With ``thresholds`` (path -> minimum
   tokens; what vLLM's ``kv_recompute_threshold`` and kvtier's ``min_cached_token_delta``
   are), an offer below its path's threshold is out (a threshold of 0 admits everything).
2. **Cost** (with a ``cost`` model). Expected time to the first token on each admitted
   path, ``cost.ttft_s`` (the read, then the prefill of the rest; the engine always
   computes the last prompt token), against recomputing. ``cost`` is a ``CostModel`` (the
   calibration) or anything with its ``ttft_s`` (``TtftCost``): the router passes
   ``kvtier.cost.estimator.EstimatedCost``, the calibration blended with what each path
   really cost on the turns it timed. Without a cost model an admitted
   offer counts as worth reading: the threshold already said so.
3. **The tie rule.** A path wins only when it is *strictly* cheaper than the best so far, by
   more than a relative 1e-9: equal costs go to recompute (moving bytes that save nothing
   costs what the model does not see: memory bandwidth, pinned leases), then to the offer
   listed first (the preference order; MultiConnector's config order in the connector).

Threading model: pure functions over immutable values.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

TIE_REL = 1e-9  # relative: costs closer than this are equal


class TtftCost(Protocol):
    """What ``decide`` needs of a cost model: ``CostModel.ttft_s``'s signature."""

    def ttft_s(self, path: str | None, prompt_tokens: int, reused_tokens: int, *,
               local_tokens: int = 0) -> float: ...


@dataclass(frozen=True)
class Offer:
    """``tokens`` of a prompt's KV (beyond what the engine holds) available over ``path``."""

    path: str  # a read path of the cost model: a ReusePath value or a connector child's name
    tokens: int


@dataclass(frozen=True)
class Decision:
    index: int | None  # which offer wins; None: recompute
    path: str | None
    tokens: int  # tokens loaded on that path (the offer, capped at what the prompt can use)
    expected_s: float | None  # expected TTFT on the chosen way (None: no cost model)
    recompute_s: float | None  # expected TTFT recomputing everything, for comparison

    @property
    def reads(self) -> bool:
        return self.index is not None


def decide(prompt_tokens: int, offers: Sequence[Offer], *, local_tokens: int = 0,
           cost: TtftCost | None = None,
           thresholds: Mapping[str, int] | None = None) -> Decision:
    """Pick the cheapest way to the first token; see the module docstring for the rules."""
    if prompt_tokens < 1:
        raise ValueError(f"prompt_tokens must be >= 1, got {prompt_tokens}")
    if local_tokens < 0 or any(o.tokens < 0 for o in offers):
        raise ValueError(f"negative token count: local={local_tokens} "
                         f"offers={[o.tokens for o in offers]}")
    usable = max(0, prompt_tokens - 1 - min(local_tokens, prompt_tokens - 1))
    gates = thresholds or {}
    admitted = [(i, o) for i, o in enumerate(offers)
                if min(o.tokens, usable) > 0 and o.tokens >= gates.get(o.path, 0)]
    if cost is None:
        if not admitted:
            return Decision(None, None, 0, None, None)
        i, o = admitted[0]
        return Decision(i, o.path, min(o.tokens, usable), None, None)
    recompute = cost.ttft_s(None, prompt_tokens, 0, local_tokens=local_tokens)
    best = Decision(None, None, 0, recompute, recompute)
    best_s = recompute
    for i, o in admitted:
        s = cost.ttft_s(o.path, prompt_tokens, o.tokens, local_tokens=local_tokens)
        if s < best_s - TIE_REL * max(s, best_s):
            best = Decision(i, o.path, min(o.tokens, usable), s, recompute)
            best_s = s
    return best
