"""Derived metrics of A/B records, on synthetic records with hand-computed answers."""

from __future__ import annotations

import math

import pytest

from kvtier.ab.records import (
    MemorySample,
    RunResult,
    TurnRecord,
    bucket_of,
    decode,
    encode,
    engine_summary,
    merge_engine,
    merge_repeats,
)
from kvtier.ids import Outcome, ReusePath


def turn(conv="c", i=0, prompt=100, reused=0, path="none", ttft=0.1, outcome="none", ok=True):
    return TurnRecord(strategy="s", conversation_id=conv, turn=i, prompt_tokens=prompt,
                      reused_tokens=reused, reuse_path=ReusePath(path), computed_tokens=prompt - reused,
                      ttft_s=ttft, e2e_s=ttft * 2, outcome=Outcome(outcome), ok=ok)


def test_block_seconds_sample_and_hold():
    mem = [MemorySample("s", 0.0, 10, 0), MemorySample("s", 2.0, 30, 2_000_000_000),
           MemorySample("s", 3.0, 0, 0)]
    r = RunResult("s", [], mem, {"t_end": 5.0})
    assert r.device_block_seconds() == pytest.approx(10 * 2 + 30 * 1 + 0 * 2)
    assert r.host_gb_seconds() == pytest.approx(2.0 * 1)


def test_last_sample_holds_until_t_end_and_unsorted_input():
    mem = [MemorySample("s", 4.0, 5, 0), MemorySample("s", 0.0, 1, 0)]
    assert RunResult("s", [], mem, {"t_end": 10.0}).device_block_seconds() == pytest.approx(4 + 30)
    assert RunResult("s", [], mem, {}).device_block_seconds() == pytest.approx(4)
    assert RunResult("s").device_block_seconds() == 0.0


def test_reuse_hit_expiry_rates_count_follow_ups_only():
    turns = [turn(i=0, prompt=100),                                 # first turns never count
             turn(i=1, prompt=200, reused=150, path="dp_read", outcome="full"),
             turn(i=2, prompt=300, reused=0, outcome="expired"),
             turn(i=3, prompt=500, reused=250, path="p2p"),
             turn(i=4, prompt=900, reused=900, path="dp_read", ok=False)]  # errors excluded
    r = RunResult("s", turns)
    assert r.reuse_rate() == pytest.approx(400 / 1000)
    assert r.hit_rate() == pytest.approx(2 / 3)
    assert r.expiry_rate() == pytest.approx(1 / 3)
    assert r.reuse_by_path() == {"dp_read": 150, "p2p": 250, "local": 0, "none": 0}
    s = r.summary()
    assert s["errors"] == 1 and s["turns"] == 5
    assert s["computed_tokens"] == 100 + 50 + 300 + 250


def test_ttft_medians_per_bucket_and_longest():
    turns = [turn(prompt=100, ttft=0.1), turn(prompt=200, ttft=0.3), turn(prompt=250, ttft=0.2),
             turn(prompt=3000, ttft=2.0), turn(prompt=4000, ttft=4.0)]
    r = RunResult("s", turns)
    assert r.ttft_by_bucket() == {256: pytest.approx(0.2), 4096: pytest.approx(3.0)}
    assert r.ttft_at_longest() == pytest.approx(4.0)
    assert math.isnan(RunResult("s").ttft_at_longest())
    assert bucket_of(256) == 256 and bucket_of(257) == 512


def test_json_round_trip():
    r = RunResult("s", [turn(i=1, reused=10, path="dp_read")],
                  [MemorySample("s", 0.5, 3, 4)], {"t_end": 1.0})
    [back] = decode(encode([r]))
    assert back == r


