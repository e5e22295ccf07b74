"""The one pull-or-recompute decision (kvtier.cost.decide) and the connector's cost config
(kvtier.cost.config). The connector, the router and the simulator all call ``decide``; the tie
rule is tested here once."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier.cost.config import CostConfig, PathCost
from kvtier.cost.decide import Offer, decide
from kvtier.cost.model import CostModel, LinkModel

NIXL = PathCost(setup_s=0.05, bandwidth_bytes_per_s=4e9)
HOST = PathCost(setup_s=0.001, bandwidth_bytes_per_s=7e9)
FLAT = CostConfig(recompute_tokens_per_s=2000, paths=(NIXL, HOST), bytes_per_token=2048)
FIT = CostModel(kv_bytes_per_token=2048, prefill_a_s=0.01, prefill_b_s_per_token=5e-4,
                prefill_c_s_per_token_ctx=2e-7,
                reads={"dp_read": LinkModel(setup_s=0.05, bytes_per_s=4e9),
                       "p2p": LinkModel(setup_s=0.001, bytes_per_s=7e9)})


def _flat(offers: list[int], prompt: int, local: int = 0):
    cost, names = FLAT.resolved()
    return decide(prompt, [Offer(n, t) for n, t in zip(names, offers)], local_tokens=local,
                  cost=cost)


def test_no_offers_means_recompute():
    d = _flat([0, 0], 500)
    assert d.index is None and d.tokens == 0 and not d.reads
    assert d.expected_s == d.recompute_s == pytest.approx(0.25)


def test_cheap_local_shorter_prefix_beats_remote_longer_one():
    # NIXL offers 40 more tokens, but its setup (50 ms) costs more than recomputing 40
    # tokens (20 ms): the host tier wins although it is listed second.
    d = _flat([440, 400], 441)
    assert d.index == 1 and d.tokens == 400


def test_remote_wins_when_it_saves_enough_recompute():
    d = _flat([600, 400], 601)  # 200 extra tokens = 100 ms of recompute
    assert d.index == 0 and d.tokens == 600


def test_short_prompt_is_recomputed_rather_than_paying_setup():
    assert _flat([40, 0], 41).index is None  # 20 ms of recompute < 50 ms of setup


def test_the_tie_rule_recompute_first_then_the_offer_listed_first():
    # Every caller (CostAwareConnector, router, simulator) breaks ties this way.
    free = LinkModel(setup_s=0.0, bytes_per_s=1e30)
    cost = CostModel(kv_bytes_per_token=1, prefill_b_s_per_token=1e-3,
                     reads={"a": free, "b": free, "slow": LinkModel(setup_s=0.05, bytes_per_s=1e30)})
    # two paths exactly as cheap: the one listed first
    assert decide(101, [Offer("a", 100), Offer("b", 100)], cost=cost).path == "a"
    assert decide(101, [Offer("b", 100), Offer("a", 100)], cost=cost).path == "b"
    # a read exactly as costly as recomputing (50 ms setup = 50 tokens of compute): recompute
    # (either way the last token is computed: 51 ms)
    d = decide(51, [Offer("slow", 50)], cost=cost)
    assert d.path is None and d.recompute_s == pytest.approx(0.051)
    # without a cost model, thresholds admit, and the first admitted offer wins
    gates = {"a": 64, "b": 0}
    assert decide(101, [Offer("a", 32), Offer("b", 16)], thresholds=gates).path == "b"
    assert decide(101, [Offer("a", 64), Offer("b", 96)], thresholds=gates).path == "a"
    assert decide(101, [Offer("a", 32)], thresholds=gates).path is None


def test_reuse_is_capped_so_the_last_token_is_computed():
    cost = FIT
    d = decide(100, [Offer("dp_read", 5000)], cost=cost.model_copy(update={"prefill_a_s": 1.0}))
    assert d.tokens == 99
    assert decide(1, [Offer("dp_read", 5000)], cost=cost).path is None  # nothing to reuse
    assert decide(100, [Offer("p2p", 50)], local_tokens=99, cost=cost).path is None


def test_bad_input_is_refused():
    with pytest.raises(ValueError):
        decide(0, [], cost=FIT)
    with pytest.raises(ValueError):
        decide(10, [Offer("p2p", -1)], cost=FIT)
    with pytest.raises(ValueError, match="bytes_per_token"):
        FLAT.model_copy(update={"bytes_per_token": None}).resolved()
    with pytest.raises(ValueError, match="fitted"):
        CostConfig(paths=(NIXL,))  # neither form


@given(st.lists(st.integers(0, 10_000), min_size=2, max_size=2), st.integers(1, 10_000))
def test_choice_is_never_worse_than_any_alternative(offers, prompt):
    cost, names = FLAT.resolved()
    d = _flat(offers, prompt)
    alts = [cost.ttft_s(None, prompt, 0)] + [cost.ttft_s(n, prompt, t)
                                             for n, t in zip(names, offers) if t > 0]
    assert d.expected_s == pytest.approx(min(alts))
    assert d.expected_s <= d.recompute_s


# ---- the connector's config: the fitted form names the file `kvtier calibrate --out` wrote ---

def test_fitted_costs_are_the_cost_models_own():
    cfg = CostConfig(fitted=FIT, paths=("dp_read", "p2p")).with_bytes_per_token(2048)
    cost, names = cfg.resolved()
    d = decide(1601, [Offer(names[0], 600), Offer(names[1], 400)], local_tokens=1000, cost=cost)
    want = {0: FIT.read_s("dp_read", 600) + FIT.prefill_s(1, 1600),
            1: FIT.read_s("p2p", 400) + FIT.prefill_s(201, 1400)}
    assert d.index == min(want, key=lambda k: want[k])
    assert d.expected_s == pytest.approx(want[d.index])
    assert d.recompute_s == pytest.approx(FIT.prefill_s(601, 1000))


def test_fitted_attention_term_makes_a_long_context_read_win():
    # 60 tokens: cheaper to recompute than the 50 ms NIXL setup at no context, but with
    # 40k tokens cached before them the attention term makes recompute cost more.
    assert decide(61, [Offer("dp_read", 60)], cost=FIT).path is None
    assert decide(40_061, [Offer("dp_read", 60)], local_tokens=40_000, cost=FIT).path == "dp_read"


def test_fitted_form_loads_from_the_calibrate_file(tmp_path):
    f = tmp_path / "cost.json"
    f.write_text(FIT.model_dump_json())
    cfg = CostConfig.model_validate({"fitted": str(f), "paths": ["dp_read", "local"]})
    assert cfg.fitted == FIT
    cost, names = cfg.with_bytes_per_token(2048).resolved()
    d = decide(101, [Offer(n, 100) for n in names], cost=cost)
    assert d.index == 1  # local: free


def test_a_relative_fitted_name_is_found_in_configs():
    # The shipped CostAwareConnector config names the shipped calibration by file name.
    cfg = CostConfig.model_validate({"fitted": "cost-tiny.json", "paths": ["dp_read", "p2p"]})
    assert cfg.fitted is not None and cfg.fitted.kv_bytes_per_token > 0


def test_fitted_form_refuses_bad_config(tmp_path):
    with pytest.raises(ValueError, match="not in the fitted model"):
        CostConfig(fitted=FIT, paths=("dp_read", "host_local"))
    with pytest.raises(ValueError, match="name each child"):
        CostConfig(fitted=FIT, paths=(NIXL,))
    with pytest.raises(ValueError, match="cannot read"):
        CostConfig.model_validate({"fitted": str(tmp_path / "missing.json"), "paths": ["p2p"]})
    with pytest.raises(ValueError, match="not both"):
        CostConfig(fitted=FIT, recompute_tokens_per_s=10, paths=("p2p",))


def test_engine_bytes_per_token_wins_over_the_fit():
    cfg = CostConfig(fitted=FIT, paths=("dp_read",)).with_bytes_per_token(4096)
    cost, _ = cfg.resolved()
    assert cost.kv_bytes_per_token == 4096


def test_the_shipped_calibrated_connector_config_resolves():
    # configs/costaware-calibrated.json -> cost.fitted "cost-tiny.json" (kvtier calibrate's
    # output): the path the CostAwareConnector takes when vLLM starts with that config.
    from kvtier.configs import load_config_file

    raw = load_config_file("costaware-calibrated")["kv_connector_extra_config"]["cost"]
    cost, names = CostConfig.model_validate(raw).with_bytes_per_token(2048).resolved()
    assert names == ("dp_read", "p2p") and cost.prefill_b_s_per_token > 0
    assert any("joint fit" in n for n in cost.fit_notes)  # a fit, not a hand-written table
