"""Adaptive device TTL (kvtier.cost.retention): the choice, its oracle, and where it is used."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.ab.records import TurnRecord
from kvtier.ab.simulator import FleetSpec, simulate
from kvtier.ab.strategies import builtin
from kvtier.ab.traces import ConversationSpec, Trace, TurnSpec
from kvtier.cost.model import CostModel, LinkModel
from kvtier.cost.retention import (
    MAX_TTL_S,
    MIN_TTL_S,
    WaitSample,
    choose_device_ttl,
    fallback_s,
    observed_waits,
    recompute_s,
)
from kvtier.ids import ConversationId

BS = 32


def _cost(p2p_bw: float = 1e9, p2p_setup: float = 0.02) -> CostModel:
    return CostModel(kv_bytes_per_token=2048, prefill_a_s=0.01, prefill_b_s_per_token=2e-4,
                     prefill_c_s_per_token_ctx=2e-8, decode_s_per_token=0.002, block_size=BS,
                     reads={"dp_read": LinkModel(setup_s=0.004, bytes_per_s=4e9),
                            "p2p": LinkModel(setup_s=p2p_setup, bytes_per_s=p2p_bw)})


def _objective(cost, waits, t, host_copy, horizon):
    """The module docstring's J(T), written the slow way."""
    j = 0.0
    for w in waits:
        if w.wait_s <= t:
            j += max(0.0, fallback_s(cost, w.tokens, host_copy) - cost.read_s("dp_read", w.tokens))
        j -= recompute_s(cost, w.tokens) * min(w.wait_s, t) / horizon
    return j


def test_no_host_copy_short_waits_are_all_covered():
    waits = [WaitSample(w, 2000) for w in (1, 2, 3, 5, 8, 13)]
    c = choose_device_ttl(_cost(), waits, host_copy=False, horizon_s=600)
    assert c.covers_wait_s == 13 and c.covered == 1.0 and c.ttl_s == pytest.approx(13 * 1.2)


def test_host_copy_as_fast_as_device_read_keeps_the_minimum():
    same = _cost(p2p_bw=4e9, p2p_setup=0.004)
    waits = [WaitSample(w, 2000) for w in (1, 2, 3, 5, 8, 13)]
    c = choose_device_ttl(same, waits, host_copy=True)
    assert c.covers_wait_s == MIN_TTL_S and c.covered == pytest.approx(1 / 6)
    # a device read saves nothing over the host copy: holding only costs -> keep nothing
    assert not c.retain and "no device retention" in c.explanation
    # the same waits without a host copy: the device copy is worth holding
    kept = choose_device_ttl(same, waits, host_copy=False)
    assert kept.covers_wait_s > MIN_TTL_S and kept.retain


def test_long_tail_is_left_to_the_fallback():
    waits = [WaitSample(2.0, 2000)] * 9 + [WaitSample(1000.0, 2000)]
    c = choose_device_ttl(_cost(), waits, host_copy=False, horizon_s=60)
    assert c.covers_wait_s == 2.0 and c.covered == pytest.approx(0.9)


def test_no_waits_and_bad_input():
    assert choose_device_ttl(_cost(), [], host_copy=True).ttl_s == MAX_TTL_S
    with pytest.raises(ValueError):
        choose_device_ttl(_cost(), [WaitSample(1, 10)], host_copy=True, horizon_s=0)
    with pytest.raises(ValueError):
        choose_device_ttl(_cost(), [WaitSample(1, 10)], host_copy=True, min_ttl_s=5, max_ttl_s=2)
    no_dp = CostModel(kv_bytes_per_token=2048, reads={"p2p": LinkModel(setup_s=0, bytes_per_s=1e9)})
    with pytest.raises(ValueError, match="dp_read"):
        choose_device_ttl(no_dp, [WaitSample(1, 10)], host_copy=True)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 900), st.integers(0, 8000)), min_size=1, max_size=40),
       st.booleans(), st.floats(1, 1000), st.floats(1e8, 2e10))
