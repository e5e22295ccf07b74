"""Which KV path serves a prefill: load from one of several sources, or recompute.

Pure arithmetic, no I/O, no vLLM: the decision ``CostAwareConnector`` makes
for every request, kept here so it is unit-tested on its own.

Expected time to have the KV of a prompt's ``remaining`` tokens (those not
already in the engine's own prefix cache) when a path offers ``t`` of them::

    load(t)      = setup_s + t * bytes_per_token / bandwidth_bytes_per_s
    recompute(r) = r / recompute_tokens_per_s
    cost(path)   = load(t) + recompute(remaining - t)
    cost(none)   = recompute(remaining)

The cheapest wins. Ties go to more tokens loaded, then to the earlier path in
config order (what MultiConnector would have picked), so with equal costs the
behaviour is MultiConnector's. ``PathCost`` parameters come from the
connector's config (fit them with ``kvtier calibrate`` or
``benchmarks/bench_host_tier.py``); recompute is modelled as linear in tokens,
which is optimistic for long prompts (attention is quadratic) and therefore
errs towards loading less.

Threading model: stateless functions over frozen values.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field


class PathCost(BaseModel):
    """Cost parameters of one load path (one child connector)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    setup_s: float = Field(default=0.0, ge=0)
    bandwidth_bytes_per_s: float = Field(gt=0)


class CostModel(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    recompute_tokens_per_s: float = Field(gt=0)
    paths: tuple[PathCost, ...]
    # Bytes of KV per token (all layers); None: the engine adapter fills it in.
    bytes_per_token: int | None = Field(default=None, gt=0)

    def with_bytes_per_token(self, n: int) -> "CostModel":
        return self if self.bytes_per_token is not None else self.model_copy(
            update={"bytes_per_token": n})


class Choice(BaseModel):
    model_config = ConfigDict(frozen=True)

    path: int | None  # index into the offers; None: recompute everything
    tokens: int  # tokens loaded on that path (0 for recompute)
    expected_s: float
    recompute_s: float  # expected time of recomputing everything, for comparison


def load_time(tokens: int, bytes_per_token: int, path: PathCost) -> float:
    return path.setup_s + tokens * bytes_per_token / path.bandwidth_bytes_per_s


def choose_path(offers: Sequence[int], remaining: int, model: CostModel) -> Choice:
    """Pick the cheapest way to obtain ``remaining`` tokens' KV.

    ``offers[i]`` is how many of those tokens path ``i`` can load (0: none);
    an offer larger than ``remaining`` is counted as ``remaining`` for the
    recompute part (a connector may round up to a block) but loads in full.
    """
    if len(offers) != len(model.paths):
        raise ValueError(f"{len(offers)} offers for {len(model.paths)} configured paths")
    if model.bytes_per_token is None:
        raise ValueError("bytes_per_token is unknown")
    if remaining < 0 or any(t < 0 for t in offers):
        raise ValueError(f"negative token count: remaining={remaining} offers={list(offers)}")
    rate = model.recompute_tokens_per_s
    everything = remaining / rate
    best = Choice(path=None, tokens=0, expected_s=everything, recompute_s=everything)
    for i, (t, cost) in enumerate(zip(offers, model.paths)):
        if t <= 0:
            continue
        s = load_time(t, model.bytes_per_token, cost) + max(0, remaining - t) / rate
        better = s < best.expected_s or (s == best.expected_s and t > best.tokens)
        if better:
            best = Choice(path=i, tokens=t, expected_s=s, recompute_s=everything)
    return best
