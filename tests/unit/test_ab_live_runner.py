"""The live runner's bookkeeping without servers (kvtier.ab.live.measure, .stacks, .runner,
.services): device ledger, per-turn records (reuse from the router's headers, timing and
retention from the legs), the legs from the router's served line, transfer split, the router's
and the indexer's configs, the router's stalls."""

from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import pytest

from kvtier.ab.live.measure import (
    DeviceLedger,
    Leg,
    complete_turn,
    logged_legs,
    split_transfer,
    turn_record,
)
from kvtier.ab.live.probes import ServedTurn
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
    return Leg("prefill-0", "prefill", 1.0, t1, True)


def _dec(retained: int | None) -> Leg:
    return Leg("decode-0", "decode", 1.25, 2.0, True, retained_tokens=retained)


def test_record_takes_reuse_from_the_router_and_timing_from_the_legs() -> None:
    L = DeviceLedger(32, 100.0)
    L.retained("cid", 300, now=0.0)
    reuse = ReuseReport(ReusePath.DP_READ, 288, Outcome.TRIMMED)
    dec = _dec(415)  # D's answer: remote blocks, remote_num_tokens 415
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
    pre = Leg("prefill-0", "prefill", 1.0, 1.25, True, cached_tokens=96)
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
    direct = Leg("decode-0", "direct", 0.0, 2.0, True)
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


def test_legs_from_the_routers_served_line() -> None:
    """The router's line places its prefill leg on the client's clock by the answer's arrival
    (ms - prefill_ms before it), keeps the engine's cached tokens and what D retained."""
    st = ServedTurn(prefill="prefill-0", decode="decode-0", ms=800.0, prefill_ms=250.0,
                    cached_tokens=64, retained_tokens=40)
    legs = logged_legs(st, 10.0, 11.0)
    assert [(g.inst, g.role, g.ok) for g in legs] == [("prefill-0", "prefill", True),
                                                      ("decode-0", "decode", True)]
    assert legs[0].t1 == pytest.approx(11.0 - 0.55)  # the decode and the router's tail after
    assert (legs[0].cached_tokens, legs[1].cached_tokens) == (64, None)
    assert (legs[0].retained_tokens, legs[1].retained_tokens) == (None, 40)
    assert all(g.t0 <= g.t1 for g in legs)
    L = DeviceLedger(32, 100.0)
    r = turn_record("device-ttl", "c0", 1, 0.0, 10.0, 11.0, legs, 400, [1],
                    ReuseReport(ReusePath.DP_READ, 288, Outcome.FULL), "", L, "cid")
    assert r.ttft_s == pytest.approx(0.45) and r.reused_tokens == 64
    assert L.blocks(0.0) == 2  # 40 tokens kept on D
    # served on one instance: no prefill leg, ttft = e2e; a tail longer than the turn (clocks
    # of two processes) never puts the prefill before the send
    direct = logged_legs(ServedTurn(decode="decode-0", ms=5.0), 0.0, 1.0)
    assert [g.role for g in direct] == ["direct"]
    early = logged_legs(ServedTurn(prefill="p", decode="d", ms=3000.0, prefill_ms=1.0), 5.0, 6.0)
    assert early[0].t1 == 5.0
    assert logged_legs(ServedTurn(), 0.0, 1.0) == []  # no line: no legs


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


def _stack_with_tiers() -> SimpleNamespace:
    def inst(name: str, base: int) -> SimpleNamespace:
        return SimpleNamespace(spec=SimpleNamespace(
            name=name, tier_events_port=base, tier_replay_port=base + 1, tier_p2p_port=base + 2))
    return SimpleNamespace(instances=[inst("prefill-0", 7100), inst("decode-0", 7200)])


def test_the_configs_a_run_gives_its_router_and_indexer_processes() -> None:
    from kvtier.ab.live.services import indexer_config, router_config
    from kvtier.ab.strategies import builtin
    from kvtier.indexer.config import IndexerConfig
    from kvtier.router.config import RouterConfig

    icfg = IndexerConfig.model_validate(indexer_config(_stack_with_tiers(), "tiny", 32, 9301))
    assert icfg.port == 9301 and icfg.default_model == "tiny" and icfg.block_size == 32
    assert [(p.name, p.events, p.replay, p.p2p) for p in icfg.pods] == [
        ("prefill-0", "tcp://127.0.0.1:7100", "tcp://127.0.0.1:7101", "127.0.0.1:7102"),
        ("decode-0", "tcp://127.0.0.1:7200", "tcp://127.0.0.1:7201", "127.0.0.1:7202")]
    spec = builtin("device-ttl")
    insts = router_instances(_fake_stack(spec.kv_transfer_config()))
    raw = router_config(insts, "http://127.0.0.1:9301", "tiny", 32, 90.0, 9300,
                        spec.router_settings())
    cfg = RouterConfig.model_validate(json.loads(json.dumps(raw)))  # as the file says it
    assert (cfg.port, cfg.indexer, cfg.indexer_model) == (9300, "http://127.0.0.1:9301", "tiny")
    # JSON lines with the served line per turn: what the runner reads back
    assert cfg.log_json and cfg.log_requests and cfg.stream_capture == "buffered"
    assert cfg.timeouts.prefill_s == cfg.timeouts.decode_idle_s == 90.0
    assert cfg.decode_kv_ttl_s == spec.router_settings()["decode_kv_ttl_s"]
    none = RouterConfig.model_validate(router_config(insts, None, "tiny", 32, 90.0, 9300, {}))
    assert none.indexer is None and none.indexer_model is None