def test_choice_maximizes_the_objective(pairs, host_copy, horizon, p2p_bw):
    cost = _cost(p2p_bw=p2p_bw)
    waits = [WaitSample(w, n) for w, n in pairs]
    c = choose_device_ttl(cost, waits, host_copy=host_copy, horizon_s=horizon)
    assert MIN_TTL_S <= c.covers_wait_s <= c.ttl_s <= MAX_TTL_S
    best = _objective(cost, waits, c.covers_wait_s, host_copy, horizon)
    assert math.isclose(c.expected_gain_s - c.expected_price_s, best, rel_tol=1e-6, abs_tol=1e-9)
    assert c.retain == (best > 0)
    grid = [MIN_TTL_S + k * (MAX_TTL_S - MIN_TTL_S) / 400 for k in range(401)]
    for t in grid + [w.wait_s for w in waits if MIN_TTL_S <= w.wait_s <= MAX_TTL_S]:
        assert _objective(cost, waits, t, host_copy, horizon) <= best + 1e-9


def _rec(conv, turn, t_start, e2e, prompt, resp, strategy="s"):
    return TurnRecord(strategy, conv, turn, prompt, 0, "none", prompt, e2e / 2, e2e, 0.0, t_start,
                      "", resp)


def test_observed_waits_from_records():
    recs = [_rec("a", 0, 0.0, 2.0, 100, 10), _rec("a", 1, 5.0, 1.0, 300, 10),
            _rec("b", 0, 1.0, 1.0, 50, 5), _rec("a", 2, 6.5, 1.0, 400, 10)]
    got = sorted((round(w.wait_s, 6), w.tokens) for w in observed_waits(recs, time_scale=0.5))
    assert got == [(1.0, 310), (6.0, 110)]  # (6.5-6)/0.5, (5-2)/0.5; b has no next turn
    with pytest.raises(ValueError):
        observed_waits(recs, time_scale=0)


def _fixed_ttl_adaptive():
    """tiered-adaptive as deployed before decode leases: configured once, TTL fixed at start."""
    return builtin("tiered-adaptive").model_copy(update={
        "leases": False, "kv_configs": ("nixl-bidirectional", "kvtier-peer"),
        "decode_ttl_s": 30.0})


def test_with_cost_model_sets_ttl_for_adaptive_only():
    waits = [WaitSample(w, 2000) for w in (1, 2, 3, 5, 8)]
    slow_host = _cost(p2p_bw=2e8, p2p_setup=0.2)  # a device read beats the host copy
    ad = _fixed_ttl_adaptive().with_cost_model(slow_host, waits)
    assert ad.device_retention and ad.dp_reuse
    assert ad.decode_ttl_s == pytest.approx(8 * 1.2)
    assert builtin("tiered").with_cost_model(slow_host, waits) == builtin("tiered")
    # no waits yet: thresholds only, the default TTL stays
    assert _fixed_ttl_adaptive().with_cost_model(slow_host).decode_ttl_s == 30.0
    # with decode leases the waits change nothing here: the router decides per turn
    leased = builtin("tiered-adaptive").with_cost_model(slow_host, waits)
    assert leased.decode_ttl_s == builtin("tiered-adaptive").decode_ttl_s
    assert leased.router_settings()["retention"] == "adaptive"


def test_with_cost_model_drops_retention_that_buys_nothing():
    # The host copy reads as fast as the device: no TTL pays for the blocks it holds, so the
    # adaptive strategy keeps nothing on the decode node (and hands the prefill no D->P params).
    same = _cost(p2p_bw=4e9, p2p_setup=0.004)
    waits = [WaitSample(w, 2000) for w in (3, 5)]
    leased = builtin("tiered-adaptive").with_cost_model(same, waits)
    assert leased.device_retention and leased.dp_reuse  # leases: the router releases per turn
    ad = _fixed_ttl_adaptive().with_cost_model(same, waits)
    assert not ad.device_retention and not ad.dp_reuse and ad.decode_ttl_s is None
    assert ad.host_tier and ad.peer_fetch
    nixl = ad.kv_transfer_config()["kv_connector_extra_config"]["connectors"][0]
    assert nixl["kv_connector_extra_config"]["bidirectional_kv_xfer"] is False
    assert "decode_kv_ttl_s" not in ad.router_settings()


