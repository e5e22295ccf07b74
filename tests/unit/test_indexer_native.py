"""The C helper's event decoder and route rows answer exactly as the Python paths do.

``decode_batch`` (``kvtier.indexer.native``) reads the usual event shape straight into
``kv_events`` objects and gives None for anything else; ``fastdecode.decode_payload`` must
then equal the typed msgspec path (and so ``kv_events``) on every payload, usual or not.
``route_rows`` must equal ``select.route_parts``' Python loops; ``lookup`` with the
holders' precomputed hashes must equal it without them.
"""

from __future__ import annotations

import random
from typing import Any

import msgspec
import pytest

from kvtier.ids import PodId, RequestKey, Tier
from kvtier.indexer import fastdecode as fd
from kvtier.indexer import select
from kvtier.indexer.native import NATIVE
from kvtier.wire import kv_events as ev
from kvtier.wire.indexer_api import Match
from tests.unit.test_indexer_keys import skip_without_native

enc = msgspec.msgpack.Encoder().encode


@pytest.fixture(autouse=True)
def _native() -> None:
    if NATIVE is None or not hasattr(NATIVE, "decode_batch"):
        skip_without_native("_kvtier_indexer_native (with decode_batch) not loaded: not built "
                            "(python -m kvtier.indexer.native.build) or KVTIER_INDEXER_NATIVE=0")


def same(payload: bytes, seq: int = 5) -> Any:
    """Both decoders on one payload: equal batches or both MalformedFrame."""
    try:
        want = fd.typed_decode_payload(seq, payload)
    except ev.MalformedFrame:
        with pytest.raises(ev.MalformedFrame):
            fd.decode_payload(seq, payload)
        return None
    got = fd.decode_payload(seq, payload)
    assert got == want
    assert [type(e) for e in got.events] == [type(e) for e in want.events]
    for a, b in zip(got.events, want.events, strict=True):
        if isinstance(a, ev.BlockStored):
            assert type(a.token_ids) is type(b.token_ids)
            assert type(a.block_hashes) is tuple and a.block_hashes == b.block_hashes
    return got


def random_event(rng: random.Random) -> dict[str, Any]:
    def h() -> int:
        return rng.choice([rng.getrandbits(64), rng.randrange(-2**63, 0), rng.randrange(300),
                           -rng.randrange(1, 33)])

    kind = rng.choice(["s", "s", "s", "r", "c"])
    if kind == "c":
        e: dict[str, Any] = ev.encode_cleared()
    elif kind == "r":
        e = ev.encode_removed([h() for _ in range(rng.randrange(0, 20))],
                              rng.choice([None, "GPU", "CPU", "ĝpu"]))
    else:
        bs = rng.choice([1, 4, 16])
        n = rng.randrange(0, 5)
        width = rng.choice([127, 255, 65535, 2**32 - 1, 2**40])
        toks = [rng.randrange(width + 1) for _ in range(n * bs + rng.randrange(3))]
        e = ev.encode_stored([h() for _ in range(n)], rng.choice([None, h()]), toks, bs,
                             rng.choice([None, "GPU", "CPU"]))
        e["lora_name"] = rng.choice([None, None, "l", "ünï"])
    roll = rng.random()
    if roll < 0.1:
        e["group_idx"] = rng.choice([None, 0, 1, 2**63, -1, True])
    elif roll < 0.2:
        e["extra_keys"] = rng.choice([None, [], [None, None], [None, ["salt"]], [0]])
    elif roll < 0.3:
        e["locality"] = rng.choice([None, "LOCAL", [1, {"a": b"x"}], 1.5])   # unknown fields
    elif roll < 0.35:
        e = {k: e[k] for k in reversed(list(e))}                             # tag not first
    elif roll < 0.4 and "block_size" in e:
        e["block_size"] = rng.choice([0, -1, 2**64 - 1, 1.0, True])
    return e


def test_decoder_equals_the_typed_path_on_random_batches():
    rng = random.Random(31)
    native_answers = 0
    for _ in range(600):
        events = [random_event(rng) for _ in range(rng.randrange(0, 5))]
        batch: Any = [rng.choice([0.0, 1.5e9, float("inf")]), events]
        if rng.random() < 0.7:
            batch.append(rng.choice([None, 0, 3, 2**40]))
        payload = enc(batch)
        if NATIVE.decode_batch(payload, 5, fd._CLASSES) is not None:
            native_answers += 1
        same(payload)
    assert native_answers > 200   # the usual shape is the common case


