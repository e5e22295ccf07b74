"""The indexer's typed event decoder answers exactly as ``kvtier.wire.kv_events`` does."""

from __future__ import annotations

import random

import msgspec
import pytest

from kvtier.indexer import fastdecode as fd
from kvtier.wire import kv_events as ev

enc = msgspec.msgpack.Encoder().encode


def both(payload: bytes, seq: int = 3):
    try:
        want = ev.decode_payload(seq, payload)
    except ev.MalformedFrame as e:
        with pytest.raises(ev.MalformedFrame):
            fd.decode_payload(seq, payload)
        return type(e)
    got = fd.decode_payload(seq, payload)
    assert got == want
    return got


def test_usual_shape_and_every_variant_decode_the_same():
    rng = random.Random(4)
    hashes = [rng.getrandbits(64) for _ in range(6)]
    stored = ev.encode_stored(hashes[:3], None, list(range(12)), 4)
    cases = [
        [0.5, [stored, ev.encode_removed(hashes[:1], "CPU"), ev.encode_cleared()], 0],
        [1, [ev.encode_stored(hashes[3:], hashes[2], list(range(12)), 4, "CPU")]],
        [0.0, [], None],
        [0.0, [{**stored, "extra_keys": [None, ["salt"], None]}], 1],
        [0.0, [{**stored, "extra_keys": [None, None, None]}], 1],
        [0.0, [{**stored, "group_idx": 1, "lora_name": "l"}], 1],
        [0.0, [{**stored, "block_hashes": [-1, -2**63, 5]}], 1],           # negative: folded
        [0.0, [{**stored, "parent_block_hash": -7}], 1],
        [0.0, [{**stored, "block_hashes": [b"\x01" * 32, b"\x02" * 32]}], 1],  # bytes hashes
        [0.0, [["BlockStored", hashes[:1], None, list(range(4)), 4, None, "GPU"]], 0],  # array
        [0.0, [{"type": "NewKind", "x": 1}], 0],                          # unknown kind
        [0.0, [{**stored, "medium": 5}], 0],                              # odd type
        [0.0, [{**stored, "group_idx": True}], 0],
        [0.0, [{**stored, "token_ids": ["a", "b", "c", "d"]}], 0],
        [0.0, [{**stored, "block_size": 0}], 0],                          # malformed
        [0.0, [{**stored, "token_ids": "x"}], 0],
        [0.0, [{"no": "type"}], 0],
        [0.0, [{**stored, "block_hashes": [True]}], 0],
        {"ts": 1.0, "events": [stored]},                                  # map-encoded batch
        ["ts", []],
        [0.0],
    ]
    kinds = set()
    for c in cases:
        r = both(enc(c))
        kinds.add(r.__name__ if isinstance(r, type) else type(r).__name__)
    assert {"EventBatch", "MalformedFrame"} <= kinds
    for raw in (b"", b"\xc1", b"\x93\xcb", enc("x")):
        assert both(raw) is ev.MalformedFrame


def test_frames():
    frames = ev.encode_frames("kv@p", 9, [ev.encode_cleared()])
    assert fd.decode_frames(frames) == ev.decode_frames(frames)
    for bad in ([b"x"], [b"t", b"short", b"p"]):
        with pytest.raises(ev.MalformedFrame):
            fd.decode_frames(bad)


def test_tokens_hashed_from_msgpack_bytes_equal_the_list_path():
    """With the compiled helper, a BlockStored's tokens stay msgpack bytes (RawTokens) and are
    hashed from them: same keys, same errors as hashing the decoded list."""
    from kvtier.hashing import RequestKeyHasher
    from kvtier.ids import ModelName, RequestKey
    from kvtier.indexer.keys import block_keys

    if not fd._RAW_TOKENS:
        from tests.unit.test_indexer_keys import skip_without_native

        skip_without_native("the native helper is not built: tokens are decoded to lists")
    rng = random.Random(2)
    h = RequestKeyHasher(ModelName("m"), 4, seed=3)
    for toks in ([], list(range(7)), [rng.randrange(2**32) for _ in range(40)],
                 [0, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, True, False, 1, 2],
                 list(range(70000))):                      # array32 header
        ev_ = fd.decode_payload(0, enc([0.0, [ev.encode_stored([1], None, toks, 4)], 0]))
        raw = ev_.events[0].token_ids
        assert isinstance(raw, fd.RawTokens) and len(raw) == len(toks) and raw == toks
        for max_blocks in (0, 1, 3, len(toks) // 4, len(toks)):
            for parent in (None, RequestKey(rng.getrandbits(64))):
                assert block_keys(h, raw, parent, max_blocks) == \
                    block_keys(h, list(toks), parent, max_blocks)
    for bad, err in (([1, -1, 2, 3], OverflowError), ([2**32, 0, 0, 0], OverflowError),
                     ([1.5, 0, 0, 0], TypeError), (["x", 0, 0, 0], TypeError),
                     ([None, 0, 0, 0], TypeError), ([2**64 - 1, 0, 0, 0], OverflowError)):
        ev_ = fd.decode_payload(0, enc([0.0, [ev.encode_stored([1], None, bad, 4)], 0]))
        with pytest.raises(err):
            block_keys(h, ev_.events[0].token_ids, None, 1)
        with pytest.raises(err):
            block_keys(h, bad, None, 1)
