"""The live runner's bookkeeping without servers (kvtier.ab.live.measure, .stacks, .runner):
device ledger, per-turn records (reuse from the router's headers, timing and retention from the
legs), the leg tap, transfer split."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import httpx
import pytest

from kvtier.ab.live.measure import (
    DeviceLedger,
    Leg,
    LegTap,
    complete_turn,
    split_transfer,
    turn_record,
)
from kvtier.ab.live.stacks import indexer_for, router_instances
from kvtier.ab.records import TurnRecord
from kvtier.ids import Outcome, ReusePath
from kvtier.wire.reuse_headers import ReuseHeaderError, ReuseReport


def test_ledger_pins_until_read_or_ttl() -> None:
    L = DeviceLedger(block_size=32, ttl_s=10.0)
    L.retained("a", 100, now=0.0)   # 4 blocks until t=10
    L.retained("b", 32, now=5.0)    # 1 block until t=15
    assert L.blocks(6.0) == 5 and L.blocks(11.0) == 1
    L.read("a")
    assert L.blocks(6.0) == 1
    L.retained("b", 64, now=6.0)    # an unread older turn stays pinned until its TTL
    assert L.blocks(7.0) == 3
    assert DeviceLedger(32, None).blocks(0.0) == 0


def _pre(t1: float = 1.25) -> Leg:
    return Leg("prefill-0", "prefill", 1.0, t1, True, {"remote_engine_id": "p"})


def _dec(kv_out: dict | None) -> Leg:
    return Leg("decode-0", "decode", 1.25, 2.0, True, kv_out)


def test_record_takes_reuse_from_the_router_and_timing_from_the_legs() -> None:
    L = DeviceLedger(32, 100.0)
    L.retained("cid", 300, now=0.0)
    reuse = ReuseReport(ReusePath.DP_READ, 288, Outcome.TRIMMED)
    dec = _dec({"remote_block_ids": [3], "remote_num_tokens": 415})
    r = turn_record("device-ttl", "c0", 1, 0.9, 1.0, 2.0, [_pre(), dec], 400, [5] * 16, reuse, "",
                L, "cid")
    assert (r.reuse_path, r.reused_tokens, r.computed_tokens) == ("dp_read", 288, 112)
    assert r.outcome == "trimmed" and r.ok and r.response_tokens == 16
    assert r.ttft_s == pytest.approx(0.25) and r.e2e_s == pytest.approx(1.0)
    assert L.blocks(3.0) == 13  # the old entry was read; the new one (415 tokens) is pinned


def test_record_counts_what_the_engine_reused_over_what_the_router_planned() -> None:
    # The router planned a 288-token D->P read; the engine says it computed all but 96
    # (a partial load): the record keeps the engine's count, and the router's path.
    reuse = ReuseReport(ReusePath.DP_READ, 288, Outcome.FULL)
    pre = Leg("prefill-0", "prefill", 1.0, 1.25, True, None, cached_tokens=96)
    r = turn_record("device-ttl", "c0", 1, 0.0, 1.0, 2.0, [pre, _dec(None)], 400, [1], reuse, "",
                DeviceLedger(32, 100.0), "cid")
    assert (r.reuse_path, r.reused_tokens, r.computed_tokens) == ("dp_read", 96, 304)


def test_record_without_reuse_read_keeps_the_ledger() -> None:
    L = DeviceLedger(32, 100.0)
    L.retained("cid", 64, now=0.0)
    reuse = ReuseReport(ReusePath.P2P, 64, Outcome.EXPIRED)
    r = turn_record("tiered", "c0", 1, 0.0, 1.0, 2.0, [_pre(), _dec(None)], 100, [1], reuse, "",
                L, "cid")
    assert (r.reuse_path, r.outcome, r.reused_tokens) == ("p2p", "expired", 64)
    assert L.blocks(3.0) == 2  # not a D->P read: D's blocks stay until their TTL


def test_failed_turn_and_direct_fallback() -> None:
    L = DeviceLedger(32, 100.0)
    # no prefill leg (the router fell back to one instance): ttft = e2e
    direct = Leg("decode-0", "direct", 0.0, 2.0, True, None)
    d = turn_record("x", "c0", 1, 0.0, 0.0, 2.0, [direct], 10, [1],
                ReuseReport(ReusePath.NONE, 0, Outcome.STALE), "", L, "z")
    assert d.ttft_s == d.e2e_s and d.reuse_path == "none" and d.outcome == "stale" and d.ok
    # the turn failed: no decision known, nothing reused
    f = turn_record("x", "c0", 1, 0.0, 0.0, 2.0, [], 10, None, None, "boom", L, "z")
    assert (f.reuse_path, f.outcome, f.reused_tokens, f.computed_tokens) == ("none", "none", 0, 10)
    assert not f.ok and f.error == "boom" and L.blocks(0.0) == 0


def test_transfer_split_by_reused_tokens() -> None:
    L = DeviceLedger(32, None)

    def rec(conv: str, path: ReusePath, n: int) -> TurnRecord:
        return turn_record("s", conv, 1, 0, 0, 1, [_pre()], 400, [1],
                       ReuseReport(path, n, Outcome.NONE), "", L, conv)

    rs = [rec("c", ReusePath.DP_READ, 100), rec("d", ReusePath.P2P, 300),
          rec("e", ReusePath.LOCAL, 50)]
    split_transfer(rs, 0.4)
    assert [r.transfer_s for r in rs] == [pytest.approx(0.1), pytest.approx(0.3), 0.0]


def _router(headers: dict[str, str]) -> httpx.Client:
    def answer(request: httpx.Request) -> httpx.Response:
        assert request.headers["x-request-id"] == "rid-1"
        assert json.loads(request.content)["conversation_id"] == "cid"
        return httpx.Response(200, json={"choices": [{"token_ids": [7, 8]}]}, headers=headers)

    return httpx.Client(base_url="http://router", transport=httpx.MockTransport(answer))


def test_complete_reads_the_routers_decision() -> None:
    with _router({"x-kvtier-reuse": "p2p; tokens=96", "x-kvtier-outcome": "none"}) as c:
        ids, reuse = complete_turn(c, "m", "cid", "rid-1", [1, 2, 3], 2)
    assert ids == [7, 8] and reuse == ReuseReport(ReusePath.P2P, 96, Outcome.NONE)


def test_complete_without_the_headers_is_a_clear_error() -> None:
    with _router({}) as c, pytest.raises(ReuseHeaderError, match="no x-kvtier-reuse header"):
        complete_turn(c, "m", "cid", "rid-1", [1, 2, 3], 2)


def test_leg_tap_records_roles_timing_and_the_decode_params() -> None:
    def engine(request: httpx.Request) -> httpx.Response:
        kvp = json.loads(request.content).get("kv_transfer_params")
        out: dict = {"choices": [{"text": "x"}]}
        if kvp is not None and not kvp.get("do_remote_decode"):
            out["kv_transfer_params"] = {"remote_block_ids": [1], "remote_num_tokens": 40}
        else:
            out["usage"] = {"prompt_tokens_details": {"cached_tokens": 64}}
        return httpx.Response(200, json=out)

    tap = LegTap({"http://p:1": ("prefill-0", "prefill"), "http://d:2": ("decode-0", "decode")})
    tap.inner = httpx.MockTransport(engine)  # type: ignore[assignment]

    async def turn() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=tap) as c:
            h = {"x-request-id": "r"}
            return [await c.post("http://p:1/v1/completions", headers=h,
                                 json={"kv_transfer_params": {"do_remote_decode": True}}),
                    await c.post("http://d:2/v1/completions", headers=h,
                                 json={"kv_transfer_params": {"remote_block_ids": [9]}}),
                    await c.post("http://d:2/v1/completions", json={}),  # untagged: not kept
                    await c.post("http://d:2/v1/completions", headers={"x-request-id": "s"},
                                 json={})]

    answers = asyncio.run(turn())
    assert [a.json()["choices"][0]["text"] for a in answers] == ["x"] * 4  # forwarded intact
    legs = tap.take("r")
    assert [(g.inst, g.role, g.ok) for g in legs] == [("prefill-0", "prefill", True),
                                                      ("decode-0", "decode", True)]
    assert legs[0].kv_out is None and legs[1].kv_out == {"remote_block_ids": [1],
                                                         "remote_num_tokens": 40}
    assert (legs[0].cached_tokens, legs[1].cached_tokens) == (64, None)
    assert all(g.t0 <= g.t1 for g in legs) and legs[0].t1 <= legs[1].t0
    assert [g.role for g in tap.take("s")] == ["direct"] and tap.take("r") == []


def test_the_in_process_indexer_is_served_and_stopped() -> None:
    """indexer_for serves the indexer from kvtier.runtime.ServerThread and stops it on exit
    (a stack with no instances: nothing to subscribe to, no engines needed)."""
    stack = SimpleNamespace(instances=[])
    with indexer_for(stack, "m", 32) as (svc, url):  # type: ignore[arg-type]
        assert httpx.get(f"{url}/healthz", timeout=5).json() == {"status": "ok", "pods": {}}
        assert svc.pod_details() == {}
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/healthz", timeout=5)


def _fake_stack(kv_config: dict) -> SimpleNamespace:
    def inst(name: str, role: str, http: int, side: int) -> SimpleNamespace:
        return SimpleNamespace(url=f"http://127.0.0.1:{http}", spec=SimpleNamespace(
            name=name, role=SimpleNamespace(value=role), side_channel_port=side))
    return SimpleNamespace(spec=SimpleNamespace(kv_transfer_config=kv_config),
                           instances=[inst("prefill-0", "prefill", 9000, 7000),
                                      inst("decode-0", "decode", 9001, 7010)])


def test_router_gets_the_decode_nodes_lease_endpoints_and_the_adaptive_policy() -> None:
    from kvtier.ab.strategies import builtin
    from kvtier.cost.model import CostModel, LinkModel
    from kvtier.router.config import RouterConfig

    cm = CostModel(kv_bytes_per_token=2048, prefill_b_s_per_token=2e-4,
                   reads={"dp_read": LinkModel(setup_s=0.01, bytes_per_s=4e9),
                          "p2p": LinkModel(setup_s=0.01, bytes_per_s=4e9)})
    spec = builtin("tiered-adaptive").with_cost_model(cm)
    insts = router_instances(_fake_stack(spec.kv_transfer_config()))
    assert insts == [
        {"name": "prefill-0", "url": "http://127.0.0.1:9000", "role": "prefill"},
        {"name": "decode-0", "url": "http://127.0.0.1:9001", "role": "decode",
         "lease": "tcp://127.0.0.1:8011"}]  # side channel 7010 + lease_port_offset 1001
    cfg = RouterConfig.model_validate({"instances": insts, **spec.router_settings()})
    assert cfg.retention == "adaptive" and cfg.host_copy and cfg.cost_model == cm
    assert [i.lease for i in cfg.decode_instances] == ["tcp://127.0.0.1:8011"]
    # strategies without leases: no endpoint, the node keeps vLLM's TTL
    plain = router_instances(_fake_stack(builtin("tiered").kv_transfer_config()))
    assert all("lease" not in i for i in plain)


def test_router_cost_reports_the_refits_and_the_model_in_use():
    import httpx
    from prometheus_client import generate_latest

    from kvtier.ab.live.runner import router_cost
    from kvtier.cost.model import CostModel, LinkModel
    from kvtier.ids import ReusePath
    from kvtier.router.costs import RouterCost
    from kvtier.router.metrics import RouterMetrics

    deployed = CostModel(kv_bytes_per_token=2048, prefill_a_s=0.5, prefill_b_s_per_token=1e-4,
                         reads={"dp_read": LinkModel(setup_s=0.01, bytes_per_s=4e9)})
    m = RouterMetrics()
    rc = RouterCost(deployed, m, refit=True, min_samples=4)
    for i in range(4):
        rc.prefill_leg(100 + 50 * i, ReusePath.NONE, 0, 0.02 + 0.001 * i)
    page = generate_latest(m.registry)
    http = httpx.Client(transport=httpx.MockTransport(lambda r: httpx.Response(200, content=page)))
    got = router_cost(http, "http://router", deployed.model_dump())
    assert got["refits"] == 1
    assert got["deployed_s"] == {"prefill_fixed": 0.5, "prefill_per_token": 1e-4,
                                 "dp_read_setup": 0.01}
    assert rc.model is not None and got["final_s"]["prefill_fixed"] == rc.model.prefill_a_s < 0.5