def test_merge_repeats_windows_and_renames():
    import pytest

    from kvtier.ab.records import MemorySample, RunResult, TurnRecord, merge_repeats

    def run(blocks: int, ttft: float) -> RunResult:
        turns = [TurnRecord("s", "c", i, 100, 50, "dp_read", 50, ttft, 1.0, 0.0, float(2 * i))
                 for i in range(2)]
        mem = [MemorySample("s", 0.0, 0, 0), MemorySample("s", 1.0, blocks, 0),
               MemorySample("s", 3.0, 0, 0)]
        return RunResult("s", turns, mem, {"t_end": 3.0})

    a, b = run(10, 0.1), run(30, 0.3)
    m = merge_repeats([a, b])
    assert m.device_block_seconds() == pytest.approx((20 + 60) / 2)  # the mean of the two runs
    assert [t.conversation_id for t in m.turns] == ["c", "c", "c~1", "c~1"]
    assert min(t.t_start for t in m.turns if t.conversation_id == "c~1") >= 3.0
    assert m.meta["per_repeat"][1]["ttft_p50_s"] == pytest.approx(0.3)
    assert merge_repeats([a]) is a
    with pytest.raises(ValueError):
        merge_repeats([a, RunResult("other")])
    with pytest.raises(ValueError):
        merge_repeats([])


def _rec(name: str, conv: str, turn: int, ttft: float, refusal: str = "") -> TurnRecord:
    return TurnRecord(name, conv, turn, 100, 0, "none", 100, ttft, ttft + 1, t_start=float(turn),
                      refusal=refusal)


def test_throughput_refusals_and_the_decode_nodes_own_block_seconds() -> None:
    a = RunResult("s", [_rec("s", "c", 0, 0.1), _rec("s", "c", 1, 0.2, "expired"),
                        _rec("s", "c", 2, 0.3, "below_threshold")],
                  [MemorySample("s", 0.0, 10, 0)],
                  {"t_end": 30.0, "device_block_s_counted": 120.0,
                   "device_blocks_source": "decode metrics (kvtier_decode_*)"})
    s = a.summary()
    assert s["turns_per_min"] == 6.0 and s["refusals"] == {"expired": 1, "below_threshold": 1}
    assert s["device_block_s"] == 120.0  # the nodes' count, not the sampled 10 x 30 s
    assert s["device_blocks_peak"] == 10 and s["device_blocks_source"].startswith("decode")
    b = RunResult("s", [_rec("s", "c", 0, 0.1)], [MemorySample("s", 0.0, 4, 0)],
                  {"t_end": 60.0, "device_block_s_counted": 80.0})
    m = merge_repeats([a, b])
    assert m.device_block_seconds() == 100.0  # mean over repeats of the counts
    assert m.turns_per_min() == pytest.approx(60.0 * 4 / 90.0)
    assert [p["turns_per_min"] for p in m.meta["per_repeat"]] == [6.0, 1.0]
    # pairs keep their repeat: turn 0 of repeat 2 is ("c~1", 0)
    assert set(m.ttft_by_turn()) == {("c", 0), ("c", 1), ("c", 2), ("c~1", 0)}
    # a repeat without the nodes' count: the ledger for all, and the report says so
    c = RunResult("s", [_rec("s", "c", 0, 0.1)], [MemorySample("s", 0.0, 4, 0)], {"t_end": 10.0})
    mc = merge_repeats([a, c])
    assert "device_block_s_counted" not in mc.meta
    assert mc.summary()["device_blocks_source"].startswith("ledger")


def test_engine_metrics_add_over_repeats() -> None:
    h = {"buckets": [["0.1", 1.0], ["+Inf", 2.0]], "sum": 0.5, "count": 2.0}
    e1 = {"decode": {"queue": h, "itl": h, "preemptions": 1.0, "peak_running": 3.0}}
    e2 = {"decode": {"queue": h, "preemptions": 2.0, "peak_running": 5.0}}
    m = merge_engine([e1, e2])["decode"]
    assert m["queue"] == {"buckets": [["0.1", 2.0], ["+Inf", 4.0]], "sum": 1.0, "count": 4.0}
    assert m["itl"] == h and m["preemptions"] == 3.0 and m["peak_running"] == 5.0
    s = engine_summary({"decode": m})
    assert s["decode_queue_mean_s"] == 0.25 and s["preemptions"] == 3.0
    assert s["prefill_queue_mean_s"] != s["prefill_queue_mean_s"]  # NaN: not recorded
