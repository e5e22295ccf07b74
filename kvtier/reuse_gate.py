"""The one reuse gate: is a peer's host copy worth pulling, by how many tokens it adds?

``min_cached_token_delta`` (llm-d's ``minCachedTokenDelta``) is the least number of tokens a
source must hold *beyond* what the target already holds, on any tier, for a pull to be worth
its fixed costs (a round trip, pinned buffers, a lease on the source). It has one default,
``DEFAULT_MIN_CACHED_TOKEN_DELTA``, and one rule, ``gains_enough``; every place that gates a
pull calls it:

- the router, once per turn, on the indexer's best candidate (``kvtier.router.indexer_client``);
- the indexer, when a caller names a target pod and a delta (``kvtier.indexer.select``):
  it answers the same question the router asks, it does not add a second rule;
- the engine's host tier, defensively, before it starts a pull the router asked for
  (``kvtier.tier.scheduler``): what it holds may have changed since the router looked.

A delta of 0 means "any gain": a pull of nothing is never worth it, so the floor is one token.

Threading model: pure functions.
"""

from __future__ import annotations

DEFAULT_MIN_CACHED_TOKEN_DELTA = 1


def gains_enough(gain_tokens: int,
                 min_cached_token_delta: int = DEFAULT_MIN_CACHED_TOKEN_DELTA) -> bool:
    """True when pulling ``gain_tokens`` more tokens than the target holds is worth it."""
    return gain_tokens >= max(min_cached_token_delta, 1)
