"""kvtier.ab.link: the D->P link's bandwidth as a run's reads saw it, beside a device copy."""

from __future__ import annotations

import json
from pathlib import Path

from kvtier.ab.link import ANCHOR_NAME, dp_reads, link_section, read_anchor
from kvtier.ab.records import RunResult, TurnRecord

KVB = 131072


def _run(name: str, turns: list[tuple[str, int, float]]) -> RunResult:
    """turns: (path, reused tokens, transfer seconds)."""
    return RunResult(name, [TurnRecord(name, f"c{i}", 1, 20000, reused, path, 20000 - reused,
                                       0.2, 1.0, xfer)
                            for i, (path, reused, xfer) in enumerate(turns)], [], {})


def test_bandwidth_is_bytes_read_over_nixl_time() -> None:
    r = _run("device-ttl", [("dp_read", 10000, 0.05), ("dp_read", 6000, 0.03), ("none", 0, 0.0)])
    [f] = dp_reads([r], KVB)
    assert (f.turns, f.tokens) == (2, 16000)
    assert abs(f.gbytes - 16000 * KVB / 1e9) < 1e-12 and abs(f.seconds - 0.08) < 1e-12
    assert abs(f.gb_s - 16000 * KVB / 1e9 / 0.08) < 1e-9


def test_a_strategy_that_also_read_a_peer_or_measured_no_time_gives_no_figure() -> None:
    # vLLM exports one transfer total: a run that also pulled from a peer cannot be split
    mixed = _run("tiered-adaptive", [("dp_read", 10000, 0.05), ("p2p", 8000, 0.04)])
    untimed = _run("device-ttl", [("dp_read", 10000, 0.0)])
    none = _run("recompute", [("none", 0, 0.0)])
    assert dp_reads([mixed, untimed, none], KVB) == []
    assert link_section([mixed, untimed, none], {"kv_bytes_per_token": KVB}) == []


def test_section_sets_the_reads_beside_the_device_copy(tmp_path: Path) -> None:
    (tmp_path / ANCHOR_NAME).write_text(json.dumps(
        {"bytes": 1 << 30, "gb_s": 1500.0, "ms": [0.7] * 9, "device": "NVIDIA H100"}))
    anchor = read_anchor(tmp_path)
    r = _run("device-ttl", [("dp_read", 10000, 0.1)])
    meta = {"kv_bytes_per_token": KVB,
            "environment": {"ucx_env": {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "on"}}}
    text = "\n".join(link_section([r], meta, anchor))
    gb_s = 10000 * KVB / 1e9 / 0.1
    assert f"| device-ttl | 1 | 10,000 | 1.31 | 0.100 | {gb_s:.3g} | {100 * gb_s / 1500:.2g}% |" \
        in text
    assert "1,500 GB/s" in text and "NVIDIA H100" in text
    assert "`UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on`" in text


def test_a_missing_or_broken_anchor_is_none(tmp_path: Path) -> None:
    assert read_anchor(tmp_path) is None
    (tmp_path / ANCHOR_NAME).write_text("{not json")
    assert read_anchor(tmp_path) is None
    (tmp_path / ANCHOR_NAME).write_text(json.dumps({"gb_s": 0}))
    assert read_anchor(tmp_path) is None


def test_peer_fetches_are_mean_ms_per_fetch_by_phase_over_every_repeat() -> None:
    from kvtier.ab.link import peer_fetch_table
    from kvtier.ab.records import merge_repeats

    def rep(fetches: float, hold: float, read: float) -> RunResult:
        r = _run("tiered-adaptive", [("p2p", 8000, 0.0)])
        r.meta["t_end"] = 10.0
        r.meta["peer_fetch"] = {"prefill-0": {"fetches": fetches, "handshake": 0.0,
                                              "hold": hold, "read": read, "release": 0.0},
                                "decode-0": {"fetches": 0.0, "hold": 0.0}}
        return r

    merged = merge_repeats([rep(10, 0.005, 0.040), rep(30, 0.015, 0.120)])
    assert len(merged.meta["peer_fetch"]) == 2  # each repeat's own counts
    table = peer_fetch_table([merged, _run("recompute", [("none", 0, 0.0)])])
    # 40 fetches: hold 20 ms and read 160 ms in all -> 0.50 and 4.00 ms per fetch; the decode
    # node fetched nothing and recompute has no host tier: neither has a row.
    assert table[-1] == "| tiered-adaptive | prefill-0 | 40 | 0.00 | 0.50 | 4.00 | 0.00 | 4.50 |"
    assert sum(line.startswith("| tiered") for line in table) == 1
    assert "handshake | hold | read | release | total" in table[2]
    single = rep(4, 0.002, 0.010)  # one repeat: the meta is the run's own dict
    assert peer_fetch_table([single])[-1].startswith("| tiered-adaptive | prefill-0 | 4 | ")
    assert peer_fetch_table([_run("host-p2p", [("p2p", 8000, 0.0)])]) == []
