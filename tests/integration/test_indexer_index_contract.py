"""One contract suite for every KVIndex backend: in-memory and Redis (real redis-server)."""

from __future__ import annotations

import random
import uuid

import pytest

from kvtier.hashing import RequestKeyHasher
from kvtier.ids import EngineBlockHash, ModelName, PodId, Tier
from kvtier.indexer.index import KVIndex, MemoryIndex, restore_entries

pytestmark = pytest.mark.integration

G, C = Tier.GPU, Tier.CPU


@pytest.fixture(params=["memory", "redis"])
def make_index(request):
    made = []

    def make(max_keys: int = 1_000_000) -> KVIndex:
        if request.param == "memory":
            idx = MemoryIndex(max_keys=max_keys)
        else:
            from kvtier.indexer.redis_index import RedisIndex

            url = request.getfixturevalue("redis_url")
            idx = RedisIndex.from_url(url, namespace=f"t-{uuid.uuid4().hex[:8]}",
                                      max_keys=max_keys)
        made.append(idx)
        return idx

    yield make
    for idx in made:
        idx.close()


H = RequestKeyHasher(ModelName("m"), 4)


def blocks(tokens, salt=0):
    """(engine hash, request key) per block; engine hashes made distinct per salt."""
    keys = H.keys(tokens)
    return [(EngineBlockHash(hash((salt, k)) & (2**64 - 1)), k) for k in keys]


def test_is_a_kvindex(make_index):
    assert isinstance(make_index(), KVIndex)


def test_empty_lookup(make_index):
    idx = make_index()
    assert idx.lookup([]) == {}
    assert idx.lookup(H.keys(list(range(8)))) == {}


def test_longest_consecutive_prefix_per_pod_and_tier(make_index):
    idx = make_index()
    toks = list(range(40))  # 10 blocks
    b = blocks(toks)
    idx.store(PodId("a"), G, b[:10])
    idx.store(PodId("b"), G, b[:4])
    idx.store(PodId("b"), C, b[:7])
    # pod c holds blocks 0-1 and 3-5: only the consecutive prefix counts
    idx.store(PodId("c"), G, b[:2] + b[3:6])
    got = idx.lookup(H.keys(toks))
    assert got == {("a", G): 10, ("b", G): 4, ("b", C): 7, ("c", G): 2}
    # a prompt that diverges after 5 blocks
    other = toks[:20] + [999] * 20
    assert idx.lookup(H.keys(other)) == {("a", G): 5, ("b", G): 4, ("b", C): 5, ("c", G): 2}


def test_resolve_and_remove_by_engine_hash(make_index):
    idx = make_index()
    b = blocks(list(range(16)))
    idx.store(PodId("a"), G, b)
    assert idx.resolve(PodId("a"), b[2][0]) == b[2][1]
    assert idx.resolve(PodId("zz"), b[2][0]) is None
    assert idx.resolve(PodId("a"), EngineBlockHash(12345)) is None
    assert idx.remove(PodId("a"), G, [b[2][0], EngineBlockHash(777)]) == 1
    assert idx.lookup(H.keys(list(range(16)))) == {("a", G): 2}
    assert idx.resolve(PodId("a"), b[2][0]) is None


def test_tiers_are_independent(make_index):
    idx = make_index()
    b = blocks(list(range(16)))
    idx.store(PodId("a"), G, b)
    idx.store(PodId("a"), C, b)
    assert idx.remove(PodId("a"), G, [h for h, _ in b]) == 4
    assert idx.lookup([k for _, k in b]) == {("a", C): 4}
    # the mapping survives while one tier holds the block
    assert idx.resolve(PodId("a"), b[0][0]) == b[0][1]
    assert idx.remove(PodId("a"), G, [b[0][0]]) == 0  # already gone from GPU
    assert idx.remove(PodId("a"), C, [b[0][0]]) == 1
    assert idx.resolve(PodId("a"), b[0][0]) is None


def test_store_is_idempotent(make_index):
    idx = make_index()
    b = blocks(list(range(16)))
    for _ in range(3):
        idx.store(PodId("a"), G, b)
    assert idx.stats().keys == 4 and idx.stats().mappings == 4
    assert idx.remove(PodId("a"), G, [h for h, _ in b]) == 4
    assert idx.stats().keys == 0 and idx.stats().mappings == 0


def test_clear_pod_leaves_other_pods(make_index):
    idx = make_index()
    b = blocks(list(range(16)))
    idx.store(PodId("a"), G, b)
    idx.store(PodId("a"), C, b)
    idx.store(PodId("b"), G, b[:2])
    assert idx.clear_pod(PodId("a")) == 4
    assert idx.lookup([k for _, k in b]) == {("b", G): 2}
    assert idx.resolve(PodId("a"), b[0][0]) is None
    assert idx.clear_pod(PodId("nope")) == 0
    # a cleared pod can come back
    idx.store(PodId("a"), C, b[:1])
    assert idx.lookup([k for _, k in b]) == {("b", G): 2, ("a", C): 1}


