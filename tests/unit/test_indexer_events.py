"""Decoding vLLM's KV-event wire format, including vLLM's own encoder, and version skew."""

from __future__ import annotations

import msgspec
import pytest

from kvtier.hashing import EngineHasher, RequestKeyHasher
from kvtier.ids import EngineBlockHash, ModelName, PodId, Tier
from kvtier.indexer.index import MemoryIndex
from kvtier.indexer.ingest import EventApplier, HasherCache, PodCounters
from kvtier.wire import kv_events as ev


def test_decodes_batches_encoded_by_vllm_itself():
    kv = pytest.importorskip("vllm.distributed.kv_events")
    batch = kv.KVEventBatch(ts=12.5, events=[
        kv.BlockStored(block_hashes=[11, 12], parent_block_hash=None, token_ids=list(range(8)),
                       block_size=4, lora_id=None, medium="GPU", lora_name=None),
        kv.BlockStored(block_hashes=[b"\x01" * 32], parent_block_hash=12,
                       token_ids=[1, 2, 3, 4], block_size=4, lora_id=None, medium="CPU",
                       lora_name=None, group_idx=0, kv_cache_spec_kind="full"),
        kv.BlockRemoved(block_hashes=[11], medium="GPU"),
        kv.AllBlocksCleared(),
    ], data_parallel_rank=0)
    payload = msgspec.msgpack.Encoder().encode(batch)
    got = ev.decode_frames([b"kv@p", (7).to_bytes(8, "big"), payload])
    assert got.seq == 7 and got.ts == 12.5 and got.dp_rank == 0
    s0, s1, r, c = got.events
    assert s0 == ev.BlockStored((11, 12), None, list(range(8)), 4, "GPU", None, False, None)
    assert s1.block_hashes == (int.from_bytes(b"\x01" * 32, "big") & (2**64 - 1),)
    assert s1.parent_block_hash == 12 and s1.medium == "CPU" and s1.group_idx == 0
    assert r == ev.BlockRemoved((11,), "GPU")
    assert c == ev.AllBlocksCleared()


def test_old_array_encoding_and_unknown_fields_and_kinds():
    payload = msgspec.msgpack.encode([1.0, [
        ["BlockStored", [5], None, [1, 2, 3, 4], 4, None],           # older vLLM: no medium
        {"type": "BlockStored", "block_hashes": [6], "parent_block_hash": 5,
         "token_ids": [5, 6, 7, 8], "block_size": 4, "medium": "GPU",
         "brand_new_field": {"x": 1}},                                 # newer vLLM: extra field
        {"type": "SomethingNew", "a": 1},
        ["BlockRemoved", [5]],
    ]])
    b = ev.decode_payload(3, payload)
    assert b.dp_rank is None
    assert b.events[0] == ev.BlockStored((5,), None, [1, 2, 3, 4], 4)
    assert b.events[1].parent_block_hash == 5 and b.events[1].medium == "GPU"
    assert b.events[2] == ev.UnknownEvent("SomethingNew")
    assert b.events[3] == ev.BlockRemoved((5,))


@pytest.mark.parametrize("frames", [
    [b"t", b"\x00" * 8],                                       # 2 frames
    [b"t", b"\x00" * 7, ev.encode_batch([])],                  # short seq
    [b"t", b"\x00" * 8, b"\xc1garbage"],                       # not msgpack
    [b"t", b"\x00" * 8, msgspec.msgpack.encode({"a": 1})],     # wrong shape
    [b"t", b"\x00" * 8, msgspec.msgpack.encode([1.0, [{"no": "type"}]])],
    [b"t", b"\x00" * 8, msgspec.msgpack.encode([1.0, [{"type": "BlockStored"}]])],
    [b"t", b"\x00" * 8, msgspec.msgpack.encode(
        [1.0, [{"type": "BlockRemoved", "block_hashes": ["str"]}]])],
    [b"t", b"\x00" * 8, msgspec.msgpack.encode([1.0, [42]])],
])
def test_malformed_frames_raise_one_error_type(frames):
    with pytest.raises(ev.MalformedFrame):
        ev.decode_frames(frames)


@pytest.mark.parametrize("bs,seed,n", [(4, 3, 41), (32, 0, 32 * 50 + 7), (16, 99, 5)])
def test_fast_request_keys_equal_the_reference_hasher(bs, seed, n):
    import random

    import numpy as np

    h = RequestKeyHasher(ModelName("m"), bs, seed=seed)
    toks = [random.randrange(2**32) for _ in range(n)]
    keys = h.keys(toks)
    assert h.keys(toks) == keys
    assert h.keys(np.asarray(toks, dtype=np.uint32)) == keys
    if len(keys) > 2:
        assert h.keys(toks[2 * bs:], keys[1]) == keys[2:] == h.extend(keys[1], toks[2 * bs:])
    with pytest.raises((OverflowError, TypeError)):
        h.keys([-1] * bs)


