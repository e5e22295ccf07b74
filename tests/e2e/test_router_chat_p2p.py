"""A chat client's second turn served from a peer host tier, chosen through the indexer's
``POST /v1/route``, on a real host-p2p stack (1P1D vLLM-CPU, unidirectional NixlConnector +
kvtier's host tier with peer fetch on both instances, an indexer on their tier events).

The client sends chat messages only (no token ids, no conversation id): the router tokenizes
the chat once through the engine, asks the indexer once, and hands the prefill the decode
node's host tier as the source (it holds turn 1's prompt *and answer*); the prefill's own
caches are cleared before turn 2, as for a turn landing on another prefill of a fleet. Witness: the prefill's own ``vllm:external_prefix_cache_hits_total``; the answer
equals a recompute of the same chat (a fresh ``cache_salt``).
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import httpx
import pytest

from kvtier.ab.live.stacks import indexer_for, stack_spec_for
from kvtier.ab.strategies import builtin
from kvtier.router.config import RouterConfig
from kvtier.router.server import RouterServer
from tests.e2e.pd import metric

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

HITS = "vllm:external_prefix_cache_hits_total"


def test_chat_turn_two_pulls_from_a_peer_host_tier(stack_pool, tiny_model):
    spec = builtin("host-p2p")
    stack = stack_pool.get(stack_spec_for(spec, tiny_model))
    name = Path(tiny_model).name
    block = stack.spec.block_size
    with indexer_for(stack, name, block) as (_, idx_url), httpx.Client(timeout=120) as http:
        cfg = RouterConfig.model_validate({
            "instances": [{"name": i.spec.name, "url": i.url, "role": i.spec.role.value}
                          for i in stack.instances],
            "indexer": idx_url, "indexer_model": name, "port": 0, "log_json": False,
            "block_size": block, **spec.router_settings()})
        with RouterServer(cfg) as r:
            salt = uuid.uuid4().hex
            system = {"role": "system", "content": "You are a careful agent. " * 40 + salt}
            msgs = [system, {"role": "user", "content": "List three caching strategies."}]
            kw = {"model": tiny_model, "max_tokens": 48, "ignore_eos": True, "temperature": 0}
            one = http.post(r.url + "/v1/chat/completions", json={"messages": msgs, **kw})
            assert one.status_code == 200, one.text
            answer = one.json()["choices"][0]["message"]["content"]
            msgs2 = [*msgs, {"role": "assistant", "content": answer},
                     {"role": "user", "content": "Now pick one and explain it."}]
            p = stack.prefill[0].url
            # Turn 2 lands on a prefill that holds nothing of it (in a fleet: another prefill,
            # or this one after eviction): its device cache and host tier are cleared, and the
            # indexer has heard so (the clear events go out at the engine's next step).
            http.post(p + "/reset_prefix_cache", params={"reset_external": "true"}
                      ).raise_for_status()  # the device cache and the connector's host tier
            http.post(p + "/v1/completions", json={"model": tiny_model, "prompt": [7, 8, 9],
                                                   "max_tokens": 1}).raise_for_status()
            toks = http.post(p + "/tokenize", json={"model": tiny_model,
                                                    "messages": msgs2}).json()["tokens"]

            def held() -> dict[str, int]:
                out: dict[str, int] = {}
                ans = http.post(idx_url + "/v1/lookup", json={"model": name,
                                                              "token_ids": toks}).json()
                for m in ans["matches"]:
                    out[m["pod"]] = max(out.get(m["pod"], 0), m["matched_tokens"])
                return out

            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                h = held()
                if h.get(stack.prefill[0].spec.name, 0) == 0 and \
                        h.get(stack.decode[0].spec.name, 0) > 0:
                    break
                time.sleep(0.2)
            else:
                pytest.fail(f"indexer never showed the cleared prefill: {held()}")
            hits0 = metric(http, p, HITS)
            two = http.post(r.url + "/v1/chat/completions", json={"messages": msgs2, **kw})
            assert two.status_code == 200, two.text
            reuse = two.headers["x-kvtier-reuse"]
            assert reuse.startswith("p2p; tokens="), reuse
            planned = int(reuse.split("tokens=")[1])
            hits = metric(http, p, HITS) - hits0
            assert hits >= planned > 0, (hits, planned)
            # the same chat recomputed on the prefill alone (a fresh cache_salt: no reuse)
            ref = http.post(p + "/v1/chat/completions",
                            json={"messages": msgs2, "cache_salt": uuid.uuid4().hex, **kw})
            assert two.json()["choices"][0]["message"]["content"] == \
                ref.json()["choices"][0]["message"]["content"]
