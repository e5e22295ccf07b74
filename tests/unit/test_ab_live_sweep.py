"""The live sweep's fault handling: a failing strategy is recorded and the rest still run
and report; Ctrl-C keeps what finished. The per-strategy runner is the simulator here (the
live runner is covered by tests/e2e/test_ab_strategies.py)."""

from __future__ import annotations

import pytest

from kvtier.ab.live.common import prior_cost_model
from kvtier.ab.live.sweep import run_sweep
from kvtier.ab.rawdoc import read_raw
from kvtier.ab.report import write_report
from kvtier.ab.simulator import FleetSpec, simulate
from kvtier.ab.strategies import parse_list
from kvtier.ab.traces import SyntheticTraceConfig, synthetic

KVBPT = 4096
COST = prior_cost_model(KVBPT)
TRACE = synthetic(SyntheticTraceConfig(conversations=2, turns=3, seed=3))


def runner(fail: dict[str, BaseException]):
    calls: list[str] = []

    def run_one(spec, trace):
        calls.append(spec.name)
        if spec.name in fail:
            raise fail[spec.name]
        return simulate(trace, spec, FleetSpec(prefill=1, decode=1), COST, online_ttl=False)

    return run_one, calls


def sweep(names: str, run_one, cost=COST):
    return run_sweep(parse_list(names), TRACE, run_one, cost=cost, kvbpt=KVBPT,
                     block_size=32, time_scale=1.0)


def test_a_failing_strategy_is_recorded_and_the_rest_still_run(tmp_path):
    run_one, calls = runner({"device-ttl": RuntimeError("decode-0 exited during start")})
    sw = sweep("recompute,device-ttl,host-p2p,tiered-adaptive", run_one)
    assert calls == ["recompute", "device-ttl", "host-p2p", "tiered-adaptive"]
    assert [r.strategy for r in sw.results] == ["recompute", "host-p2p", "tiered-adaptive"]
    assert [s.name for s in sw.ran] == ["recompute", "host-p2p", "tiered-adaptive"]
    assert sw.failed == {"device-ttl": "RuntimeError: decode-0 exited during start"}
    assert not sw.interrupted
    assert "tiered-adaptive" in sw.adaptive  # configured from the cost model, waits observed
    md = write_report(sw.results, tmp_path, {"trace": "t", "failed_strategies": sw.failed},
                      plots=False).read_text()
    assert "Incomplete run" in md and "decode-0 exited during start" in md
    doc = read_raw(tmp_path)
    assert doc["meta"]["failed_strategies"] == sw.failed


def test_interrupt_stops_the_sweep_and_keeps_what_finished():
    run_one, calls = runner({"host-p2p": KeyboardInterrupt()})
    sw = sweep("recompute,device-ttl,host-p2p,tiered", run_one)
    assert calls == ["recompute", "device-ttl", "host-p2p"]  # tiered never started
    assert [r.strategy for r in sw.results] == ["recompute", "device-ttl"]
    assert sw.interrupted and sw.failed == {"host-p2p": "interrupted"}


def test_adaptive_without_a_cost_model_is_fitted_from_the_runs_before_it():
    run_one, _ = runner({})
    sw = sweep("recompute,device-ttl,host-p2p,tiered-adaptive", run_one, cost=None)
    info = sw.adaptive["tiered-adaptive"]
    adaptive = sw.ran[-1]
    assert info["kv_recompute_threshold"] == adaptive.kv_recompute_threshold
    assert info["decode_ttl_s"] == adaptive.decode_ttl_s


def test_adaptive_with_leases_hands_the_cost_model_to_its_router():
    run_one, _ = runner({})
    sw = sweep("device-ttl,tiered-adaptive", run_one)
    adaptive = sw.ran[-1]
    info = sw.adaptive["tiered-adaptive"]
    # waits were observed, but with leases they do not fix a TTL: the router decides per turn
    assert adaptive.leases and adaptive.device_retention and adaptive.decode_ttl_s == 480
    assert adaptive.cost_model == COST and adaptive.router_settings()["retention"] == "adaptive"
    assert info["leases"] and info["retention"] == "adaptive" and info["host_copy"]
    assert "chosen online by the router" in info["ttl_choice"]


