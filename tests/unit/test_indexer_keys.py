"""The indexer's fast prompt hashing gives exactly ``RequestKeyHasher.keys``."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest

from kvtier.hashing import RequestKeyHasher
from kvtier.ids import ModelName, RequestKey
from kvtier.indexer.keys import request_keys


@pytest.mark.parametrize("bs", [1, 4, 16, 32, 64, 128])
@pytest.mark.parametrize("seed", [0, 7])
def test_same_keys_as_the_reference(bs, seed):
    rng = random.Random(bs * 100 + seed)
    h = RequestKeyHasher(ModelName("m"), bs, seed, lora=None if seed else "l")
    for n in (0, bs - 1, bs, 5 * bs + 3, 300):
        toks = [rng.randrange(2**32) for _ in range(n)]
        assert request_keys(h, toks) == h.keys(toks)
        assert request_keys(h, np.asarray(toks, dtype=np.uint32)) == h.keys(toks)
        parent = RequestKey(rng.getrandbits(64))
        assert request_keys(h, toks, parent) == h.keys(toks, parent)


def skip_without_native(why: str) -> None:
    """Skip, saying so, where the C helper is not built; fail instead where ``./run`` built it
    (it exports KVTIER_INDEXER_NATIVE_REQUIRED=1), so CI runs the compiled path for real."""
    if (os.environ.get("KVTIER_INDEXER_NATIVE_REQUIRED") == "1"
            and os.environ.get("KVTIER_INDEXER_NATIVE", "1") != "0"):
        pytest.fail(f"{why}, but ./run built the helper (KVTIER_INDEXER_NATIVE_REQUIRED=1)")
    print(f"SKIPPED: {why}")
    pytest.skip(why)


def test_bad_token_ids_are_refused_like_the_reference():
    h = RequestKeyHasher(ModelName("m"), 2)
    for bad in ([1, -1], [2**32, 0]):
        with pytest.raises(OverflowError):
            h.keys(bad)
        with pytest.raises(OverflowError):
            request_keys(h, bad)


def test_native_helper_gives_the_same_keys_when_built():
    """Both paths: the compiled one (``python -m kvtier.indexer.native.build``) and pure Python."""
    from kvtier.indexer import keys as mod
    from kvtier.indexer.native import NATIVE

    if NATIVE is None:
        skip_without_native("_kvtier_indexer_native not built (python -m "
                            "kvtier.indexer.native.build); the pure-Python path is tested above")
    rng = random.Random(5)
    for bs in (1, 3, 16, 32, 61, 64, 100):
        h = RequestKeyHasher(ModelName("m"), bs, seed=bs)
        for n in (0, bs, 7 * bs + 1, 2000):
            toks = [rng.randrange(2**32) for _ in range(n)]
            parent = RequestKey(rng.getrandbits(64))
            want = h.keys(toks, parent)
            assert NATIVE.request_keys(toks, bs, h.seed, int(parent)) == want
            assert mod.python_request_keys(h, toks, int(parent)) == want
            assert mod.request_keys(h, tuple(toks), parent) == want
    for bad, err in (([1, -1], OverflowError), ([2**32], OverflowError), ([1.5], TypeError),
                     (["1"], TypeError)):
        with pytest.raises(err):
            NATIVE.request_keys(bad, 1, 0, 0)
    with pytest.raises(ValueError):
        NATIVE.request_keys([1], 0, 0, 0)


def test_native_helper_builds_from_source(tmp_path):
    """What ./run's setup runs; skipped only where there is no compiler or xxhash.h."""
    import importlib.util

    from kvtier.indexer.native.build import build

    try:
        path = build(tmp_path)
    except RuntimeError as e:
        skip_without_native(f"cannot build the native helper here: {e}")
    spec = importlib.util.spec_from_file_location("_kvtier_indexer_native", path)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    h = RequestKeyHasher(ModelName("m"), 4)
    toks = list(range(40))
    assert m.request_keys(toks, 4, 0, int(h.root)) == h.keys(toks)


