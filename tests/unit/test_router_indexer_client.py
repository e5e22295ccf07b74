"""The router's indexer client (kvtier.router.indexer_client): one ``/v1/route`` call, and the
one reuse gate applied to its best candidate for the prefill the router chose."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from kvtier.ids import PodId
from kvtier.reuse_gate import DEFAULT_MIN_CACHED_TOKEN_DELTA, gains_enough
from kvtier.router.config import RouterConfig
from kvtier.router.indexer_client import IndexerClient, Route
from kvtier.wire.indexer_api import Source

BEST = Source(pod="peer", tier="CPU", matched_tokens=64, p2p_host="10.0.0.2", p2p_port=7000)


def _route(target_holds: int) -> Route:
    return Route({PodId("target"): target_holds}, BEST, host_tokens=64)


@pytest.mark.parametrize("threshold", [1, 16, 32])
def test_the_source_is_gated_by_the_one_gate_at_its_boundary(threshold: int) -> None:
    for delta in (threshold - 1, threshold, threshold + 1):
        src = _route(64 - delta).source_for(PodId("target"), threshold, "m", 16)
        assert (src is not None) == gains_enough(delta, threshold) == (delta >= threshold)
        if src is not None:
            assert (src.pod, src.host, src.port, src.num_tokens) == ("peer", "10.0.0.2", 7000, 64)


def test_a_delta_of_zero_means_any_gain_and_never_nothing() -> None:
    assert _route(63).source_for(PodId("target"), 0, "m", 16) is not None
    assert _route(64).source_for(PodId("target"), 0, "m", 16) is None
    # and a pod is never told to pull from itself
    assert _route(0).source_for(PodId("peer"), 0, "m", 16) is None


def test_the_router_default_is_the_gates_default() -> None:
    cfg = RouterConfig.model_validate({"decode": ["http://d:1"]})
    assert cfg.min_cached_token_delta == DEFAULT_MIN_CACHED_TOKEN_DELTA


def test_route_asks_for_candidates_only() -> None:
    # no target pod and no threshold: the indexer answers its best candidate, the router gates
    sent: list[dict[str, object]] = []

    async def answer(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        return httpx.Response(200, json={
            "block_size": 16, "source": None, "target_matched_tokens": 0, "delta": 0,
            "matches": [{"pod": "a", "tier": "GPU", "matched_tokens": 32},
                        {"pod": "a", "tier": "CPU", "matched_tokens": 48}]})

    async def go() -> Route | None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
            return await IndexerClient("http://idx:1", client, 1.0).route(
                "m", [1, 2, 3], {"a": 2})

    route = asyncio.run(go())
    assert route is not None and route.matched == {"a": 48} and route.host_tokens == 48
    assert sent == [{"model": "m", "token_ids": [1, 2, 3], "loads": {"a": 2}}]
