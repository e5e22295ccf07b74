"""Each retention strategy's config starts a real vLLM-CPU stack and serves a short
conversation through the router; the A/B report is generated from those real runs.

Strategies whose stack specs are equal (tiered, tiered-adaptive without a cost model)
share one stack through ``stack_pool``.
"""

from __future__ import annotations

import json

import pytest

from kvtier.ab.live.runner import MEASUREMENT, RunOptions, run_strategy, stack_spec_for
from kvtier.ab.records import RunResult
from kvtier.ab.report import PLOTS, write_report
from kvtier.ab.strategies import STRATEGY_NAMES, builtin
from kvtier.ab.traces import ConversationSpec, Trace, TurnSpec

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

RESULTS: dict[str, RunResult] = {}


def short_trace() -> Trace:
    convs = [ConversationSpec(f"c{k}", 0.3 * k, 100 + k,
                              [TurnSpec(200, 16, 0.0), TurnSpec(96, 16, 0.5),
                               TurnSpec(64, 16, 0.5)])
             for k in range(2)]
    return Trace("e2e-short", 4096, convs)


@pytest.mark.parametrize("name", STRATEGY_NAMES)
def test_strategy_starts_and_serves(name, stack_pool, tiny_model, tmp_path):
    spec = builtin(name)
    stack = stack_pool.get(stack_spec_for(spec, tiny_model))
    opts = RunOptions(model=tiny_model, kv_bytes_per_token=2048, log_dir=tmp_path,
                      progress=False, sample_interval_s=0.2)
    res = run_strategy(spec, short_trace(), opts, stack=stack)
    RESULTS[name] = res
    assert len(res.turns) == 6
    assert [t.error for t in res.turns if not t.ok] == []
    for t in res.turns:
        assert t.response_tokens == 16 and 0 < t.ttft_s < t.e2e_s
    prompts = sorted(t.prompt_tokens for t in res.turns if t.turn == 2)
    assert prompts == [200 + 16 + 96 + 16 + 64] * 2
    follow = res.follow_ups
    if name == "recompute":
        assert res.reuse_rate() == 0.0 and res.device_block_seconds() == 0.0
        assert all(t.reuse_path == "none" and t.computed_tokens == t.prompt_tokens
                   for t in res.turns)
    if spec.dp_reuse:
        # the previous turn's KV is read from the decode node (TTL far longer than the waits)
        assert all(t.reuse_path == "dp_read" and t.reused_tokens >= 192 for t in follow), \
            [(t.reuse_path, t.reused_tokens, t.outcome) for t in follow]
        assert res.device_block_seconds() > 0
    if spec.host_tier and not spec.dp_reuse:
        assert res.device_block_seconds() == 0.0
        assert all(t.reused_tokens > 0 for t in follow), [(t.reuse_path, t.reused_tokens)
                                                          for t in follow]
        assert max(s.host_bytes_held for s in res.memory) > 0


def test_adaptive_short_ttl_hands_long_waits_to_the_host_copy(stack_pool, tiny_model, tmp_path):
    """tiered-adaptive with the shortest device TTL the cost model picks (1 s: a device read pays
    only for the shortest waits; when it pays for none, the strategy keeps nothing on the device
    and deploys like host-p2p). Waits of 3 s outlive it, so every follow-up is served from a
    host tier, and the device holds each turn for ~1 s only."""
    spec = builtin("tiered-adaptive").with_ttl(1.0)
    stack = stack_pool.get(stack_spec_for(spec, tiny_model))
    convs = [ConversationSpec(f"w{k}", 0.3 * k, 200 + k,
                              [TurnSpec(200, 16, 0.0), TurnSpec(96, 16, 3.0),
                               TurnSpec(64, 16, 3.0)]) for k in range(2)]
    opts = RunOptions(model=tiny_model, kv_bytes_per_token=2048, log_dir=tmp_path,
                      progress=False, sample_interval_s=0.2)
    res = run_strategy(spec, Trace("e2e-waits", 4096, convs), opts, stack=stack)
    assert [t.error for t in res.turns if not t.ok] == []
    follow = res.follow_ups
    assert len(follow) == 4
    # Served by a host tier — the decode node's (p2p) or the prefill's own copy of its last
    # prompt (local), whichever holds more — never by the device, whose TTL has passed.
    assert all(t.reuse_path in ("p2p", "local") and t.reused_tokens >= 192 for t in follow), \
        [(t.reuse_path, t.reused_tokens) for t in follow]
    # each of the 6 turns is held for at most the TTL: blocks x 1 s, far below the 3 s waits
    blocks_per_turn = max(s.device_blocks_retained for s in res.memory)
    assert 0 < res.device_block_seconds() <= 6 * blocks_per_turn * 1.5


def test_report_from_real_runs(tmp_path):
    if len(RESULTS) < 2:
        pytest.skip("needs the strategy runs of this module")
    results = [RESULTS[n] for n in STRATEGY_NAMES if n in RESULTS]
    md = write_report(results, tmp_path, {"model": "tiny", "trace": "e2e-short", "mode": "live",
                                          "measurement": MEASUREMENT})
    for p in PLOTS:
        assert (tmp_path / p).stat().st_size > 1000
    doc = json.loads((tmp_path / "report.json").read_text())
    assert {s["strategy"] for s in doc["summary"]} == set(RESULTS)
    by = {s["strategy"]: s for s in doc["summary"]}
    if "recompute" in by and "device-ttl" in by:
        assert by["device-ttl"]["computed_tokens"] < by["recompute"]["computed_tokens"]
    assert "e2e-short" in md.read_text()
