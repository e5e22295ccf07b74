"""Fitting the cost model to run records (kvtier.ab.fit): service times and recovery of a known model."""

from __future__ import annotations

import pytest

from kvtier.ab.fit import fit_from_records, fit_shared_host, service_times
from kvtier.ab.records import RunResult, TurnRecord
from kvtier.ab.simulator import FleetSpec, simulate
from kvtier.ab.strategies import builtin
from kvtier.ab.traces import ConversationSpec, Trace, TurnSpec
from kvtier.cost.model import CostModel, LinkModel
from kvtier.ids import ConversationId

BS = 32


def _t(conv, turn, t0, ttft):
    return TurnRecord("s", conv, turn, 100, 0, "none", 100, ttft, ttft + 1, 0.0, t0)


def test_service_time_processor_sharing():
    # a: [0, 4); b: [2, 4) overlaps a's second half; c: [10, 11) alone
    r = RunResult("s", [_t("a", 0, 0.0, 4.0), _t("b", 0, 2.0, 2.0), _t("c", 0, 10.0, 1.0)])
    svc = service_times(r)
    assert svc[("a", 0)] == pytest.approx(2.0 + 2.0 / 2)
    assert svc[("b", 0)] == pytest.approx(1.0)
    assert svc[("c", 0)] == pytest.approx(1.0)


def test_fit_recovers_a_known_cost_model():
    truth = CostModel(kv_bytes_per_token=4096, prefill_a_s=0.05, prefill_b_s_per_token=3e-4,
                      prefill_c_s_per_token_ctx=4e-8, decode_s_per_token=0.01, block_size=BS,
                      reads={"dp_read": LinkModel(setup_s=0.2, bytes_per_s=2e8),
                             "p2p": LinkModel(setup_s=0.01, bytes_per_s=1e9)})
    # conversations far apart: no prefill overlaps, so the records are the model exactly
    convs = [ConversationSpec(ConversationId(f"c{k}"), 500.0 * k, 10 + k,
                              [TurnSpec(300 + 200 * k, 20, 0.0)]
                              + [TurnSpec(50 + 70 * j, 20, 2.0) for j in range(5)])
             for k in range(6)]
    trace = Trace("fit", 4096, convs)
    fleet = FleetSpec(prefill=1, decode=1, device_blocks_per_decode=10**6,
                      host_bytes_per_pod=1 << 34, block_size=BS)
    runs = [simulate(trace, builtin(n), fleet, truth) for n in ("recompute", "device-ttl",
                                                                  "host-p2p")]
    got = fit_from_records(runs, truth.kv_bytes_per_token, BS)
    assert got.prefill_a_s == pytest.approx(truth.prefill_a_s, rel=0.05)
    assert got.prefill_b_s_per_token == pytest.approx(truth.prefill_b_s_per_token, rel=0.05)
    assert got.prefill_c_s_per_token_ctx == pytest.approx(truth.prefill_c_s_per_token_ctx, rel=0.05)
    for path in ("dp_read", "p2p"):
        assert got.reads[path].setup_s == pytest.approx(truth.reads[path].setup_s, rel=0.05,
                                                        abs=1e-3)
        assert got.reads[path].bytes_per_s == pytest.approx(truth.reads[path].bytes_per_s,
                                                            rel=0.05)
    assert got.decode_s_per_token == pytest.approx(truth.decode_s_per_token, rel=0.05)
    assert any("joint fit" in n for n in got.fit_notes)


def test_a_path_nobody_took_is_borrowed_and_said():
    truth = CostModel(kv_bytes_per_token=4096, prefill_a_s=0.05, prefill_b_s_per_token=3e-4,
                      block_size=BS, reads={"dp_read": LinkModel(setup_s=0.2, bytes_per_s=2e8),
                                            "p2p": LinkModel(setup_s=0.2, bytes_per_s=2e8)})
    convs = [ConversationSpec(ConversationId(f"c{k}"), 100.0 * k, k,
                              [TurnSpec(200 + 100 * k, 8, 0.0), TurnSpec(64, 8, 1.0)])
             for k in range(4)]
    runs = [simulate(Trace("x", 4096, convs), builtin(n), FleetSpec(block_size=BS), truth)
            for n in ("recompute", "device-ttl")]
    got = fit_from_records(runs, 4096, BS)
    assert got.reads["p2p"] == got.reads["dp_read"]
    assert any("p2p: borrowed from dp_read" in n for n in got.fit_notes)


def test_calibrate_simulate_recovers_the_prior(capsys):
    """`kvtier calibrate --simulate`: the sweep, run through the simulator with the built-in
    prior, is fitted back to that prior (the CLI path, end to end)."""
    from kvtier.cli import main

    assert main(["calibrate", "--simulate"]) == 0
    out = capsys.readouterr().out
    assert "10 ms + 200 us*new + 20 ns*new*(cached+new/2)" in out
    assert "read dp_read: setup 2 ms, 4 GB/s" in out


def test_service_time_takes_a_busy_decode_out_on_a_shared_host():
    # a: prefill [0, 4); its decode [4, 10). b: prefill [5, 7) runs beside a's decode
    r = RunResult("s", [TurnRecord("s", "a", 0, 100, 0, "none", 100, 4.0, 10.0, 0.0, 0.0),
                        TurnRecord("s", "b", 0, 100, 0, "none", 100, 2.0, 3.0, 0.0, 5.0)])
    assert service_times(r)[("b", 0)] == pytest.approx(2.0)
    svc = service_times(r, decode_interference=1.0)
    assert svc[("b", 0)] == pytest.approx(1.0)  # half speed beside the decode
    assert svc[("a", 0)] == pytest.approx(4.0)  # nothing decoded during a's prefill
    with pytest.raises(ValueError):
        service_times(r, decode_interference=-1.0)


def test_shared_host_fit_recovers_a_known_interference():
    """Simulate a shared host with a known slowdown per busy decode, then fit it back: the
    interference and the prefill costs both come out (no noise, so the grid's value wins)."""
    truth = CostModel(kv_bytes_per_token=4096, prefill_a_s=0.05, prefill_b_s_per_token=3e-4,
                      prefill_c_s_per_token_ctx=4e-8, decode_s_per_token=0.01, block_size=BS,
                      reads={"dp_read": LinkModel(setup_s=0.02, bytes_per_s=2e9),
                             "p2p": LinkModel(setup_s=0.02, bytes_per_s=2e9)})
    # conversations close together: prefills overlap each other and the decodes
    convs = [ConversationSpec(ConversationId(f"c{k}"), 0.3 * k, 10 + k,
                              [TurnSpec(300 + 150 * k, 60, 0.0)]
                              + [TurnSpec(80 + 40 * j, 60, 0.2 + 0.1 * k) for j in range(6)])
             for k in range(8)]
    trace = Trace("shared", 4096, convs)
    fleet = FleetSpec(prefill=1, decode=1, device_blocks_per_decode=10**6,
                      host_bytes_per_pod=1 << 34, block_size=BS, decode_interference=1.5)
    runs = [simulate(trace, builtin(n), fleet, truth) for n in ("recompute", "host-p2p")]
    got = fit_shared_host(runs, truth.kv_bytes_per_token, BS)
    assert got.decode_interference == pytest.approx(1.5)
    assert got.cost.prefill_b_s_per_token == pytest.approx(truth.prefill_b_s_per_token, rel=0.05)
    assert got.log_rms < dict(got.tried)[0.0]  # ignoring the host explains it worse
    assert any("shared host" in n for n in got.cost.fit_notes)