def test_a_service_is_its_own_process_stopped_on_exit(tmp_path) -> None:
    """start_service runs `kvtier indexer --config FILE` as a child process (its config and
    log in the run's directory), yields it once it answers, and stops it on exit."""
    import os

    from kvtier.ab.live.services import answers_healthz, free_port, start_service

    port = free_port()
    cfg = {"host": "127.0.0.1", "port": port, "pods": []}
    with start_service("indexer", cfg, tmp_path, answers_healthz) as svc:
        assert svc.proc.pid != os.getpid() and svc.proc.poll() is None
        assert svc.url == f"http://127.0.0.1:{port}"
        assert httpx.get(f"{svc.url}/healthz", timeout=5).json()["status"] == "ok"
        d = svc.describe()
        assert d["pid"] == svc.proc.pid and d["command"].endswith(
            f"indexer --config {tmp_path / 'indexer.json'}")
        assert json.loads((tmp_path / "indexer.json").read_text()) == cfg
    assert svc.proc.returncode is not None
    assert (tmp_path / "indexer.log").exists()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{svc.url}/healthz", timeout=5)
    # a repeat in the same directory keeps the first run's config and log
    with start_service("indexer", {**cfg, "port": free_port()}, tmp_path,
                       answers_healthz) as again:
        assert again.config == tmp_path / "indexer-2.json"
        assert again.log == tmp_path / "indexer-2.log"


def test_a_service_that_exits_is_an_error_with_its_log(tmp_path) -> None:
    from kvtier.ab.live.services import ServiceError, answers_healthz, start_service

    bad = {"host": "127.0.0.1", "port": 1, "pods": [], "no_such_key": 1}
    with pytest.raises(ServiceError, match="bad configuration"), \
            start_service("indexer", bad, tmp_path, answers_healthz):
        pass


def test_router_stalls_from_its_metrics_and_log() -> None:
    from kvtier.ab.live.services import router_stalls

    page = ("# TYPE kvtier_router_event_loop_stall_seconds histogram\n"
            'kvtier_router_event_loop_stall_seconds_bucket{le="1.0"} 0.0\n'
            'kvtier_router_event_loop_stall_seconds_bucket{le="2.5"} 2.0\n'
            'kvtier_router_event_loop_stall_seconds_bucket{le="+Inf"} 2.0\n'
            "kvtier_router_event_loop_stall_seconds_count 2.0\n"
            "kvtier_router_event_loop_stall_seconds_sum 3.5\n")
    got = router_stalls(page, ["stood still for 1.25 s", "stood still for 2.25 s"], 2.25)
    assert got == {"count": 2, "total_s": 3.5, "longest_s": 2.25,
                   "warnings": ["stood still for 1.25 s", "stood still for 2.25 s"]}
    assert router_stalls("", [], None)["count"] == 0  # no stall observed yet: none
    assert router_stalls(None, [], None)["count"] is None  # /metrics not readable


def test_a_service_that_outlives_sigkill_does_not_fail_the_run(caplog) -> None:
    """A host-scarce run lost device-ttl's five repeats because its router, its replay done,
    had not exited 10 s after SIGKILL (stuck in the kernel) and ``stop`` raised. Now it is
    logged and the run goes on."""
    import subprocess

    from kvtier.ab.live.services import stop

    class Stuck:
        pid, args = 4242, ("kvtier", "router", "--config", "r.json")
        signals: list[str] = []

        def poll(self) -> None:
            return None

        def terminate(self) -> None:
            self.signals.append("TERM")

        def kill(self) -> None:
            self.signals.append("KILL")

        def wait(self, timeout: float) -> int:
            raise subprocess.TimeoutExpired(self.args, timeout)

    p = Stuck()
    with caplog.at_level("ERROR", logger="kvtier.ab"):
        assert stop(p, stop_s=0.01) is False  # type: ignore[arg-type]
    assert p.signals == ["TERM", "KILL"]
    assert "has not exited" in caplog.text and "4242" in caplog.text
    done = subprocess.Popen(["true"])
    done.wait()
    assert stop(done) is True
