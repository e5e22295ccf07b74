"""The live runner's bookkeeping without servers: device ledger, per-turn records, transfer split."""

from __future__ import annotations

import pytest

from kvtier.ab.live.runner import DeviceLedger, Leg, _record, _split_transfer


def test_ledger_pins_until_read_or_ttl():
    L = DeviceLedger(block_size=32, ttl_s=10.0, router_margin_s=1.0)
    L.retained("a", 100, now=0.0)   # 4 blocks until t=10
    L.retained("b", 32, now=5.0)    # 1 block until t=15
    assert L.blocks(6.0) == 5 and L.blocks(11.0) == 1
    assert not L.expired("a", 8.9) and L.expired("a", 9.0)   # router drops it 1 s early
    L.read("a")
    assert L.blocks(6.0) == 1
    L.retained("b", 64, now=6.0)    # an unread older turn stays pinned until its TTL
    assert L.blocks(7.0) == 3
    assert DeviceLedger(32, None).blocks(0.0) == 0


def test_record_from_legs():
    L = DeviceLedger(32, 100.0)
    L.retained("cid", 300, now=0.0)
    pre = Leg("prefill-0", "prefill", 1.0, 1.25,
              {"do_remote_decode": True, "remote_block_ids": [1, 2]},
              {"usage": {"prompt_tokens_details": {"cached_tokens": 288}}})
    dec = Leg("decode-0", "decode", 1.25, 2.0, {"remote_block_ids": [7]},
              {"kv_transfer_params": {"remote_block_ids": [3], "remote_num_tokens": 415}})
    r = _record("device-ttl", "c0", 1, 0.9, 1.0, 2.0, [pre, dec], 400, [5] * 16, "", L,
                "cid", False)
    assert (r.reuse_path, r.reused_tokens, r.computed_tokens) == ("dp_read", 288, 112)
    assert r.ttft_s == pytest.approx(0.25) and r.e2e_s == pytest.approx(1.0)
    assert r.outcome == "full" and r.ok
    assert L.blocks(3.0) == 13  # the old entry was read; the new one (415 tokens) is pinned
    # no prefill leg (router fell back to one instance): ttft = e2e, nothing reused
    d = _record("x", "c0", 1, 0.0, 0.0, 2.0, [], 10, None, "boom", L, "z", True)
    assert d.ttft_s == d.e2e_s and d.reuse_path == "none" and not d.ok and d.outcome == "expired"


def test_transfer_split_by_reused_tokens():
    L = DeviceLedger(32, None)
    pre = lambda n, kvp: Leg("p", "prefill", 0, 1, kvp,  # noqa: E731
                             {"usage": {"prompt_tokens_details": {"cached_tokens": n}}})
    rs = [_record("s", "c", 1, 0, 0, 1, [pre(100, {"remote_block_ids": [1]})], 200, [1], "", L,
                  "c", False),
          _record("s", "d", 1, 0, 0, 1, [pre(300, {"remote_kv_source": {"pod": "x"}})], 400, [1],
                  "", L, "d", False),
          _record("s", "e", 1, 0, 0, 1, [pre(50, {})], 400, [1], "", L, "e", False)]
    assert [r.reuse_path for r in rs] == ["dp_read", "p2p", "local"]
    _split_transfer(rs, 0.4)
    assert [r.transfer_s for r in rs] == [pytest.approx(0.1), pytest.approx(0.3), 0.0]
