"""Report generation on synthetic records: files, table contents, plots, simulator error."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvtier.ab.rawdoc import read_raw
from kvtier.ab.records import MemorySample, RunResult, TurnRecord
from kvtier.ab.report import PLOTS, environment_meta, simulation_error, summary_table, write_report


def run(name: str, ttft_scale: float, reuse: bool, conversations: int = 2) -> RunResult:
    turns = []
    for c in range(conversations):
        ctx = 0
        for i in range(3):
            ctx += 300
            reused = ctx - 300 if (reuse and i) else 0
            turns.append(TurnRecord(name, f"c{c}", i, ctx, reused, "dp_read" if reused else "none",
                                    ctx - reused, ttft_scale * (ctx - reused) / 1000,
                                    ttft_scale * ctx / 500, 0.002 if reused else 0.0,
                                    t_start=float(i)))
    mem = [MemorySample(name, float(t), 8 if reuse else 0, 0) for t in range(4)]
    return RunResult(name, turns, mem, {"t_end": 4.0})


def test_report_files_and_numbers(tmp_path):
    results = [run("recompute", 1.0, False), run("device-ttl", 1.0, True)]
    meta = {"model": "tiny", "trace": "synthetic-test", "mode": "live", "conversations": 2,
            "turns": 6, "measurement": {"ttft": "router prefill leg"},
            "command": "kvtier ab --model tiny --time-scale 0.1",
            "adaptive": {"tiered-adaptive": {"kv_recompute_threshold": 96,
                                             "min_cached_token_delta": 32,
                                             "device_retention": False, "decode_ttl_s": None,
                                             "ttl_choice": "-> no device retention"}}}
    md = write_report(results, tmp_path, meta)
    text = md.read_text()
    assert "- Command: `kvtier ab --model tiny --time-scale 0.1`" in text
    assert "min_cached_token_delta=32, no device retention." in text
    for p in PLOTS:
        assert (tmp_path / p).stat().st_size > 1000, p
    assert "synthetic-test" in text and "tiny" in text and "CPUs" in text
    doc = read_raw(tmp_path)
    commit = doc["meta"]["environment"]["git_commit"]  # others may commit meanwhile: use the report's
    assert len(commit) == 40 and commit in text
    assert doc["meta"]["environment"]["cpu_count"] == environment_meta()["cpu_count"]
    env = environment_meta()
    if Path("/proc/cpuinfo").exists():  # Linux: the CPU model is stated (speed depends on it)
        assert env["cpu_model"] and env["cpu_model"] in text
        assert isinstance(env["cpu_isa"], list)
    by = {s["strategy"]: s for s in doc["summary"]}
    assert by["device-ttl"]["device_block_s"] == pytest.approx(32.0)
    assert by["recompute"]["reuse_rate"] == 0.0
    assert by["device-ttl"]["reuse_rate"] == pytest.approx((300 + 600) * 2 / ((600 + 900) * 2))
    assert doc["simulator_error"] is None
    assert "router prefill leg" in text
    # the summary row carries the measured numbers
    row = [ln for ln in summary_table(results).splitlines() if ln.startswith("| device-ttl")][0]
    assert "60.0%" in row


def test_simulator_error_reported(tmp_path):
    meas = [run("recompute", 1.0, False)]
    sim = [run("recompute", 1.5, False)]
    err = simulation_error(meas, sim)
    assert err["recompute"]["matched_turns"] == 6
    assert err["recompute"]["ttft_mape"] == pytest.approx(0.5)
    assert err["recompute"]["e2e_p50_rel_err"] == pytest.approx(0.5)  # e2e scaled alike
    assert "turns_per_min_rel_err" in err["recompute"]
    md = write_report(meas, tmp_path, {"trace": "t"}, simulated=sim, plots=False).read_text()
    assert "Simulator error" in md and "50.0%" in md and "e2e p50 rel. err" in md
    assert not (tmp_path / PLOTS[0]).exists()


def test_repeats_are_shown_each(tmp_path):
    from kvtier.ab.records import merge_repeats

    merged = merge_repeats([run("device-ttl", 1.0, True), run("device-ttl", 3.0, True)])
    text = write_report([run("recompute", 1.0, False), merged], tmp_path,
                        {"trace": "t", "mode": "live"}, plots=False).read_text()
    assert "## Repeats" in text
    row = [ln for ln in text.splitlines() if ln.startswith("| device-ttl |") and " / " in ln][0]
    p50s = [float(x) for x in row.split("|")[2].split("/")]
    assert p50s[1] == pytest.approx(3 * p50s[0], rel=0.01)
    doc = read_raw(tmp_path)
    assert {s["strategy"]: s for s in doc["summary"]}["device-ttl"]["device_block_s"] == \
        pytest.approx(32.0)  # per run, not two runs' worth


def test_report_shows_intervals_verdicts_and_engine_numbers(tmp_path):
    # 3 conversations: intervals resample whole conversations, and 2 resolve nothing
    fast, slow = run("device-ttl", 0.2, True, 3), run("recompute", 1.0, False, 3)
    slow.meta["engine"] = {"decode": {"queue": {"buckets": [["+Inf", 2.0]], "sum": 1.0,
                                                "count": 2.0}, "preemptions": 3.0}}
    slow.turns[1].refusal = "expired"
    md = write_report([slow, fast], tmp_path, {"trace": "t", "mode": "live",
                                               "regime": {"description": "pressure",
                                                          "slo_ttft_p90_s": 0.5}},
                      plots=False).read_text()
    assert "Intervals and paired ratios" in md and "[95% CI]" in md
    assert "| device-ttl | recompute | 9 |" in md and "**faster**" in md
    assert "Regime: pressure" in md and "TTFT p90 SLO (500 ms)" in md
    assert "| recompute | – | – | 500.0 |" in md  # decode queue mean from the engine histogram
    assert "expired" in md
    doc = read_raw(tmp_path)
    assert [p["verdict"] for p in doc["paired_ttft"]] == ["faster"]
    assert doc["intervals"][0]["ttft_p50_s"]["n"] == 9
    assert doc["intervals"][0]["ttft_p50_s"]["clusters"] == 3
    assert {t["status"] for t in doc["targets"]} == {"not evaluated"}


def test_demo_sentences_come_from_the_records():
    from kvtier.ab.live.demo import explain

    # 3 conversations: the paired interval resamples whole conversations, 2 resolve nothing
    text = explain([run("recompute", 1.0, False, 3), run("device-ttl", 0.2, True, 3)], 2048, 32)
    assert "At the longest context (~900 tokens)" in text
    assert "device-ttl/recompute" in text and ": faster)" in text
    assert "the decode node held on average: recompute 0.0 MiB" in text
    assert "decided per turn" not in text  # no leased strategy, no sentence about its choices


def test_demo_says_slower_when_a_strategy_is_slower():
    """A strategy 1.25x as slow as recompute at the longest context is "1.2× slower", never
    "0.8× faster"."""
    from kvtier.ab.live.demo import explain, speed_words

    assert speed_words(1.0, 1.25) == "1.2× slower" and speed_words(1.0, 0.5) == "2.0× faster"
    assert speed_words(1.0, 1.0) == "as fast"
    text = explain([run("recompute", 1.0, False, 3), run("host-p2p", 1.25, False, 3)], 2048, 32)
    assert "host-p2p 1,125 ms (1.2× slower;" in text
    assert "× faster" not in text


def test_demo_says_what_tiered_adaptive_chose():
    from kvtier.ab.live.demo import explain

    text = explain([run("recompute", 1.0, False), _leased()], 2048, 32)
    assert ("tiered-adaptive decided per turn, online: 5 turns held on the decode node, "
            "1 released at once") in text
    assert "4 next turns read from the decode node" in text


def _leased() -> RunResult:
    """tiered-adaptive with decode leases: one conversation held, one released."""
    turns = []
    for conv, holds, bases in (("short", [450.0, 2.5, 2.5, 2.5], ["default", "fleet", "fleet",
                                                                 "conversation"]),
                               ("long", [450.0, 0.0], ["default", "fleet"])):
        for i, (h, b) in enumerate(zip(holds, bases)):
            path = "dp_read" if i and (conv == "short" or i == 1) else "none"
            turns.append(TurnRecord("tiered-adaptive", conv, i, 300 + 80 * i, 256 if i else 0,
                                    path, 44 + 80 * i if i else 300, 0.05, 0.3, t_start=float(i),
                                    hold_s=h, hold_basis=b, hold_samples=i,
                                    hold_why="-> no device retention" if h == 0 else ""))
    turns.append(TurnRecord("tiered-adaptive", "none", 0, 300, 0, "none", 300, 0.05, 0.3))
    mem = [MemorySample("tiered-adaptive", float(t), 10, 0) for t in range(3)]
    return RunResult("tiered-adaptive", turns, mem, {
        "t_end": 3.0, "device_block_s_counted": 42.0,
        "device_blocks_source": "decode metrics (kvtier_decode_*)",
        "router_retention": {"retention": "adaptive", "host_copy": False}})


def test_hold_choices_per_conversation():
    r = _leased()
    ch = r.hold_choices()
    assert set(ch) == {"short", "long"}  # no choice logged: left out
    assert (ch["short"]["held"], ch["short"]["released"]) == (4, 0)
    assert (ch["long"]["held"], ch["long"]["released"]) == (1, 1)
    assert ch["short"]["bases"] == {"default": 1, "fleet": 2, "conversation": 1}
    assert ch["long"]["sequence"] == [(0, 450.0, "default"), (1, 0.0, "fleet")]
    assert ch["short"]["dp_reads"] == 3 and ch["long"]["dp_reads"] == 1
    s = r.summary()
    assert (s["turns_held"], s["turns_released"]) == (5, 1)
    assert s["device_block_s"] == 42.0  # the decode nodes' own count
    assert "turns_held" not in run("device-ttl", 1.0, True).summary()


def test_report_shows_the_online_holds_and_the_nodes_block_seconds(tmp_path):
    meta = {"model": "tiny", "trace": "t", "mode": "live",
            "adaptive": {"tiered-adaptive": {"kv_recompute_threshold": 160,
                                             "min_cached_token_delta": 160, "leases": True,
                                             "retention": "adaptive", "host_copy": False,
                                             "decode_lease_s": 30.0, "decode_ttl_s": 480.0}}}
    text = write_report([run("device-ttl", 1.0, True), _leased()], tmp_path, meta,
                        plots=False).read_text()
    assert "## `tiered-adaptive`: device holds chosen online, per conversation" in text
    assert "| long | 2 | 1 | 1 | 1 | #0: 450 (default), #1: 0 (fleet) |" in text
    assert "| short | 4 | 4 | 0 | 3 |" in text
    assert "5 turns held, 1 released at once; conversations: 1 only held, 0 only released, " \
           "1 both. Device block·s 42 (peak 10 blocks; from decode metrics" in text
    assert "Router: retention=adaptive, host_copy=False." in text
    assert "decode leases (30.0 s), retention adaptive, host copy False" in text
    assert "- Latest release (`long` turn 1): -> no device retention" in text
    assert "`device-ttl`: device holds" not in text  # no leases, no section
    assert "## Plots" not in text  # none written


def test_the_report_shows_each_repeats_cost_refit():
    from kvtier.ab.records import merge_repeats
    from kvtier.ab.report import _refit_section

    def run(refits: int, fixed: float) -> RunResult:
        rc = {"refits": refits, "deployed_s": {"prefill_fixed": 0.025, "dp_read_setup": 0.01},
              "final_s": {"prefill_fixed": fixed, "dp_read_setup": 0.07}}
        return RunResult("tiered-adaptive", [], [], {"router_cost": rc, "t_end": 1.0})

    merged = merge_repeats([run(2, 0.08), run(3, 0.09)])
    assert [rc["refits"] for rc in merged.meta["router_cost"]] == [2, 3]
    text = "\n".join(_refit_section([merged]))
    assert "| tiered-adaptive | 1 | 2 | prefill_fixed 25 → 80 ms, dp_read_setup 10 → 70 ms |" in text
    assert "| tiered-adaptive | 2 | 3 |" in text
    assert _refit_section([RunResult("recompute", [], [], {})]) == []


def test_the_report_shows_each_runs_router_process_and_its_stalls():
    from kvtier.ab.records import merge_repeats
    from kvtier.ab.report import _stalls_section, markdown, stalls_text

    def run(name: str, pid: int, stalls: dict) -> RunResult:
        services = {"router": {"pid": pid, "command": "kvtier router --config r.json"},
                    "indexer": {"pid": pid + 1, "command": "kvtier indexer --config i.json"}}
        return RunResult(name, [], [], {"router_stalls": stalls, "services": services,
                                        "t_end": 1.0})

    quiet = {"count": 0, "total_s": 0.0, "longest_s": None, "warnings": []}
    stalled = {"count": 2, "total_s": 3.5, "longest_s": 2.25,
               "warnings": ["the router's event loop stood still for 1.25 s",
                            "the router's event loop stood still for 2.25 s"]}
    merged = merge_repeats([run("tiered", 101, quiet), run("tiered", 202, stalled)])
    assert [s["count"] for s in merged.meta["router_stalls"]] == [0, 2]
    assert [s["router"]["pid"] for s in merged.meta["services"]] == [101, 202]
    text = "\n".join(_stalls_section([merged, run("recompute", 303, quiet)]))
    assert "## Router event-loop stalls" in text
    assert "| tiered | 1 | 101 | none | – |" in text
    assert ("| tiered | 2 | 202 | 2 stall(s), 3.50 s in all, longest 2.25 s | "
            "the router's event loop stood still for 1.25 s; "
            "the router's event loop stood still for 2.25 s |") in text
    assert "| recompute | 1 | 303 | none | – |" in text
    assert stalls_text({"count": None, "warnings": []}) == "/metrics not readable; none in its log"
    assert _stalls_section([RunResult("recompute", [], [], {})]) == []  # a running stack's
    md = markdown([run("recompute", 303, quiet)], {"trace": "t"}, plots=False)
    assert "| recompute | 1 | 303 | none | – |" in md


def test_the_report_says_when_the_router_switched_to_recomputing():
    from kvtier.ab.records import merge_repeats
    from kvtier.ab.report import _switches_section

    sw = {"ts": 1000.0, "at_s": 42.5, "bucket": "1024-2047", "was": "reuse", "now": "recompute",
          "path": "none", "expected_ms": {"none": 91.0, "dp_read": 158.4},
          "samples": {"none": 9, "dp_read": 12}}

    def run(switches: list) -> RunResult:
        return RunResult("tiered-adaptive", [], [], {"path_switches": switches, "t_end": 1.0})

    merged = merge_repeats([run([]), run([sw])])
    text = "\n".join(_switches_section([merged]))
    assert "## When the router switched between reusing and recomputing" in text
    assert ("| tiered-adaptive | 2 | 42.5 | 1024-2047 | reuse -> recompute (none) | "
            "none 91 ms (n=9), dp_read 158 ms (n=12) |") in text
    assert "| tiered-adaptive | 1 |" not in text  # a repeat without a switch has no row
    assert "| tiered-adaptive | 1 | 42.5 |" in "\n".join(_switches_section([run([sw])]))
    assert _switches_section([run([]), RunResult("recompute", [], [], {})]) == []


def test_the_report_shows_what_each_path_cost_by_context():
    from kvtier.ab.records import TurnRecord
    from kvtier.ab.report import path_cost_section, path_cost_table
    from kvtier.ids import ReusePath

    def turn(strategy: str, prompt: int, path: ReusePath, ttft: float, ok: bool = True):
        return TurnRecord(strategy, "c", 1, prompt, 0, path, prompt, ttft, ttft, ok=ok)

    a = RunResult("host-p2p", [turn("host-p2p", 1500, ReusePath.P2P, 0.070),
                               turn("host-p2p", 1600, ReusePath.P2P, 0.080),
                               turn("host-p2p", 700, ReusePath.NONE, 0.090)], [], {})
    b = RunResult("recompute", [turn("recompute", 1500, ReusePath.NONE, 0.180),
                                turn("recompute", 1500, ReusePath.NONE, 9.0, ok=False)], [], {})
    table = path_cost_table([a, b])
    assert "| context (tokens) | p2p | none | cheapest |" in table
    assert "| 1024-2047 | 75 ms (n=2) | 180 ms (n=1) | p2p |" in table  # a failed turn: out
    assert "| 512-1023 | – | 90 ms (n=1) | none |" in table
    assert path_cost_section([RunResult("recompute", [], [], {})]) == []


def test_an_engines_negative_queue_total_is_not_reported_as_a_mean():
    import math

    from kvtier.ab.records import engine_summary

    bad = {"prefill": {"queue": {"buckets": [["0.3", 182.0], ["+Inf", 182.0]],
                                 "sum": -101677.98, "count": 182.0}}}
    assert math.isnan(engine_summary(bad)["prefill_queue_mean_s"])
    good = {"prefill": {"queue": {"buckets": [["0.3", 2.0], ["+Inf", 2.0]], "sum": 0.01,
                                  "count": 2.0}}}
    assert engine_summary(good)["prefill_queue_mean_s"] == 0.005


def test_the_report_names_the_gpu_nvidia_smi_reports(tmp_path, monkeypatch):
    """Every GPU figure states its card: ``nvidia-smi`` answers where there is one (a stand-in
    script here, which has no GPU); none, no ``gpus`` key."""
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text("#!/bin/sh\necho 'NVIDIA H100 80GB HBM3, 580.159.04'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{smi.parent}:{os.environ['PATH']}")
    env = environment_meta()
    assert env["gpus"] == ["NVIDIA H100 80GB HBM3, 580.159.04"]
    md = write_report([run("recompute", 1.0, False)], tmp_path / "r", {"environment": env},
                      plots=False)
    assert "GPU: NVIDIA H100 80GB HBM3" in md.read_text()
    monkeypatch.setenv("PATH", "/nonexistent")
    assert "gpus" not in environment_meta()


def test_an_interrupted_run_says_so_in_its_report():
    """A run cut short (Ctrl-C, a device budget's timeout) reports only the repeats every
    strategy finished; its header says how many of how many."""
    from kvtier.ab.report import markdown

    r = RunResult("recompute", [], [], {"t_end": 1.0})
    md = markdown([r], {"trace": "t", "repeats_completed": "2 of 3 (interrupted)"}, plots=False)
    assert "**Interrupted run.** Repeats completed: 2 of 3 (interrupted)" in md
    assert "Interrupted" not in markdown([r], {"trace": "t"}, plots=False)
