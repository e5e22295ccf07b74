"""The simulator decides as the live router does (issue 30, item 2): one path choice
(``kvtier.cost.learned.choose_path``), one learner (``LearnedCost``), configured from the same
router settings, fed the same legs -- so ``kvtier ab --simulate`` and a live run decide alike."""

from __future__ import annotations

import dataclasses
import random

from kvtier.ab.sim_policy import Decisions, SimPolicy
from kvtier.ab.simulator import simulate
from kvtier.ab.strategies import StrategySpec, builtin
from kvtier.cost import learned
from kvtier.cost.decide import Offer
from kvtier.cost.hold import pressure_factor
from kvtier.cost.learned import LearnedCost, LearnSettings
from kvtier.cost.model import LinkModel
from kvtier.ids import ConversationId, ReusePath
from kvtier.router import plan as router_plan
from kvtier.router.config import RouterConfig
from kvtier.router.flow import Router
from tests.unit.test_ab_simulator import FLEET, _cost, _trace

# a world where a D->P read costs 3 s of setup: more than recomputing any prompt here
SLOW_READS = _cost(reads={"dp_read": LinkModel(setup_s=3.0, bytes_per_s=4e9),
                          "p2p": LinkModel(setup_s=0.02, bytes_per_s=1e9)})


def _live_router(settings: dict) -> Router:
    """A router configured as the strategy's live stack configures it (not serving)."""
    cfg = RouterConfig.model_validate({
        "instances": [{"name": "p", "url": "http://127.0.0.1:1", "role": "prefill"},
                      {"name": "d", "url": "http://127.0.0.1:2", "role": "decode",
                       "lease": "tcp://127.0.0.1:3"}],
        **settings})
    return Router(cfg)


def test_the_router_and_the_simulator_choose_with_one_function() -> None:
    assert router_plan.choose_path is learned.choose_path
    spec = builtin("tiered-adaptive").with_cost_model(_cost()).with_cost_refit()
    r = _live_router(spec.router_settings())
    assert isinstance(r.cost.learned, LearnedCost)
    d = Decisions(SimPolicy.of(spec), spec.cost_model)  # type: ignore[arg-type]
    assert isinstance(d.learned, LearnedCost)
    # both learn exactly as the strategy's router settings say
    assert d.learned.settings == r.cost.learned.settings
    assert d.learned.settings.learn and d.learned.settings.refit


def test_fed_the_same_legs_the_simulator_and_the_live_router_decide_alike() -> None:
    """300 turns of random prompts and offers; every leg timed by a world where device reads
    lose. The router's RouterCost (metrics and all) and the simulator's Decisions make the
    same choice at every turn (explorations included), and refit to the same model."""
    spec = builtin("tiered-adaptive").with_cost_model(_cost()).with_cost_refit()
    router = _live_router(spec.router_settings()).cost
    sim = Decisions(SimPolicy.of(spec), spec.cost_model)  # type: ignore[arg-type]
    rng = random.Random(7)
    paths = []
    explored = 0
    for _ in range(300):
        prompt = rng.randrange(300, 6000)
        offers = [Offer(ReusePath.DP_READ, rng.randrange(0, prompt, 32)),
                  Offer(ReusePath.P2P, rng.randrange(0, prompt, 32))]
        live, was_explored = learned.choose_path(prompt, offers, router.decision_cost(),
                                                 router.explore)
        path, tokens = sim.choose(prompt, 0, offers)
        assert (path, tokens) == (live.path, live.tokens)
        explored += was_explored
        taken = ReusePath(path) if path else ReusePath.NONE
        seconds = SLOW_READS.ttft_s(path, prompt, tokens) * rng.uniform(0.9, 1.1)
        router.prefill_leg(prompt, taken, tokens, seconds)
        sim.observe_leg(prompt, taken, tokens, seconds)
        paths.append(path)
    assert router.model == sim.cost and router.online is not None and router.online.refits > 0
    assert 0 < explored <= 0.05 * 300 + 1
    # not a trivial agreement: it read at first, and learnt to stop reading from the device
    assert ReusePath.DP_READ in paths[:20]
    assert paths[-100:].count(ReusePath.DP_READ) <= 5


