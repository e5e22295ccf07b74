"""Sizing at a TTFT SLO (kvtier.ab.sizing, ``kvtier ab --simulate --slo-ttft-p90``)."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from kvtier.ab.rawdoc import read_raw
from kvtier.ab.regimes import RegimeSettings, save_regime
from kvtier.ab.simulator import FleetSpec, simulate
from kvtier.ab.sizing import SizingAnswer, scale_trace, size_for_slo
from kvtier.ab.stats import nearest_rank
from kvtier.ab.traces import ConversationSpec, Trace, TurnSpec, token_ids
from kvtier.cli import build_parser
from kvtier.cost.model import CostModel, LinkModel
from kvtier.ids import ConversationId

BS = 32
FLEET = FleetSpec(prefill=1, decode=1, device_blocks_per_decode=100_000,
                  host_bytes_per_pod=1 << 34, block_size=BS)


def _cost(prefill_b: float = 1e-3) -> CostModel:
    """Prefill expensive (1 ms/token by default), reads cheap."""
    link = LinkModel(setup_s=0.002, bytes_per_s=4e9)
    return CostModel(kv_bytes_per_token=2048, prefill_a_s=0.01, prefill_b_s_per_token=prefill_b,
                     prefill_c_s_per_token_ctx=0.0, decode_s_per_token=0.002, block_size=BS,
                     reads={"dp_read": link, "p2p": link})


def _trace(n_conv: int = 3, turns: int = 4, wait: float = 2.0, seeds: list[int] | None = None) -> Trace:
    convs = []
    for c in range(n_conv):
        ts = [TurnSpec(600, 40, 0.0)] + [TurnSpec(200, 40, wait) for _ in range(turns - 1)]
        convs.append(ConversationSpec(ConversationId(f"c{c}"), c * 0.5,
                                      (seeds or [100 + i for i in range(n_conv)])[c], ts))
    return Trace("hand", 4096, convs)


def test_scaling_keeps_each_copys_turns_and_gives_distinct_ids_and_seeds():
    tr = _trace(n_conv=3, seeds=[7, 7, 9])  # c0 and c1 share a seed: their copies must too
    s = scale_trace(tr, 7, stagger_s=0.1)
    ids = [c.conversation_id for c in s.conversations]
    assert ids == ["c0", "c1", "c2", "c0~1", "c1~1", "c2~1", "c0~2"]
    assert len(set(ids)) == 7
    for i, c in enumerate(s.conversations):
        orig = tr.conversations[i % 3]
        assert c.turns == orig.turns
        assert c.start_s == pytest.approx(orig.start_s + (i // 3) * 0.1)
    by = {c.conversation_id: c for c in s.conversations}
    assert by["c0"] == tr.conversations[0]  # the originals are unchanged
    assert len({by[k].seed for k in ("c0", "c0~1", "c0~2", "c2", "c2~1")}) == 5
    assert by["c0~1"].seed == by["c1~1"].seed  # shared a prefix before, still do
    assert token_ids(by["c0~1"], 0, 16, 4096) != token_ids(by["c0"], 0, 16, 4096)
    assert scale_trace(tr, 7, stagger_s=0.1) == s  # deterministic
    assert scale_trace(tr, 1).conversations == tr.conversations[:1]
    with pytest.raises(ValueError):
        scale_trace(tr, 0)


def test_reuse_holds_at_least_as_many_sessions_as_recompute_when_prefill_is_expensive():
    ans = size_for_slo(_trace(), ["recompute", "device-ttl", "host-p2p"], FLEET, _cost(),
                       slo_ttft_p90_s=4.0, max_sessions=64)
    held = {s.strategy: s.sessions for s in ans.strategies}
    assert 0 < held["recompute"] < 64, held
    assert held["device-ttl"] >= held["recompute"]
    assert held["host-p2p"] > held["recompute"]
    assert "recompute" not in {s.strategy for s in ans.best()}
    for s in ans.strategies:  # the answer is a boundary: met there, missed one session more
        assert s.at is not None and s.next is not None and not s.capped
        assert s.at.sessions == s.sessions and s.next.sessions == s.sessions + 1
        assert s.at.ttft_p90_s <= 4.0 < s.next.ttft_p90_s
        # the p90 is the report's: nearest rank over every turn of that simulation
        r = simulate(scale_trace(_trace(), s.sessions), s.strategy, FLEET, _cost())
        assert s.at.ttft_p90_s == nearest_rank([t.ttft_s for t in r.turns], 0.9)
        assert s.at.device_block_s == pytest.approx(r.device_block_seconds())
        assert s.at.host_gb_s == pytest.approx(r.host_gb_seconds())
        assert s.ttft_p90_ci is not None and s.ttft_p90_ci[0] <= s.at.ttft_p90_s <= s.ttft_p90_ci[1]
    md = ans.markdown()
    assert "| strategy | sessions held at SLO |" in md and md.count("\n| `") == 3
    assert f"`host-p2p` holds the most: {held['host-p2p']} concurrent sessions" in md \
        or "hold the most" in md


def test_a_tighter_slo_never_holds_more_sessions():
    tr, cost = _trace(), _cost()
    held = [{s.strategy: s.sessions for s in size_for_slo(
        tr, ["recompute", "host-p2p"], FLEET, cost, slo, max_sessions=64).strategies}
        for slo in (8.0, 4.0, 1.0)]
    for name in ("recompute", "host-p2p"):
        assert held[0][name] >= held[1][name] >= held[2][name], held
    assert held[0]["recompute"] > held[2]["recompute"]


def test_an_slo_no_size_meets_gives_zero_with_the_p90_at_one_session():
    tr, cost = _trace(), _cost()
    ans = size_for_slo(tr, ["recompute", "host-p2p"], FLEET, cost, slo_ttft_p90_s=1e-4)
    one = simulate(scale_trace(tr, 1), "recompute", FLEET, cost)
    for s in ans.strategies:
        assert s.sessions == 0 and s.at is None and s.ttft_p90_ci is None and not s.capped
        assert s.next is not None and s.next.sessions == 1 and s.next.ttft_p90_s > 1e-4
        assert [p.sessions for p in s.simulated] == [1]
    assert ans.strategies[0].next.ttft_p90_s == nearest_rank([t.ttft_s for t in one.turns], 0.9)
    assert "No strategy meets TTFT p90 ≤ 0.0001 s even at 1 session." in ans.markdown()


def test_a_generous_slo_stops_at_the_cap():
    ans = size_for_slo(_trace(), ["host-p2p"], FLEET, _cost(), slo_ttft_p90_s=1e6, max_sessions=5)
    s = ans.strategies[0]
    assert s.sessions == 5 and s.capped and s.next is None
    assert [p.sessions for p in s.simulated] == [1, 2, 4, 5]
    assert "≥ 5 (cap)" in ans.markdown() and "at least 5 (the search cap)" in ans.markdown()


def test_scarce_decode_memory_holds_fewer_sessions_and_says_turns_waited():
    """A decode that fits ~2 conversations' contexts (600 + 3 x 240 tokens ~ 42 blocks each),
    under device-ttl (retained turns pin their blocks until read or expired, as in vLLM),
    makes turns wait for blocks: fewer sessions at the same SLO, and the report says so."""
    tr, cost = _trace(), _cost()
    roomy = size_for_slo(tr, ["device-ttl"], FLEET, cost, slo_ttft_p90_s=4.0, max_sessions=64)
    small = FleetSpec(prefill=1, decode=1, device_blocks_per_decode=90,
                      host_bytes_per_pod=1 << 34, block_size=BS)
    tight = size_for_slo(tr, ["device-ttl"], small, cost, slo_ttft_p90_s=4.0, max_sessions=64)
    assert tight.strategies[0].sessions < roomy.strategies[0].sessions, (tight, roomy)
    at = tight.strategies[0].at
    assert at is not None and at.decode_queued > 0 and at.decode_wait_s > 0
    assert "waited for decode KV blocks" in tight.report()
    assert "waited for decode KV blocks" not in roomy.report()


# ------------------------------------------------------------------------- the CLI ----


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "hidden_size": 128, "max_position_embeddings": 4096}))
    return d


def _kvtier(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


def _cost_file(tmp_path) -> str:
    p = tmp_path / "cost.json"
    p.write_text(_cost(prefill_b=2e-4).model_dump_json())
    return str(p)


def test_cli_sizes_after_the_simulation(tmp_path, model_dir, capsys):
    trace = tmp_path / "t.jsonl"
    _trace(n_conv=2, turns=3).save(trace)
    out = tmp_path / "out"
    rc = _kvtier(["ab", "--simulate", "--trace", str(trace), "--model", str(model_dir),
                  "--strategies", "recompute,host-p2p", "--cost", _cost_file(tmp_path),
                  "--slo-ttft-p90", "0.5", "--max-sessions", "16", "--no-progress",
                  "--out", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "| strategy | sessions held at SLO |" in printed and "sizing.md" in printed
    ans = msgspec.json.decode((out / "sizing.json").read_bytes(), type=SizingAnswer)
    assert ans.slo_ttft_p90_s == 0.5 and ans.max_sessions == 16 and ans.conversations == 2
    assert [s.strategy for s in ans.strategies] == ["recompute", "host-p2p"]
    assert all(s.sessions >= 1 for s in ans.strategies)
    md = (out / "sizing.md").read_text()
    assert md.startswith("# Sizing at the TTFT SLO (simulated)") and "`host-p2p`" in md
    assert (out / "report.md").exists()  # the normal simulated report is still written
    assert "--slo-ttft-p90 0.5" in read_raw(out)["meta"]["command"]


def test_cli_takes_the_slo_and_decode_capacity_from_a_regime(tmp_path, model_dir):
    trace = tmp_path / "regime.jsonl"
    save_regime(_trace(n_conv=2, turns=3), RegimeSettings(slo_ttft_p90_s=0.5, decode_num_blocks=64),
                trace)
    out = tmp_path / "out"
    assert _kvtier(["ab", "--simulate", "--trace", str(trace), "--model", str(model_dir),
                    "--strategies", "recompute", "--cost", _cost_file(tmp_path),
                    "--max-sessions", "4", "--no-progress", "--out", str(out)]) == 0
    ans = msgspec.json.decode((out / "sizing.json").read_bytes(), type=SizingAnswer)
    assert ans.slo_ttft_p90_s == 0.5 and ans.fleet["device_blocks_per_decode"] == 64


def test_cli_without_an_slo_does_not_size(tmp_path, model_dir):
    trace = tmp_path / "t.jsonl"
    _trace(n_conv=1, turns=2).save(trace)
    out = tmp_path / "out"
    assert _kvtier(["ab", "--simulate", "--trace", str(trace), "--model", str(model_dir),
                    "--strategies", "recompute", "--cost", _cost_file(tmp_path),
                    "--no-progress", "--out", str(out)]) == 0
    assert (out / "report.md").exists() and not (out / "sizing.json").exists()


@pytest.mark.parametrize("argv, message", [
    (["--slo-ttft-p90", "5"], "needs --simulate"),
    (["--simulate", "--slo-ttft-p90", "0"], "must be > 0"),
    (["--simulate", "--slo-ttft-p90", "-1"], "must be > 0"),
    (["--simulate", "--slo-ttft-p90", "5", "--max-sessions", "0"], "must be >= 1"),
])
def test_cli_refuses_a_bad_slo(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        _kvtier(["ab", "--model", "/no/such/model", *argv])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


SIZING_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "sizing" \
    / "2026-12-06-sim-regime-decode-scarce"


def test_the_committed_sizing_is_what_its_command_writes(tmp_path):
    """benchmarks/sizing/...: the command in its report.json.gz, rerun, writes the same
    sizing.json, and the sizing answer AB.md quotes is that file's (issue 30: the sizing the
    text cites has committed output)."""
    command = read_raw(SIZING_DIR)["meta"]["command"].split()
    assert command[:2] == ["kvtier", "ab"] and "--simulate" in command
    out = command.index("--out") + 1
    command[out] = str(tmp_path / "sizing")
    assert _kvtier(command[1:]) == 0
    assert (tmp_path / "sizing" / "sizing.json").read_bytes() \
        == (SIZING_DIR / "sizing.json").read_bytes()
    answer = (SIZING_DIR / "sizing.md").read_text().split("\n\n")[3]
    assert "concurrent sessions at TTFT p90" in answer
    assert answer in (SIZING_DIR.parents[1] / "AB.md").read_text()
