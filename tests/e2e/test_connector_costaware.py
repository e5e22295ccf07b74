"""E2E: CostAwareConnector(NixlConnector bidirectional, KVTierConnector) on real vLLM-CPU.

Turn 2 of a conversation can be served two ways on the prefill instance P:
NixlConnector reads turn 1's prompt + generated tokens back from the decode
instance D (first child, remote, 50 ms setup in the config's cost table), or
KVTierConnector loads turn 1's prompt from P's own host tier (second child,
local, 1 ms setup) and the rest is recomputed. MultiConnector always takes
the first child. The cost-aware connector takes

- the host tier when turn 1 generated few tokens (the extra tokens NIXL
  offers are cheaper to recompute than its setup), and
- NIXL when turn 1 generated many tokens,

which the cache-hit-source metrics show; greedy outputs equal the reference
in both cases. Expected costs come from ``configs/costaware-nixl-kvtier.json``
(the decision function itself is unit-tested in tests/unit/test_cost_decide.py).
"""

from __future__ import annotations

import httpx
import pytest

from kvtier.configs import load_config_file
from kvtier.cost.config import CostConfig
from kvtier.cost.decide import Offer, decide
from kvtier.devstack.spec import StackSpec
from kvtier.transfer_params import KVTransferParams
from tests.e2e.pd import reset_prefix_cache
from tests.e2e.test_multi_connector import BS, _by_source, _pd, _ref, _turn1

pytestmark = pytest.mark.e2e
CFG = "costaware-nixl-kvtier"


@pytest.fixture(scope="module")
def costaware(stack_pool, tiny_model):
    # vLLM judges HMA support by connector class; see connectors/cost_connector.py.
    return stack_pool.get(StackSpec(model=tiny_model, prefill=1, decode=1,
                                    kv_transfer_config=load_config_file(CFG),
                                    extra_args=("--disable-hybrid-kv-cache-manager",)))


def _expected_child(config: str, nixl_offer: int, host_offer: int, prompt: int) -> int | None:
    """What kvtier.cost.decide picks over ``config``'s cost table (the connector's own call)."""
    raw = load_config_file(config)["kv_connector_extra_config"]["cost"]
    # tiny model: 4 layers x K,V x 2 KV heads x 64 dims x fp16 = 2048 B/token
    cost, names = CostConfig.model_validate(raw).with_bytes_per_token(2048).resolved()
    return decide(prompt, [Offer(names[0], nixl_offer), Offer(names[1], host_offer)],
                  cost=cost).index


def _turn2_by_cost(stack, config: str, seed: int, n_gen: int) -> tuple[int | None, dict, dict]:
    """Turn 1, then turn 2 handed D's params: (the child decide expected, the tokens the
    prefill loaded per source, what that expectation means in tokens per source)."""
    P, D = stack.prefill[0].url, stack.decode[0].url
    with httpx.Client(timeout=180) as c:
        prompt, dec1, turn2 = _turn1(c, P, D, seed=seed, n_prompt_blocks=12, n_gen=n_gen)
        retained = KVTransferParams.from_wire(dec1["kv_transfer_params"])
        assert retained is not None and retained.nixl is not None
        nixl_offer = retained.nixl.remote_num_tokens
        host_offer = len(prompt) // BS * BS  # P stored turn 1's full prompt blocks
        expected = _expected_child(config, nixl_offer, host_offer, len(turn2))
        ref2 = _ref(c, P, turn2, 16)
        reset_prefix_cache(c, P)
        p0 = _by_source(c, P)
        _, dec2 = _pd(c, P, D, turn2, 16, KVTransferParams.prefill_request(reuse=retained.nixl))
        p1 = _by_source(c, P)
        assert dec2["choices"][0]["token_ids"] == ref2
    got = {s: p1[s] - p0[s] for s in p0}
    want = {"p2p": nixl_offer if expected == 0 else 0, "host": host_offer if expected == 1 else 0}
    return expected, got, want


@pytest.mark.parametrize("n_gen,winner", [(8, "host"), (200, "p2p")])
def test_turn2_path_chosen_by_expected_cost(costaware, n_gen, winner):
    expected, got, want = _turn2_by_cost(costaware, CFG, 100 + n_gen, n_gen)
    assert expected == {"p2p": 0, "host": 1}[winner]  # the scenario is what it claims
    assert got == want


CALIBRATED = "costaware-calibrated"  # cost.fitted names configs/cost-tiny.json (kvtier calibrate)


@pytest.fixture(scope="module")
def calibrated(stack_pool, tiny_model):
    return stack_pool.get(StackSpec(model=tiny_model, prefill=1, decode=1,
                                    kv_transfer_config=load_config_file(CALIBRATED),
                                    extra_args=("--disable-hybrid-kv-cache-manager",)))


def test_calibrated_cost_model_file_drives_the_choice(calibrated):
    """The shipped config naming a `kvtier calibrate` output starts, and the engine loads what
    kvtier.cost.decide says over that fitted model (whichever path that is)."""
    expected, got, want = _turn2_by_cost(calibrated, CALIBRATED, 300, 64)
    assert got == want, f"decide chose child {expected}"
