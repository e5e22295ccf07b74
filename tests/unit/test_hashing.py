import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.hashing import EngineHasher, RequestKeyHasher, to_external, token_digest
from kvtier.ids import ModelName


def _vllm_hashes(tokens, block_size, seed_env=None, monkeypatch=None):
    """vLLM's own implementation, as the oracle."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils as kcu

    if seed_env is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", seed_env)
    kcu.init_none_hash(sha256)
    out, parent = [], None
    for i in range(len(tokens) // block_size):
        parent = kcu.hash_block_tokens(sha256, parent, tokens[i * block_size:(i + 1) * block_size])
        out.append(kcu.maybe_convert_block_hash(parent))
    return out


@pytest.mark.parametrize("seed", [None, "0", "12345"])
def test_engine_hashes_match_vllm(seed, monkeypatch):
    rng = random.Random(7)
    tokens = [rng.randrange(50_000) for _ in range(32 * 9 + 5)]
    ours = EngineHasher(32, seed=seed or "vllm-none-hash").hashes(tokens)
    assert ours == _vllm_hashes(tokens, 32, seed, monkeypatch)
    assert len(ours) == 9  # the partial trailing block is not hashed


def test_engine_hash_differs_with_seed():
    toks = list(range(64))
    assert EngineHasher(32).hashes(toks) != EngineHasher(32, seed="0").hashes(toks)


def test_to_external_takes_low_64_bits_big_endian():
    digest = bytes(range(32))
    assert to_external(digest) == int.from_bytes(digest[-8:], "big")


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 2**31 - 1), min_size=0, max_size=300), st.integers(1, 64))
def test_request_keys_are_prefix_chained(tokens, bs):
    h = RequestKeyHasher(ModelName("m"), bs)
    keys = h.keys(tokens)
    assert len(keys) == len(tokens) // bs
    # Keys of a prefix are a prefix of the keys.
    assert h.keys(tokens[: len(tokens) // 2]) == keys[: (len(tokens) // 2) // bs]
    # chain/extend compute the same values incrementally.
    assert h.extend(None, tokens) == keys


def test_request_keys_are_namespaced_and_seeded():
    toks = list(range(128))
    base = RequestKeyHasher(ModelName("m"), 32).keys(toks)
    assert RequestKeyHasher(ModelName("m"), 32).keys(toks) == base  # deterministic
    assert RequestKeyHasher(ModelName("other"), 32).keys(toks)[0] != base[0]
    assert RequestKeyHasher(ModelName("m"), 32, seed=1).keys(toks)[0] != base[0]
    assert RequestKeyHasher(ModelName("m"), 32, lora="a").keys(toks)[0] != base[0]
    changed = toks.copy()
    changed[40] += 1
    k2 = RequestKeyHasher(ModelName("m"), 32).keys(changed)
    assert k2[0] == base[0] and all(a != b for a, b in zip(k2[1:], base[1:]))


def test_request_key_hasher_rejects_bad_block_size():
    with pytest.raises(ValueError):
        RequestKeyHasher(ModelName("m"), 0)


def test_token_digest_is_exact():
    assert token_digest([1, 2, 3]) == token_digest([1, 2, 3])
    assert token_digest([1, 2, 3]) != token_digest([1, 2, 4])
    assert token_digest([1, 2]) != token_digest([1, 2, 0])


def _reference_keys(model, bs, seed, tokens, parent=None):
    """The documented definition, written out naively (struct, no numpy/array)."""
    import struct

    import xxhash

    ns = f"kvtier/v1|model={model}|lora=|extra="
    prev = xxhash.xxh3_64_intdigest(ns.encode(), seed) if parent is None else parent
    out = []
    for i in range(len(tokens) // bs):
        blk = tokens[i * bs:(i + 1) * bs]
        prev = xxhash.xxh3_64_intdigest(struct.pack("<Q", prev) + struct.pack(f"<{bs}I", *blk), seed)
        out.append(prev)
    return out


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), max_size=200), st.integers(1, 40), st.integers(0, 2**32))
def test_request_keys_match_the_documented_definition(tokens, bs, seed):
    import numpy as np

    h = RequestKeyHasher(ModelName("m"), bs, seed=seed)
    ref = _reference_keys("m", bs, seed, tokens)
    assert h.keys(tokens) == ref
    assert h.keys(np.asarray(tokens, dtype=np.uint32)) == ref
    if len(ref) >= 2:
        assert h.keys(tokens[bs:], ref[0]) == ref[1:]


def test_out_of_range_token_ids_are_refused():
    h = RequestKeyHasher(ModelName("m"), 2)
    with pytest.raises((OverflowError, TypeError)):
        h.keys([-1, 5])