def test_engine_hash_reused_for_other_tokens_last_writer_wins(make_index):
    idx = make_index()
    eh = EngineBlockHash(42)
    k1, k2 = H.keys(list(range(4)))[0], H.keys(list(range(100, 104)))[0]
    idx.store(PodId("a"), G, [(eh, k1)])
    idx.store(PodId("a"), G, [(eh, k2)])
    assert idx.lookup([k1]) == {}
    assert idx.lookup([k2]) == {("a", G): 1}


def test_capacity_evicts_least_recently_used_keys(make_index):
    idx = make_index(max_keys=8)
    hot = blocks(list(range(8)), salt=1)        # 2 keys
    idx.store(PodId("a"), G, hot)
    for i in range(6):
        cold = blocks([1000 + 10 * i + j for j in range(4)], salt=2)  # 1 key each
        idx.store(PodId("a"), G, cold)
        assert idx.lookup([k for _, k in hot]) == {("a", G): 2}  # use keeps it warm
    idx.store(PodId("a"), G, blocks(list(range(500, 520)), salt=3))  # 5 more keys
    s = idx.stats()
    assert s.keys == 8 and s.evicted == 5
    assert idx.lookup([k for _, k in hot]) == {("a", G): 2}
    # evicting a key never leaves a holder without a mapping: remove still works
    assert idx.remove(PodId("a"), G, [h for h, _ in hot]) == 2


def test_pod_entries_roundtrip_into_a_fresh_index(make_index):
    src = make_index()
    b = blocks(list(range(32)))
    src.store(PodId("a"), G, b)
    src.store(PodId("a"), C, b[:3])
    entries = src.pod_entries(PodId("a"))
    assert len(entries) == 8
    dst = make_index()
    assert restore_entries(dst, PodId("a"), entries) == 8
    ks = [k for _, k in b]
    assert dst.lookup(ks) == src.lookup(ks) == {("a", G): 8, ("a", C): 3}


def test_stress_random_ops_match_a_reference_model(make_index):
    """Random stores/removes/clears over many pods, checked against a dict model."""
    idx = make_index()
    rng = random.Random(7)
    pods = [PodId(f"p{i}") for i in range(12)]
    prompts = [[rng.randrange(50) for _ in range(4 * 12)] for _ in range(6)]
    bl = [blocks(p) for p in prompts]
    ref: dict[tuple[str, Tier], set[int]] = {}
    for step in range(400):
        op = rng.random()
        pod, tier = rng.choice(pods), rng.choice([G, C])
        pi = rng.randrange(len(bl))
        if op < 0.55:
            n = rng.randrange(1, 13)
            idx.store(pod, tier, bl[pi][:n])
            ref.setdefault((pod, tier), set()).update(k for _, k in bl[pi][:n])
        elif op < 0.9:
            sel = rng.sample(bl[pi], rng.randrange(1, 4))
            idx.remove(pod, tier, [h for h, _ in sel])
            ref.setdefault((pod, tier), set()).difference_update(k for _, k in sel)
        elif op < 0.95:
            idx.clear_pod(pod)
            for t in (G, C):
                ref.pop((pod, t), None)
        if step % 20 == 0 or step == 399:
            for keys in ([k for _, k in x] for x in bl):
                want = {}
                for holder, held in ref.items():
                    n = 0
                    while n < len(keys) and keys[n] in held:
                        n += 1
                    if n:
                        want[holder] = n
                assert idx.lookup(keys) == want, f"step {step}"


def test_stress_many_pods_long_prompt(make_index):
    """512 pods sharing prefixes of one 4k-token prompt (1,024 blocks of 4)."""
    idx = make_index()
    toks = list(range(4096))
    b = blocks(toks)
    for i in range(512):
        idx.store(PodId(f"pod-{i}"), G if i % 2 else C, b[: (i * 7) % 1024 + 1])
    got = idx.lookup([k for _, k in b])
    assert len(got) == 512
    for i in range(512):
        assert got[(f"pod-{i}", G if i % 2 else C)] == (i * 7) % 1024 + 1


def test_concurrent_writers_and_readers(make_index):
    import threading

    idx = make_index()
    b = [blocks(list(range(p * 1000, p * 1000 + 64)), salt=p) for p in range(4)]
    errors = []

    def writer(p):
        try:
            for _ in range(20):
                idx.store(PodId(f"w{p}"), G, b[p])
                idx.remove(PodId(f"w{p}"), G, [h for h, _ in b[p][8:]])
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    def reader():
        try:
            for _ in range(50):
                for p in range(4):
                    got = idx.lookup([k for _, k in b[p]])
                    assert got.get((f"w{p}", G), 8) in range(8, 17)
        except Exception as e:  # pragma: no cover
            errors.append(e)

    ts = [threading.Thread(target=writer, args=(p,)) for p in range(4)]
    ts.append(threading.Thread(target=reader))
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors
    for p in range(4):
        assert idx.lookup([k for _, k in b[p]]) == {(f"w{p}", G): 8}