def test_simulator_online_ttl_cuts_device_memory_with_a_host_copy():
    convs = [ConversationSpec(ConversationId(f"c{c}"), c * 0.5, 100 + c,
                              [TurnSpec(1000, 50, 0.0)] + [TurnSpec(300, 50, 12.0)] * 11)
             for c in range(4)]
    tr = Trace("waits", 4096, convs)
    fleet = FleetSpec(prefill=1, decode=1, device_blocks_per_decode=100_000,
                      host_bytes_per_pod=1 << 34, block_size=BS)
    cost = _cost(p2p_bw=4e9, p2p_setup=0.004)
    fixed = simulate(tr, builtin("tiered"), fleet, cost)
    online = simulate(tr, _fixed_ttl_adaptive(), fleet, cost)
    frozen = simulate(tr, _fixed_ttl_adaptive(), fleet, cost, online_ttl=False)
    hist = online.meta["device_ttl_history"]
    assert hist[0][1] == _fixed_ttl_adaptive().decode_ttl_s
    assert hist[-1][1] == 0.0  # the host copy reads as fast: nothing is kept on the device
    assert frozen.meta["device_ttl_history"] == [(0.0, _fixed_ttl_adaptive().decode_ttl_s)]
    assert online.device_block_seconds() < 0.5 * fixed.device_block_seconds()
    # the host copy still serves the turns the device no longer holds
    assert online.reuse_rate() >= 0.95 * fixed.reuse_rate()
    # with decode leases (tiered-adaptive as deployed) the router's policy decides per turn:
    # the host copy reads as fast as the device, so even before any wait is seen (the
    # "default" basis) holding cannot pay: every turn is released at once
    leased = simulate(tr, builtin("tiered-adaptive"), fleet, cost)
    for conv, c in leased.hold_choices().items():
        assert c["sequence"][0][2] == "default" and c["sequence"][0][1] == 0, conv
        assert c["held"] == 0 and c["released"] == 12, (conv, c["sequence"])
    # a slower host copy: each conversation's first turn is held by default, the later ones
    # (12 s waits, priced against that host read) released at once
    slower = simulate(tr, builtin("tiered-adaptive"), fleet, _cost(p2p_bw=1e9, p2p_setup=0.02))
    for conv, c in slower.hold_choices().items():
        assert c["sequence"][0][2] == "default" and c["sequence"][0][1] > 0, conv
        assert c["held"] == 1 and c["released"] == 11, (conv, c["sequence"])
    assert leased.device_block_seconds() < 0.5 * fixed.device_block_seconds()
    assert leased.reuse_rate() >= 0.95 * fixed.reuse_rate()
    assert simulate(tr, builtin("tiered-adaptive"), fleet, cost,
                    online_ttl=False).hold_choices() == {}  # frozen: vLLM's TTL only


def test_fallback_weighs_the_chance_that_the_host_copy_survives() -> None:
    cost = _cost()
    n = 2000
    host, rc = fallback_s(cost, n, True), fallback_s(cost, n, False)
    assert host < rc
    assert fallback_s(cost, n, 0.25) == pytest.approx(0.25 * host + 0.75 * rc)
    assert fallback_s(cost, n, 1.0) == host and fallback_s(cost, n, 0.0) == rc
    with pytest.raises(ValueError):
        fallback_s(cost, n, float("nan"))


def test_simulated_tiered_adaptive_holds_where_the_host_tier_evicts() -> None:
    """Same trace, same fast host read; only the host tier's size differs. With room for every
    conversation the leased policy releases each turn to the host copy; with a host tier that
    holds none of them it sees the copies gone and holds turns on the device instead, and
    reuses far more than host-p2p does there."""
    convs = [ConversationSpec(ConversationId(f"c{c}"), c * 0.5, 100 + c,
                              [TurnSpec(1000, 50, 0.0)] + [TurnSpec(300, 50, 3.0)] * 7)
             for c in range(4)]
    tr = Trace("waits", 4096, convs)
    cost = _cost(p2p_bw=4e9, p2p_setup=0.004)
    ample = FleetSpec(prefill=1, decode=1, device_blocks_per_decode=100_000,
                      host_bytes_per_pod=1 << 34, block_size=BS)
    scarce = ample.model_copy(update={"host_bytes_per_pod": 100_000})  # < one conversation
    roomy = simulate(tr, builtin("tiered-adaptive"), ample, cost)
    tight = simulate(tr, builtin("tiered-adaptive"), scarce, cost)
    host_only = simulate(tr, builtin("host-p2p"), scarce, cost)
    assert all(c["released"] >= 6 for c in roomy.hold_choices().values())
    assert all(c["held"] >= 6 for c in tight.hold_choices().values())
    assert host_only.reuse_rate() < 0.1 < 0.8 < tight.reuse_rate()
    # the strategy's own host size (kvtier ab --host-mib) overrides the fleet's
    sized = simulate(tr, builtin("host-p2p").with_host_bytes(100_000), ample, cost)
    assert sized.reuse_rate() == host_only.reuse_rate()