def test_decoder_leaves_every_unusual_shape_to_the_typed_path():
    hashes = [1, 2, 3]
    stored = ev.encode_stored(hashes, None, list(range(12)), 4)
    unusual = [
        {"ts": 1.0, "events": [stored]},                   # a map-encoded batch
        [1, [stored]],                                     # an int ts
        [0.0, [stored], 0, "extra"],                       # four fields
        [0.0], ["x", []], [0.0, "events"],
        [0.0, [["BlockStored", hashes, None, list(range(4)), 4, None, "GPU"]]],  # array event
        [0.0, [{**stored, "block_hashes": [True]}]],
        [0.0, [{**stored, "block_hashes": [b"\x01" * 32]}]],
        [0.0, [{**stored, "token_ids": ["a", 1, 2, 3]}]],
        [0.0, [{**stored, "token_ids": [1.5, 1, 2, 3]}]],
        [0.0, [{**stored, "token_ids": [True, 1, 2, 3]}]],
        [0.0, [{**stored, "token_ids": "x"}]],
        [0.0, [{**stored, "medium": 5}]],
        [0.0, [{**stored, "extra_keys": [None, ["salt"], None]}]],
        [0.0, [{"type": "NewKind"}]], [0.0, [{"no": "type"}]], [0.0, [{}]],
        [0.0, [{k: v for k, v in stored.items() if k != "block_size"}]],
    ]
    for batch in unusual:
        payload = enc(batch)
        assert NATIVE.decode_batch(payload, 1, fd._CLASSES) is None, batch
        same(payload)
    dup = enc([0.0, [stored]]).replace(b"\xa6medium", b"\xa9lora_name", 1)  # a duplicate key
    assert NATIVE.decode_batch(dup, 1, fd._CLASSES) is None
    same(dup)
    f32 = b"\x93\xca\x3f\xc0\x00\x00\x90\xc0"   # [1.5 as float32, [], nil]
    assert NATIVE.decode_batch(f32, 5, fd._CLASSES) == same(f32)


