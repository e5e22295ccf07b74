"""Trace generator and file formats (kvtier.ab.traces)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from kvtier.ab.traces import (
    FIRST_PLAIN_TOKEN_ID,
    LengthDist,
    SyntheticTraceConfig,
    Trace,
    WaitDist,
    synthetic,
    token_ids,
    turn_plan,
)


def _cfg(**kw) -> SyntheticTraceConfig:
    base = dict(conversations=6, turns=5, seed=7)
    base.update(kw)
    return SyntheticTraceConfig(**base)


def test_same_seed_same_trace_different_seed_different_trace():
    a, b = synthetic(_cfg()), synthetic(_cfg())
    assert a == b
    c = synthetic(_cfg(seed=8))
    assert c != a
    conv = a.conversations[0]
    assert token_ids(conv, 1, 50, a.vocab_size) == token_ids(b.conversations[0], 1, 50, b.vocab_size)
    assert token_ids(conv, 1, 50, a.vocab_size) != token_ids(conv, 2, 50, a.vocab_size)
    assert token_ids(conv, 1, 50, a.vocab_size) != token_ids(a.conversations[1], 1, 50, a.vocab_size)


def test_token_ids_range_and_prefix_stable():
    conv = synthetic(_cfg()).conversations[0]
    ids = token_ids(conv, 0, 2000, 300)
    assert len(ids) == 2000 and min(ids) >= FIRST_PLAIN_TOKEN_ID and max(ids) < 300
    assert all(type(i) is int for i in ids)
    with pytest.raises(ValueError):
        token_ids(conv, 0, 5, FIRST_PLAIN_TOKEN_ID)


def test_save_load_round_trip(tmp_path):
    tr = synthetic(_cfg(strip_reasoning_prob=0.5))
    p = tmp_path / "t.jsonl"
    tr.save(p)
    lines = p.read_text().splitlines()
    assert json.loads(lines[0])["kind"] == "kvtier-trace"
    assert len(lines) == 1 + len(tr.conversations)
    assert Trace.load(p) == tr


def test_load_rejects_unknown_fields_and_bad_counts(tmp_path):
    tr = synthetic(_cfg(conversations=1))
    p = tmp_path / "t.jsonl"
    tr.save(p)
    head, conv = p.read_text().splitlines()
    d = json.loads(conv)
    d["turns"][0]["bogus"] = 1
    p.write_text(head + "\n" + json.dumps(d) + "\n")
    with pytest.raises(ValueError, match="bogus"):
        Trace.load(p)
    d["turns"][0].pop("bogus")
    d["turns"][0]["new_tokens"] = 0
    p.write_text(head + "\n" + json.dumps(d) + "\n")
    with pytest.raises(ValueError, match="bad counts"):
        Trace.load(p)


def test_fixed_wait():
    tr = synthetic(_cfg(wait=WaitDist(kind="fixed", median_s=3.5)))
    for conv in tr.conversations:
        assert conv.turns[0].wait_s == 0.0
        assert all(t.wait_s == 3.5 for t in conv.turns[1:])


def test_lognormal_wait_median_and_long_tail():
    cfg = _cfg(conversations=200, turns=10, wait=WaitDist(median_s=2.0, sigma=1.0, max_s=1e9),
               max_context_tokens=100_000)
    waits = np.array([t.wait_s for c in synthetic(cfg).conversations for t in c.turns[1:]])
    assert len(waits) == 1800
    assert abs(np.median(waits) / 2.0 - 1) < 0.15
    # lognormal sigma=1: p99/median = e^(2.326) ≈ 10.2; mean/median = e^0.5 ≈ 1.65
    assert 6 < np.quantile(waits, 0.99) / np.median(waits) < 16
    assert 1.4 < waits.mean() / np.median(waits) < 1.95
    capped = synthetic(cfg.model_copy(update={"wait": WaitDist(median_s=2.0, sigma=1.0, max_s=5.0)}))
    assert max(t.wait_s for c in capped.conversations for t in c.turns) <= 5.0


def test_strip_reasoning():
    none = synthetic(_cfg(strip_reasoning_prob=0.0))
    assert all(t.strip_reasoning == 0 for c in none.conversations for t in c.turns)
    every = synthetic(_cfg(strip_reasoning_prob=1.0, reasoning_fraction=0.5, max_context_tokens=100_000))
    for conv in every.conversations:
        assert conv.turns[0].strip_reasoning == 0
        for prev, t in zip(conv.turns, conv.turns[1:]):
            assert t.strip_reasoning == max(1, round(prev.response_tokens * 0.5))
        plan = turn_plan(conv)
        for i in range(1, len(plan)):
            # stripped: only the previous prompt is proven; the context shrinks by the strip
            assert plan[i].proven_prefix == plan[i - 1].prompt_tokens
            assert plan[i].prompt_tokens == (plan[i - 1].context_after - conv.turns[i].strip_reasoning
                                             + conv.turns[i].new_tokens)


def test_turn_plan_without_strip():
    conv = synthetic(_cfg()).conversations[0]
    plan = turn_plan(conv)
    assert plan[0].proven_prefix == 0 and plan[0].prompt_tokens == conv.turns[0].new_tokens
    for i in range(1, len(plan)):
        assert plan[i].proven_prefix == plan[i - 1].context_after
        assert plan[i].prompt_tokens == plan[i].proven_prefix + conv.turns[i].new_tokens


@pytest.mark.parametrize("limit", [700, 1500, 4096])
def test_max_context_tokens_respected_and_reached(limit):
    cfg = _cfg(conversations=10, turns=50, max_context_tokens=limit, strip_reasoning_prob=0.3)
    for conv in synthetic(cfg).conversations:
        plan = turn_plan(conv)
        assert all(p.context_after <= limit for p in plan)
        # 50 turns of ~256 tokens always hit the limit; the last turn is shrunk to land near it
        assert plan[-1].context_after >= limit - 2


def test_arrivals():
    waves = synthetic(_cfg(conversations=6, concurrency=2, wave_interval_s=10, stagger_s=1))
    assert [c.start_s for c in waves.conversations] == [0, 1, 10, 11, 20, 21]
    pois = synthetic(_cfg(conversations=400, arrival="poisson", arrival_rate_per_s=2.0))
    starts = [c.start_s for c in pois.conversations]
    assert starts == sorted(starts) and starts[0] == 0
    assert math.isclose(np.mean(np.diff(starts)), 0.5, rel_tol=0.15)


def test_length_dist_bounds():
    rng = np.random.default_rng(0)
    xs = [LengthDist(mean=100, spread=0.5).draw(rng) for _ in range(2000)]
    assert min(xs) >= 50 and max(xs) <= 150 and 95 < np.mean(xs) < 105
    assert LengthDist(mean=7).draw(rng) == 7


def test_config_is_frozen_and_validated():
    cfg = _cfg()
    with pytest.raises(Exception):
        cfg.turns = 3  # type: ignore[misc]
    with pytest.raises(Exception):
        SyntheticTraceConfig(first_prompt_tokens=LengthDist(mean=5000), max_context_tokens=4096)
    with pytest.raises(Exception):
        SyntheticTraceConfig(unknown_key=1)


def test_recorded_trace_converts(tmp_path):
    p = tmp_path / "prod.jsonl"
    rows = [
        {"kind": "kvtier-recorded-trace", "name": "prod", "vocab_size": 32000},
        {"conversation_id": "a", "turns": [
            {"t": 1000.0, "done_t": 1003.0, "new_tokens": 800, "response_tokens": 100},
            {"t": 1010.0, "new_token_ids": [5] * 40, "response_tokens": 20,
             "strip_reasoning": 30},
            {"t": 1020.0, "new_tokens": 10, "response_tokens": 5}]},
        {"conversation_id": "b", "turns": [{"t": 995.5, "new_tokens": 12, "response_tokens": 3}]},
    ]
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    tr = Trace.load(p)
    assert tr.name == "prod" and tr.vocab_size == 32000
    a, b = tr.conversations
    assert (a.start_s, b.start_s) == (4.5, 0.0)
    assert [t.new_tokens for t in a.turns] == [800, 40, 10]
    # wait from the previous turn's done_t when recorded, else from its send time
    assert [t.wait_s for t in a.turns] == [0.0, 7.0, 10.0]
    assert a.turns[1].strip_reasoning == 30
    assert a.seed != b.seed and Trace.load(p) == tr


def test_recorded_trace_without_header_and_errors(tmp_path):
    p = tmp_path / "rec.jsonl"
    p.write_text(json.dumps({"conversation_id": 7, "turns": [{"t": 5, "new_tokens": 3, "response_tokens": 1}]}))
    tr = Trace.load(p)
    assert tr.name == "rec" and tr.conversations[0].conversation_id == "7"
    p.write_text(json.dumps({"conversation_id": "x", "turns": [{"t": 5, "response_tokens": 1}]}))
    with pytest.raises(ValueError, match="new_tokens"):
        Trace.load(p)
    p.write_text(json.dumps({"conversation_id": "x", "turns": [
        {"t": 5, "new_tokens": 3, "response_tokens": 2}, {"t": 6, "new_tokens": 3, "response_tokens": 2,
                                                          "strip_reasoning": 9}]}))
    with pytest.raises(ValueError, match="strips more"):
        Trace.load(p)