def test_simulated_tiered_adaptive_learns_to_recompute_where_reads_lose() -> None:
    """Deployed with a model in which a D->P read is cheap, in a world where it costs 3 s:
    the simulated router, learning each path's cost as the live one does (cost_learn, on in
    tiered-adaptive), stops reading; with cost_learn off it reads every follow-up."""
    tr = _trace(wait=3.0, n_conv=4, turns=16)
    spec = builtin("tiered-adaptive").without_host_copy().with_cost_model(_cost())
    learning = simulate(tr, spec, FLEET, SLOW_READS)
    blind = simulate(tr, spec.model_copy(update={"cost_learn": False}), FLEET, SLOW_READS)
    dp = [sum(1 for t in r.follow_ups if t.reuse_path == ReusePath.DP_READ)
          for r in (learning, blind)]
    assert dp[1] == len(blind.follow_ups)
    # Each context bucket starts at the prior: the 4 conversations enter a bucket together
    # and read before any of them is timed; after that only an exploration reads.
    assert dp[0] < dp[1] // 3
    meta = learning.meta["router_learning"]
    late = [t for t in learning.follow_ups if t.turn >= 10 and t.reuse_path == ReusePath.DP_READ]
    assert len(late) <= meta["explored"]
    assert sum(t.ttft_s for t in learning.turns) < sum(t.ttft_s for t in blind.turns)
    assert meta["legs_observed"] == len(learning.turns)
    assert meta["explored"] <= 0.05 * meta["decided"] + 1
    assert "router_learning" not in blind.meta


def test_simulated_holds_are_priced_by_the_decode_nodes_pressure() -> None:
    """As the router's hold_pressure: the same waits, a pressed decode node, a shorter hold."""
    spec = builtin("tiered-adaptive").without_host_copy().with_cost_model(_cost())
    policy = SimPolicy.of(spec)
    assert policy.hold_pressure  # tiered-adaptive's router prices holds by pressure
    d = Decisions(policy, spec.cost_model)  # type: ignore[arg-type]
    conv = ConversationId("c")
    for _ in range(4):
        d.observe_wait(conv, 0.0, 5.0, 2000)
    idle = d.hold_after(conv, 1, pressure_factor(0.0, 0.0))
    pressed = d.hold_after(conv, 2, pressure_factor(0.95, 8.0))
    assert idle > 0 and pressed < idle
    off = Decisions(dataclasses.replace(policy, hold_pressure=False),
                    spec.cost_model)  # type: ignore[arg-type]
    for _ in range(4):
        off.observe_wait(conv, 0.0, 5.0, 2000)
    assert off.hold_after(conv, 1, pressure_factor(0.95, 8.0)) == idle


def test_learn_settings_read_the_router_config_names_and_defaults() -> None:
    fields = RouterConfig.model_fields
    d = LearnSettings()
    assert d.window == fields["cost_refit_window"].default
    assert d.min_samples == fields["cost_refit_min_samples"].default
    assert d.ring == fields["cost_learn_ring"].default
    assert d.explore_share == fields["explore_share"].default
    assert d.explore_margin == fields["explore_margin"].default
    s = LearnSettings.of_router({"cost_learn": True, "explore_share": 0.1, "cost_learn_ring": 8})
    assert (s.learn, s.explore_share, s.ring, s.refit) == (True, 0.1, 8, False)


def test_a_run_stored_before_the_router_learned_replays_without_learning() -> None:
    """A live run's report keeps each strategy's spec; one stored before cost_learn and
    hold_pressure existed has neither key, and its re-simulation must not learn: its router
    did not."""
    spec = builtin("tiered-adaptive").with_cost_model(_cost())
    old = spec.model_dump()
    del old["cost_learn"], old["hold_pressure"]
    replay = StrategySpec.model_validate(old)
    settings = replay.router_settings()
    assert settings["cost_learn"] is False and settings["hold_pressure"] is False
    policy = SimPolicy.of(replay)
    assert not policy.learn.learn and not policy.hold_pressure
    assert SimPolicy.of(spec).learn.learn and SimPolicy.of(spec).hold_pressure
