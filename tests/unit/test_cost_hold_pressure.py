"""Holds priced by the decode node's pressure (kvtier.cost.hold.pressure_factor, router/pressure.py)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from kvtier.cost.hold import PRESSURE_CEIL, PRESSURE_FLOOR, HoldPolicy, pressure_factor
from kvtier.cost.model import CostModel, LinkModel
from kvtier.ids import PodId
from kvtier.router.metrics import RouterMetrics
from kvtier.router.pressure import DecodePressure, parse


def _cost() -> CostModel:
    return CostModel(kv_bytes_per_token=2048, prefill_a_s=0.01, prefill_b_s_per_token=2e-4,
                     prefill_c_s_per_token_ctx=2e-8, decode_s_per_token=0.002, block_size=32,
                     reads={"dp_read": LinkModel(setup_s=0.004, bytes_per_s=4e9)})


def test_the_pressure_factor_is_one_at_half_full_and_falls_as_pressure_rises():
    assert pressure_factor(0.5, 0) == 1.0
    usages = [pressure_factor(u, 0) for u in (0.0, 0.3, 0.6, 0.9, 1.0)]
    assert usages == sorted(usages, reverse=True) and usages[-1] == PRESSURE_FLOOR
    assert PRESSURE_FLOOR < usages[-2] < 1.0 < usages[1] < usages[0] <= PRESSURE_CEIL
    # memory nobody needs is priced next to nothing: at 1% in use the horizon is 99x
    assert pressure_factor(0.01, 0) == pytest.approx(99.0)
    assert pressure_factor(0.0, 0) == PRESSURE_CEIL
    assert pressure_factor(float("nan"), 0) == PRESSURE_FLOOR  # unreadable usage: full
    waits = [pressure_factor(0.5, q) for q in (0, 1, 4, 16)]
    assert waits == sorted(waits, reverse=True) and waits[2] == pytest.approx(0.5)


def test_given_decode_pressure_rising_holds_shorten():
    p = HoldPolicy(_cost(), host_copy=False, min_samples=3, horizon_s=60)
    for w in (2.0, 10.0, 20.0, 30.0, 40.0, 150.0):
        for _ in range(3):
            p.observe("c", w, 2000)
    holds = [p.choose("c", pressure_factor(u, q)).hold_s
             for u, q in ((0.0, 0), (0.5, 0), (0.8, 0), (0.8, 4), (0.95, 8))]
    assert holds == sorted(holds, reverse=True)
    assert holds[0] > holds[-1]          # it does shorten, not merely stay
    assert holds[1] == p.choose("c").hold_s  # half full: as without pressure
    assert holds[0] > holds[1]           # an empty node: dearer waits are worth covering
    assert holds[-1] == 0.0              # a full node with a queue: released at once
    # before any wait is observed, the default hold shortens too
    d = HoldPolicy(_cost(), host_copy=False, default_hold_s=30)
    assert d.choose("x").hold_s == 30 and d.choose("x", 0.5).hold_s == 15
    assert d.choose("x", 99.0).hold_s == 30  # never beyond the configured default
    assert "pressure" in p.choose("c", 0.5).explanation


VLLM_PAGE = """\
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.75
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 3.0
vllm:num_requests_waiting{engine="1",model_name="tiny"} 1.0
vllm:num_requests_running{engine="0",model_name="tiny"} 7.0
"""


def test_a_vllm_metrics_page_gives_usage_and_waiting():
    p = parse(VLLM_PAGE)
    assert p is not None and (p.usage, p.waiting) == (0.75, 4.0)
    assert parse("vllm:kv_cache_usage_perc 0.5 1700000000\n") is None  # waiting missing
    p2 = parse("vllm:kv_cache_usage_perc 0.5 1700000000\nvllm:num_requests_waiting 2\n")
    assert p2 is not None and (p2.usage, p2.waiting) == (0.5, 2.0)


def test_the_sampler_scrapes_decode_nodes_and_unknown_means_idle():
    def answer(r: httpx.Request) -> httpx.Response:
        if r.url.host == "d0":
            return httpx.Response(200, text=VLLM_PAGE)
        return httpx.Response(404)

    m = RouterMetrics()
    dp = DecodePressure([(PodId("d0"), "http://d0"), (PodId("d1"), "http://d1")], m,
                        interval_s=2.0)
    async def scrape() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as c:
            await dp.sample(c, 1.0)

    asyncio.run(scrape())
    assert dp.factor(PodId("d0")) == pytest.approx(pressure_factor(0.75, 4.0))
    assert dp.factor(PodId("d1")) == 1.0  # no page: the configured price
    assert m.registry.get_sample_value("kvtier_router_decode_pressure",
                                       {"instance": "d0", "signal": "kv_cache_usage"}) == 0.75
    dp.max_age_s = 0.0  # stale figures no longer count
    assert dp.factor(PodId("d0")) == 1.0
