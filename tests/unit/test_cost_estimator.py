"""The live per-path cost (kvtier.cost.estimator) and the pull-or-recompute plan made from it
(router/plan.py through RouterCost, as the router's prefill leg calls it)."""

from __future__ import annotations

import random

import pytest

from kvtier.cost.decide import Offer, decide
from kvtier.cost.estimator import BUCKETS, PATHS, PathEstimator, bucket_label, bucket_of
from kvtier.cost.model import CostModel, LinkModel
from kvtier.ids import Outcome, PodId, ReusePath
from kvtier.router.costs import RouterCost
from kvtier.router.metrics import RouterMetrics
from kvtier.router.plan import plan
from kvtier.router.store import ReuseDecision
from kvtier.transfer_params import NixlParams

PROMPT = 1500  # tokens; the previous turn left 1400 on the decode node


def _prior() -> CostModel:
    # the idle calibration: a device read saves most of a 1,500-token prefill
    return CostModel(kv_bytes_per_token=2048, prefill_a_s=0.01, prefill_b_s_per_token=1e-4,
                     block_size=32, reads={"dp_read": LinkModel(setup_s=0.002, bytes_per_s=4e9),
                                           "p2p": LinkModel(setup_s=0.004, bytes_per_s=4e9)})


def _dp_turn() -> tuple[NixlParams, ReuseDecision]:
    params = NixlParams(do_remote_prefill=True, remote_request_id="r1", remote_engine_id="d0",
                        remote_block_ids=[[1, 2]], remote_num_tokens=1400)
    return params, ReuseDecision(Outcome.FULL, params, 1400)


def _plan(rc: RouterCost) -> ReusePath:
    params, decision = _dp_turn()
    got = plan(params, decision, None, None, PodId("p0"), PROMPT, rc.decision_cost(),
               rc.explore)
    assert got.choice is not None  # the log line gets the expected costs
    return got.path


def test_buckets_are_log_spaced_and_cover_every_size():
    assert bucket_of(1) == bucket_of(511) == 0 and bucket_of(512) == 1
    assert bucket_of(1023) == 1 and bucket_of(1024) == 2
    assert bucket_of(10**9) == BUCKETS - 1
    assert bucket_label(0) == "0-511" and bucket_label(1) == "512-1023"
    assert bucket_label(BUCKETS - 1).endswith("+")


def test_an_empty_bucket_is_the_prior_and_samples_blend_in_by_count():
    e = PathEstimator(ring=8, prior_weight=4)
    assert e.estimate("none", PROMPT, 0.2).seconds == 0.2
    for _ in range(4):
        e.observe("none", PROMPT, 0.1)
    est = e.estimate("none", PROMPT, 0.2)
    assert est.samples == 4 and est.live_s == 0.1
    assert est.seconds == pytest.approx((4 * 0.2 + 4 * 0.1) / 8)
    # a stalled leg does not move the median
    e.observe("none", PROMPT, 30.0)
    assert e.estimate("none", PROMPT, 0.2).live_s == 0.1
    # other buckets and paths are untouched
    assert e.estimate("none", 100_000, 0.3).samples == 0
    assert e.estimate("dp_read", PROMPT, 0.05).samples == 0


def test_the_estimator_is_bounded_in_memory():
    e = PathEstimator(ring=16)
    rng = random.Random(1)

    def stored() -> int:
        return sum(e.live(p, b)[1] for p in PATHS for b in range(BUCKETS))

    for _ in range(10_000):
        e.observe(rng.choice(PATHS), int(2 ** rng.uniform(0, 21)), rng.uniform(0.01, 2.0))
    after_1e4 = stored()
    for _ in range(100_000):
        e.observe(rng.choice(PATHS), int(2 ** rng.uniform(0, 21)), rng.uniform(0.01, 2.0))
    assert e.seen == 110_000
    assert stored() == after_1e4 <= BUCKETS * len(PATHS) * 16
    assert all(e.live(p, b)[1] <= 16 for p in PATHS for b in range(BUCKETS))


def test_given_live_samples_where_reading_costs_more_than_recomputing_the_plan_recomputes():
    rc = RouterCost(_prior(), RouterMetrics(), learn=True, explore_share=0.0)
    # the calibration alone says read
    assert _plan(rc) is ReusePath.DP_READ
    # the router timed its legs: under this load a D->P read costs 160 ms, a recompute 90 ms
    for _ in range(32):
        rc.prefill_leg(PROMPT, ReusePath.DP_READ, 1400, 0.160)
        rc.prefill_leg(PROMPT, ReusePath.NONE, 0, 0.090)
    assert _plan(rc) is ReusePath.NONE
    # the same function the connector and simulator call, over the estimate, agrees
    cost = rc.decision_cost()
    assert decide(PROMPT, [Offer(ReusePath.DP_READ, 1400)], cost=cost).path is None
    # and the calibrated model alone still says read: the learning made the difference
    assert decide(PROMPT, [Offer(ReusePath.DP_READ, 1400)], cost=_prior()).path == "dp_read"
    labels = {"path": "dp_read", "bucket": bucket_label(bucket_of(PROMPT))}
    reg = rc.metrics.registry
    assert reg.get_sample_value("kvtier_router_cost_estimate_seconds", labels) == 0.160
    assert reg.get_sample_value("kvtier_router_cost_estimate_samples", labels) == 32