def test_adaptive_first_with_nothing_measured_runs_unconfigured():
    run_one, calls = runner({})
    sw = sweep("tiered-adaptive", run_one, cost=None)
    assert calls == ["tiered-adaptive"] and sw.adaptive == {} and len(sw.results) == 1


def test_repeats_interleave_and_merge():
    run_one, calls = runner({})
    sw = run_sweep(parse_list("recompute,device-ttl,tiered-adaptive"), TRACE, run_one, cost=COST,
                   kvbpt=KVBPT, block_size=32, time_scale=1.0, repeats=3)
    assert calls == ["recompute", "device-ttl", "tiered-adaptive",   # A B C
                     "device-ttl", "tiered-adaptive", "recompute",   # B C A
                     "tiered-adaptive", "recompute", "device-ttl"]   # C A B
    assert [r.strategy for r in sw.results] == ["recompute", "device-ttl", "tiered-adaptive"]
    one = simulate(TRACE, parse_list("device-ttl")[0], FleetSpec(prefill=1, decode=1), COST,
                   online_ttl=False)
    dev = sw.results[1]
    assert dev.meta["repeats"] == 3 and len(dev.turns) == 3 * len(one.turns)
    assert len({t.conversation_id for t in dev.turns}) == 3 * len(TRACE.conversations)
    # identical repeats: the per-run integral is one run's, not three runs' worth
    assert dev.device_block_seconds() == pytest.approx(one.device_block_seconds())
    assert [p["device_block_s"] for p in dev.meta["per_repeat"]] == \
        pytest.approx([one.device_block_seconds()] * 3)
    # the adaptive strategy was configured once and kept its configuration
    assert len(sw.ran) == 3 and sw.ran[2].adaptive


def test_a_strategy_failing_in_a_later_repeat_is_dropped():
    n = {"k": 0}

    def run_one(spec, trace):
        if spec.name == "device-ttl":
            n["k"] += 1
            if n["k"] == 2:
                raise RuntimeError("boom")
        return simulate(trace, spec, FleetSpec(prefill=1, decode=1), COST, online_ttl=False)

    sw = run_sweep(parse_list("recompute,device-ttl"), TRACE, run_one, cost=COST, kvbpt=KVBPT,
                   block_size=32, time_scale=1.0, repeats=3)
    assert [r.strategy for r in sw.results] == ["recompute"]
    assert sw.failed == {"device-ttl": "RuntimeError: boom"} and n["k"] == 2


def test_interrupt_in_a_later_repeat_keeps_ran_and_results_in_step():
    calls: list[str] = []

    def run_one(spec, trace):
        calls.append(spec.name)
        if len(calls) == 3:  # repeat 2 runs device-ttl first (rotated), then recompute
            raise KeyboardInterrupt
        return simulate(trace, spec, FleetSpec(prefill=1, decode=1), COST, online_ttl=False)

    sw = run_sweep(parse_list("recompute,device-ttl"), TRACE, run_one, cost=COST, kvbpt=KVBPT,
                   block_size=32, time_scale=1.0, repeats=2)
    assert calls == ["recompute", "device-ttl", "device-ttl"]
    # the round both completed is reported, the unfinished second left out for both alike
    assert sw.interrupted and sw.repeats_done == 1 and sw.failed == {}
    assert [r.strategy for r in sw.results] == [s.name for s in sw.ran] == \
        ["recompute", "device-ttl"]


def test_interrupt_before_every_strategy_ran_once_reports_none_partially():
    calls: list[str] = []

    def run_one(spec, trace):
        calls.append(spec.name)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return simulate(trace, spec, FleetSpec(prefill=1, decode=1), COST, online_ttl=False)

    sw = run_sweep(parse_list("recompute,device-ttl"), TRACE, run_one, cost=COST, kvbpt=KVBPT,
                   block_size=32, time_scale=1.0, repeats=2)
    assert sw.interrupted and sw.repeats_done == 0
    assert [r.strategy for r in sw.results] == ["recompute"]
    assert sw.failed == {"device-ttl": "interrupted"}