def test_decoder_on_truncated_and_corrupted_payloads():
    rng = random.Random(7)
    payload = enc([0.25, [ev.encode_stored([rng.getrandbits(64) for _ in range(3)], 9,
                                           [rng.randrange(70000) for _ in range(12)], 4),
                          ev.encode_removed([5, -6], "CPU"), ev.encode_cleared()], 2])
    assert NATIVE.decode_batch(payload, 0, fd._CLASSES) is not None
    for cut in range(len(payload)):
        same(payload[:cut])
    same(payload + b"\x00")            # trailing bytes
    for _ in range(400):
        b = bytearray(payload)
        for _ in range(rng.randrange(1, 4)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        same(bytes(b))


def test_decoded_objects_are_whole():
    got = same(enc([0.5, [ev.encode_stored([2**64 - 1, -1], 7, list(range(8)), 4, "CPU")], 0]))
    e = got.events[0]
    assert e.block_hashes == (2**64 - 1, 2**64 - 1) and e.parent_block_hash == 7
    assert e.medium == "CPU" and e.has_extra_keys is False and e.group_idx is None
    assert list(e.token_ids) == list(range(8)) and e.token_ids.tolist() == list(range(8))
    assert hash(ev.AllBlocksCleared()) == hash(same(enc([0.0, [ev.encode_cleared()]])).events[0])
    with pytest.raises(AttributeError):
        e.medium = "GPU"   # type: ignore[misc]  # still frozen


def python_parts(merged: dict[Any, int], bs: int, target: PodId | None) -> Any:
    saved, select._native_rows = select._native_rows, None
    try:
        return select.route_parts(merged, bs, target)
    finally:
        select._native_rows = saved


def test_route_rows_equal_the_python_loops():
    rng = random.Random(17)
    names = ["a", "b", "pod-1", "pod-10", "pod-2", "ü", "日本", "a" * 40, "B"]
    for trial in range(300):
        merged = {(PodId(rng.choice(names) + str(rng.randrange(3))), rng.choice(list(Tier))):
                  rng.choice([0, 1, 1, 2, 5, 40]) for _ in range(rng.randrange(0, 40))}
        target = rng.choice([None, PodId("a0"), PodId("ü1"), PodId("zz")])
        bs = rng.choice([1, 16])
        want = python_parts(merged, bs, target)
        for slots in (select._MATCH_SLOTS, None):
            got = NATIVE.route_rows(merged, bs, target, select._TIER_VALUE, Tier.CPU, Match,
                                    slots)
            assert got == want, trial
        assert select.route_parts(merged, bs, target) == want
    # not a (str, tier) -> int mapping: None, and route_parts answers in Python
    odd = {(1, Tier.GPU): 3}
    assert NATIVE.route_rows(odd, 1, None, select._TIER_VALUE, Tier.CPU, Match, None) is None
    assert NATIVE.route_rows({("a", Tier.GPU): 1.0}, 1, None, select._TIER_VALUE, Tier.CPU,
                             Match, None) is None


def test_matches_made_without_calling_match_are_matches():
    assert select._MATCH_SLOTS is not None
    (m,), _, _ = NATIVE.route_rows({(PodId("p"), Tier.CPU): 3}, 16, None, select._TIER_VALUE,
                                   Tier.CPU, Match, select._MATCH_SLOTS)
    want = Match("p", "CPU", 48)
    assert m == want and hash(m) == hash(want) and repr(m) == repr(want)
    assert msgspec.json.encode(m) == msgspec.json.encode(want)
    with pytest.raises(AttributeError):
        m.pod = "q"   # type: ignore[misc]  # frozen


def test_lookup_with_holder_hashes_equals_without():
    from kvtier.indexer.index import MemoryIndex

    if not hasattr(NATIVE, "lookup"):
        pytest.skip("the native lookup is not built for this Python")
    rng = random.Random(3)
    for _ in range(30):
        idx = MemoryIndex()
        keys = [RequestKey(rng.getrandbits(64)) for _ in range(rng.randrange(1, 40))]
        for p in range(rng.choice([1, 31, 70])):
            idx.store(PodId(f"p{p}"), rng.choice(list(Tier)),
                      list(enumerate(keys[:rng.randrange(len(keys) + 1)])))
        if rng.random() < 0.5:
            idx.clear_pod(PodId("p0"))
        assert NATIVE.lookup(keys, idx._keys, idx._slot_holder, idx._slot_hash) == \
            NATIVE.lookup(keys, idx._keys, idx._slot_holder)


def test_store_tokens_equals_hashing_then_store():
    """MemoryIndex.store_tokens (hash the msgpack tokens and store in one compiled call) leaves
    the index exactly as request keys + store do, conflicts (an engine hash reused for other
    tokens) and capacity eviction included."""
    from kvtier.hashing import RequestKeyHasher
    from kvtier.ids import EngineBlockHash, ModelName
    from kvtier.indexer.index import MemoryIndex
    from kvtier.indexer.keys import request_keys

    rng = random.Random(23)
    h = RequestKeyHasher(ModelName("m"), 4, seed=1)
    fused, plain = (MemoryIndex(max_keys=300, max_blocks_per_pod=120) for _ in range(2))
    for _ in range(300):
        pod, tier = PodId(f"p{rng.randrange(4)}"), rng.choice(list(Tier))
        n = rng.randrange(1, 9)
        toks = [rng.choice([rng.randrange(128), rng.randrange(2**16), rng.randrange(2**32)])
                for _ in range(4 * n + rng.randrange(4))]
        hashes = tuple(EngineBlockHash(rng.randrange(60)) for _ in range(n))
        parent = rng.choice([None, RequestKey(rng.getrandbits(64))])
        assert fused.store_tokens(pod, tier, hashes, enc(toks), h, parent, n)
        plain.store(pod, tier, list(zip(hashes, request_keys(h, toks[:4 * n], parent))))
    assert list(fused._keys.items()) == list(plain._keys.items())   # LRU order too
    assert fused._maps == plain._maps and fused.stats() == plain.stats()
    with pytest.raises(OverflowError):
        fused.store_tokens(PodId("p0"), Tier.GPU, (1,), enc([-1, 0, 0, 0]), h, None, 1)
    with pytest.raises(ValueError):   # fewer hashes than blocks
        fused.store_tokens(PodId("p0"), Tier.GPU, (), enc([1, 0, 0, 0]), h, None, 1)
    assert sorted(fused.pods()) == sorted(plain.pods())
    with pytest.raises(OverflowError):
        fused.store_tokens(PodId("new"), Tier.GPU, (1,), enc([2**33, 0, 0, 0]), h, None, 1)
    assert PodId("new") not in fused.pods()   # a refused event leaves no trace
