"""The cost-aware path decision (kvtier.cost.decide), pure arithmetic."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier.cost.decide import CostModel, PathCost, choose_path
from kvtier.cost.model import CostModel as FittedCost
from kvtier.cost.model import LinkModel

NIXL = PathCost(setup_s=0.05, bandwidth_bytes_per_s=4e9)
HOST = PathCost(setup_s=0.001, bandwidth_bytes_per_s=7e9)
MODEL = CostModel(recompute_tokens_per_s=2000, paths=(NIXL, HOST), bytes_per_token=2048)


def test_no_offers_means_recompute():
    c = choose_path([0, 0], 500, MODEL)
    assert c.path is None and c.tokens == 0 and c.expected_s == pytest.approx(0.25)


def test_cheap_local_shorter_prefix_beats_remote_longer_one():
    # NIXL offers 40 more tokens, but its setup (50 ms) costs more than
    # recomputing 40 tokens (20 ms): the host tier wins although it is second.
    c = choose_path([440, 400], 440, MODEL)
    assert c.path == 1 and c.tokens == 400


def test_remote_wins_when_it_saves_enough_recompute():
    c = choose_path([600, 400], 600, MODEL)  # 200 extra tokens = 100 ms of recompute
    assert c.path == 0 and c.tokens == 600


def test_short_prompt_is_recomputed_rather_than_paying_setup():
    c = choose_path([40, 0], 40, MODEL)
    assert c.path is None  # 20 ms of recompute < 50 ms of setup


def test_tie_goes_to_more_tokens_then_config_order():
    same = CostModel(recompute_tokens_per_s=100, paths=(HOST, HOST), bytes_per_token=1)
    assert choose_path([100, 100], 100, same).path == 0
    # Equal expected time (50 ms each way): the path loading more tokens wins.
    fast = PathCost(setup_s=0.05, bandwidth_bytes_per_s=1e30)
    free = PathCost(setup_s=0.0, bandwidth_bytes_per_s=1e30)
    tie = CostModel(recompute_tokens_per_s=1000, paths=(free, fast), bytes_per_token=1)
    c = choose_path([50, 100], 100, tie)
    assert c.expected_s == pytest.approx(0.05) and c.path == 1


def test_bad_input_is_refused():
    with pytest.raises(ValueError):
        choose_path([1], 10, MODEL)
    with pytest.raises(ValueError):
        choose_path([1, 2], 10, MODEL.model_copy(update={"bytes_per_token": None}))
    with pytest.raises(ValueError):
        choose_path([-1, 0], 10, MODEL)
    with pytest.raises(ValueError, match="fitted"):
        CostModel(paths=(NIXL,))  # neither form


@given(st.lists(st.integers(0, 10_000), min_size=2, max_size=2), st.integers(0, 10_000))
def test_choice_is_never_worse_than_any_alternative(offers, remaining):
    c = choose_path(offers, remaining, MODEL)
    alts = [remaining / MODEL.recompute_tokens_per_s]
    for t, p in zip(offers, MODEL.paths):
        if t > 0:
            alts.append(p.setup_s + t * 2048 / p.bandwidth_bytes_per_s
                        + max(0, remaining - t) / MODEL.recompute_tokens_per_s)
    assert c.expected_s == pytest.approx(min(alts))
    assert c.expected_s <= c.recompute_s


# ---- the fitted form: the cost model `kvtier calibrate --out` writes -------------------

FIT = FittedCost(kv_bytes_per_token=2048, prefill_a_s=0.01, prefill_b_s_per_token=5e-4,
                 prefill_c_s_per_token_ctx=2e-7,
                 reads={"dp_read": LinkModel(setup_s=0.05, bytes_per_s=4e9),
                        "p2p": LinkModel(setup_s=0.001, bytes_per_s=7e9)})


def test_fitted_costs_are_the_cost_models_own():
    m = CostModel(fitted=FIT, paths=("dp_read", "p2p")).with_bytes_per_token(2048)
    c = choose_path([600, 400], 600, m, cached=1000)
    want = {0: FIT.read_s("dp_read", 600) + FIT.prefill_s(0, 1600),
            1: FIT.read_s("p2p", 400) + FIT.prefill_s(200, 1400)}
    assert c.path == min(want, key=want.get)
    assert c.expected_s == pytest.approx(want[c.path])
    assert c.recompute_s == pytest.approx(FIT.prefill_s(600, 1000))


def test_fitted_attention_term_makes_a_long_context_read_win():
    # 60 tokens: cheaper to recompute than the 50 ms NIXL setup at no context, but with
    # 40k tokens cached before them the attention term makes recompute cost more.
    m = CostModel(fitted=FIT, paths=("dp_read", "p2p")).with_bytes_per_token(2048)
    assert choose_path([60, 0], 60, m, cached=0).path is None
    assert choose_path([60, 0], 60, m, cached=40_000).path == 0


def test_fitted_form_loads_from_the_calibrate_file(tmp_path):
    f = tmp_path / "cost.json"
    f.write_text(FIT.model_dump_json())
    m = CostModel.model_validate({"fitted": str(f), "paths": ["dp_read", "local"]})
    assert m.fitted == FIT
    assert choose_path([100, 100], 100, m.with_bytes_per_token(2048)).path == 1  # local: free


def test_fitted_form_refuses_bad_config(tmp_path):
    with pytest.raises(ValueError, match="not in the fitted model"):
        CostModel(fitted=FIT, paths=("dp_read", "host_local"))
    with pytest.raises(ValueError, match="name each child"):
        CostModel(fitted=FIT, paths=(NIXL,))
    with pytest.raises(ValueError, match="cannot read"):
        CostModel.model_validate({"fitted": str(tmp_path / "missing.json"), "paths": ["p2p"]})
    with pytest.raises(ValueError, match="not both"):
        CostModel(fitted=FIT, recompute_tokens_per_s=10, paths=("p2p",))


def test_engine_bytes_per_token_wins_over_the_fit():
    m = CostModel(fitted=FIT, paths=("dp_read",)).with_bytes_per_token(4096)
    cost, _ = m.resolved()
    assert cost.kv_bytes_per_token == 4096