def test_native_walk_equals_the_python_walk():
    """MemoryIndex.lookup's prefix walk, compiled and in Python, on random holder sets."""
    from kvtier.ids import PodId, Tier
    from kvtier.indexer.index import MemoryIndex
    from kvtier.indexer.native import NATIVE

    if NATIVE is None:
        skip_without_native("_kvtier_indexer_native not built "
                            "(python -m kvtier.indexer.native.build)")
    rng = random.Random(9)
    for trial in range(40):
        idx = MemoryIndex()
        keys = [RequestKey(rng.getrandbits(64)) for _ in range(rng.randrange(1, 80))]
        for p in range(rng.choice([1, 3, 70, 200])):   # > 64 holders: masks beyond 64 bits
            d = rng.randrange(0, len(keys) + 1)
            gaps = {rng.randrange(len(keys)) for _ in range(rng.randrange(2))}
            blocks = [(i, k) for i, k in enumerate(keys[:d]) if i not in gaps]
            idx.store(PodId(f"p{p}"), rng.choice(list(Tier)), blocks)
        probe = keys + [RequestKey(1)] if trial % 2 else keys
        assert NATIVE.walk(probe, idx._keys) == idx._walk(probe), trial
    assert NATIVE.walk([], {}) == []
    assert NATIVE.walk([RequestKey(5)], {}) == []
    with pytest.raises(TypeError):
        NATIVE.walk((1, 2), {})


def test_native_lookup_equals_the_python_lookup():
    """MemoryIndex.lookup with the compiled walk-and-answer and without it: same answers."""
    from kvtier.ids import PodId, Tier
    from kvtier.indexer import index as mod
    from kvtier.indexer.native import NATIVE

    if NATIVE is None:
        skip_without_native("_kvtier_indexer_native not built "
                            "(python -m kvtier.indexer.native.build)")
    if not hasattr(NATIVE, "lookup"):
        print("SKIPPED: the native lookup is not built for this Python")
        pytest.skip("the native lookup is not built for this Python")
    rng = random.Random(11)
    for trial in range(60):
        idx = mod.MemoryIndex()
        keys = [RequestKey(rng.getrandbits(64)) for _ in range(rng.randrange(1, 90))]
        pods = rng.choice([1, 5, 29, 31, 61, 300])    # around the 30-bit digit edges
        for p in range(pods):
            d = rng.randrange(0, len(keys) + 1)
            gaps = {rng.randrange(len(keys)) for _ in range(rng.randrange(2))}
            idx.store(PodId(f"p{p}"), rng.choice(list(Tier)),
                      [(i, k) for i, k in enumerate(keys[:d]) if i not in gaps])
        if trial % 3 == 0 and pods > 1:
            idx.clear_pod(PodId("p0"))                 # a freed slot (None holder)
        probe = keys + [RequestKey(7)] if trial % 2 else keys
        got, deepest = NATIVE.lookup(probe, idx._keys, idx._slot_holder)
        levels = idx._walk(probe)
        want = {h: d for d, m in levels for s, h in enumerate(idx._slot_holder)
                if m >> s & 1 and h is not None}
        assert got == want, trial
        assert deepest == (levels[-1][0] if levels else 0)
        saved, mod._native_lookup, mod._native_walk = (mod._native_lookup, None, None)
        try:
            assert idx.lookup(probe) == got
        finally:
            mod._native_lookup, mod._native_walk = saved, NATIVE.walk
    assert NATIVE.lookup([], {}, []) == ({}, 0)
    assert NATIVE.lookup([RequestKey(1)], {RequestKey(1): 0b101}, [("a", 1), None, ("c", 2)]) \
        == ({("a", 1): 1, ("c", 2): 1}, 1)


def test_native_store_equals_the_python_store():
    """Same mappings, holders and LRU order after random stores (conflicts included)."""
    from kvtier.ids import EngineBlockHash, PodId, Tier
    from kvtier.indexer import index as mod
    from kvtier.indexer.native import NATIVE

    if NATIVE is None or not hasattr(NATIVE, "store"):
        skip_without_native("_kvtier_indexer_native not built "
                            "(python -m kvtier.indexer.native.build)")
    rng = random.Random(13)
    native, python = mod.MemoryIndex(), mod.MemoryIndex()
    pool_keys = [RequestKey(rng.getrandbits(64)) for _ in range(60)]
    for _ in range(400):
        pod, tier = PodId(f"p{rng.randrange(5)}"), rng.choice(list(Tier))
        blocks = [(EngineBlockHash(rng.randrange(80)), rng.choice(pool_keys))
                  for _ in range(rng.randrange(1, 12))]
        native.store(pod, tier, blocks)
        saved, mod._native_store = mod._native_store, None
        try:
            python.store(pod, tier, blocks)
        finally:
            mod._native_store = saved
    assert list(native._keys.items()) == list(python._keys.items())   # LRU order too
    assert native._maps == python._maps