def test_a_regime_where_reading_loses_converges_to_recomputing():
    """Drive the plan turn after turn, each leg timed by a world where reading loses."""
    rc = RouterCost(_prior(), RouterMetrics(), learn=True, explore_share=0.05)
    world = {ReusePath.DP_READ: 0.160, ReusePath.NONE: 0.090}
    rng = random.Random(7)
    taken = []
    for _ in range(400):
        path = _plan(rc)
        taken.append(path)
        rc.prefill_leg(PROMPT, path, 1400 if path is ReusePath.DP_READ else 0,
                       world[path] * rng.uniform(0.9, 1.1))
    assert taken[0] is ReusePath.DP_READ  # it started from the calibration
    late = taken[200:]
    assert late.count(ReusePath.NONE) == len(late)  # dp_read is known wrong: never explored
    assert rc.estimator is not None and rc.estimator.explored <= 0.05 * rc.estimator.decided


def test_the_switch_to_recomputing_is_logged_once_with_its_estimates(caplog):
    """The router's prefill leg calls ``chose`` after each plan (router/prefill.py): the turn
    its choice for a context bucket flips from reading to recomputing is one ``path switch``
    line (the A/B report's "when it switched"), counted; explored turns are not switches."""
    rc = RouterCost(_prior(), RouterMetrics(), learn=True, explore_share=0.05)
    world = {ReusePath.DP_READ: 0.160, ReusePath.NONE: 0.090}
    params, decision = _dp_turn()
    caplog.set_level("INFO", logger="kvtier.router.costs")
    first_none = None
    for i in range(200):
        got = plan(params, decision, None, None, PodId("p0"), PROMPT, rc.decision_cost(),
                   rc.explore)
        assert got.choice is not None
        rc.chose(PROMPT, got.path, got.choice.expected_s, got.choice.explored)
        if got.path is ReusePath.NONE and not got.choice.explored and first_none is None:
            first_none = i
        rc.prefill_leg(PROMPT, got.path, 1400 if got.path is ReusePath.DP_READ else 0,
                       world[got.path])
    switches = [r for r in caplog.records if r.getMessage() == "path switch"]
    assert first_none is not None and len(switches) == 1, switches
    sw = switches[0]
    assert (sw.was, sw.now, sw.path) == ("reuse", "recompute", "none")
    assert sw.bucket == bucket_label(bucket_of(PROMPT))
    assert sw.expected_ms["none"] < sw.expected_ms["dp_read"]
    assert sw.samples["dp_read"] > 0
    assert rc.metrics.registry.get_sample_value(
        "kvtier_router_cost_switches_total", {"bucket": sw.bucket, "to": "recompute"}) == 1


def test_the_exploration_share_is_respected_and_counted():
    rc = RouterCost(_prior(), RouterMetrics(), learn=True, explore_share=0.05)
    assert rc.estimator is not None
    rc.estimator.min_samples = 10**9  # every path stays young: always something to explore
    explored = 0
    for i in range(1, 1001):
        params, decision = _dp_turn()
        got = plan(params, decision, None, None, PodId("p0"), PROMPT, rc.decision_cost(),
                   rc.explore)
        assert got.choice is not None
        explored += got.choice.explored
        assert explored <= 0.05 * i
    assert explored == 50 == rc.estimator.explored
    assert rc.metrics.registry.get_sample_value("kvtier_router_cost_explored_total",
                                                {"path": "none"}) == 50


def test_exploration_never_takes_a_path_known_to_be_wrong():
    e = PathEstimator(min_samples=8, explore_share=1.0, margin=0.25)
    slow_p2p = {**_prior().reads, "p2p": LinkModel(setup_s=0.5, bytes_per_s=4e9)}
    cost = e.view(_prior().model_copy(update={"reads": slow_p2p}))
    for _ in range(16):
        e.observe("dp_read", PROMPT, 0.5)   # known: far worse than recomputing
        e.observe("none", PROMPT, 0.09)
    offers = [Offer(ReusePath.DP_READ, 1400), Offer(ReusePath.P2P, 1400)]
    d = decide(PROMPT, offers, cost=cost)
    assert d.path is None  # recompute is best
    # p2p is young (its prior is all that says it is slow): explored; dp_read never,
    # however large the budget
    got = e.explore(cost, PROMPT, offers, d)
    assert got is not None and got.path == "p2p"
    for _ in range(16):
        e.observe("p2p", PROMPT, 0.4)       # now p2p is known wrong too
    for _ in range(50):
        assert e.explore(cost, PROMPT, offers, d) is None


def test_a_stale_estimate_within_the_margin_is_explored_again():
    e = PathEstimator(min_samples=4, explore_share=1.0, margin=0.25, stale_after=10)
    cost = e.view(_prior())
    for _ in range(8):
        e.observe("dp_read", PROMPT, 0.15)  # a close second (within the margin)
    for _ in range(20):
        e.observe("none", PROMPT, 0.09)     # only recompute taken since: dp_read goes stale
    offers = [Offer(ReusePath.DP_READ, 1400)]
    d = decide(PROMPT, offers, cost=cost)
    assert d.path is None and d.expected_s is not None
    assert cost.ttft_s("dp_read", PROMPT, 1400) < 1.25 * d.expected_s
    got = e.explore(cost, PROMPT, offers, d)
    assert got is not None and got.path == "dp_read"