def _apply(events, applier, pod="p", counters=None, seq=0):
    c = counters or PodCounters()
    applier.apply(PodId(pod), "m", ev.decode_payload(seq, ev.encode_batch(events)), c)
    return c


def test_applier_chains_request_keys_through_engine_hashes():
    """Keys computed from events equal keys computed from the whole prompt."""
    idx = MemoryIndex()
    hashers = HasherCache(block_size=4)
    applier = EventApplier(idx, hashers)
    toks = list(range(100, 124))
    eh = EngineHasher(4).hashes(toks)
    c = _apply([ev.encode_stored(eh[:2], None, toks[:8], 4),
                ev.encode_stored(eh[2:5], eh[1], toks[8:20], 4, medium="CPU"),
                ev.encode_stored(eh[5:6], eh[4], toks[20:24], 4)], applier)
    keys = hashers.get("m").keys(toks)
    # pod holds blocks 0-1 and 5 on GPU, 2-4 on CPU
    assert idx.lookup(keys) == {("p", Tier.GPU): 2}
    assert idx.lookup(keys[2:5]) == {("p", Tier.CPU): 3}
    assert c.blocks_stored == 6 and not c.dropped
    _apply([ev.encode_removed(eh[:1])], applier, counters=c)
    assert idx.lookup(keys) == {}
    _apply([ev.encode_cleared()], applier, counters=c)
    assert idx.stats().mappings == 0 and c.applied["AllBlocksCleared"] == 1


def test_applier_counts_what_it_cannot_index():
    idx = MemoryIndex()
    applier = EventApplier(idx, HasherCache(block_size=4))
    c = _apply([
        ev.encode_stored([1], 999, [1, 2, 3, 4], 4),                       # unknown parent
        ev.encode_stored([2], None, [1, 2, 3, 4], 8),                      # other block size
        ev.encode_stored([3], None, [1, 2, 3, 4], 4, medium="STORAGE"),
        ev.encode_stored([4], None, [1, 2, 3, 4], 4, extra_keys=[["salt"]]),
        ev.encode_stored([5], None, [1, 2, 3, 4], 4, group_idx=1),
        ev.encode_stored([6, 7], None, [1, 2, 3, 4, 5], 4),                # short token list
        ev.encode_removed([123]),
        {"type": "FutureEvent"},
    ], applier)
    assert c.dropped == {"orphan": 1, "block_size_mismatch": 1, "unknown_medium": 1,
                         "extra_keys": 1, "non_primary_group": 1, "short_token_ids": 1,
                         "remove_unknown": 1, "unknown_event:FutureEvent": 1}
    assert idx.stats().mappings == 1  # block 6 was indexed
    assert idx.resolve(PodId("p"), EngineBlockHash(6)) is not None


def test_lora_blocks_live_in_their_own_namespace():
    idx = MemoryIndex()
    hashers = HasherCache(block_size=4)
    applier = EventApplier(idx, hashers)
    toks = [1, 2, 3, 4]
    _apply([ev.encode_stored([9], None, toks, 4, lora_name="adapter")], applier)
    assert idx.lookup(hashers.get("m").keys(toks)) == {}
    assert idx.lookup(hashers.get("m", "adapter").keys(toks)) == {("p", Tier.GPU): 1}


def test_vllm_cpu_offload_events_name_blocks_by_hash_only():
    """vLLM's OffloadingConnector (tiering spec: no self-describing events) sends CPU-medium
    BlockStored with hashes, no tokens, block size 0: keyed by what the GPU stream announced."""
    idx = MemoryIndex()
    hashers = HasherCache(block_size=4)
    applier = EventApplier(idx, hashers)
    toks = list(range(200, 216))
    eh = EngineHasher(4).hashes(toks)
    keys = hashers.get("m").keys(toks)
    c = _apply([ev.encode_stored(eh[:4], None, toks, 4),
                ev.encode_stored(eh[:3], None, [], 0, medium="CPU", group_idx=0),
                ev.encode_stored([987654], None, [], 0, medium="CPU", group_idx=0)], applier)
    assert c.dropped == {"unresolved_hash": 1}
    _apply([ev.encode_removed(eh[:4])], applier, counters=c)  # evicted from HBM
    assert idx.lookup(keys) == {("p", Tier.CPU): 3}
