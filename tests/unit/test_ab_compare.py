"""kvtier.ab.compare.same_path: tiered-adaptive against another strategy on only the turns both
took the same way, one paired ratio per path."""

from __future__ import annotations

from kvtier.ab.compare import path_pairs, path_pairs_markdown, same_path, same_path_markdown
from kvtier.ab.records import RunResult, TurnRecord


def _run(name: str, turns: list[tuple[str, int, str, float]]) -> RunResult:
    return RunResult(name, [TurnRecord(name, c, i, 1000, 0, path, 1000, ttft, ttft * 2)
                            for c, i, path, ttft in turns], [], {})


def test_only_turns_of_the_same_path_are_paired_per_path() -> None:
    convs = [f"c{k}" for k in range(8)]
    a = _run("tiered-adaptive", [(c, 1, "p2p", 0.12) for c in convs]
             + [(c, 2, "none", 0.20) for c in convs] + [(c, 3, "dp_read", 0.05) for c in convs])
    b = _run("host-p2p", [(c, 1, "p2p", 0.10) for c in convs]
             + [(c, 2, "none", 0.20) for c in convs] + [(c, 3, "p2p", 0.50) for c in convs])
    got = {path: p for path, p in same_path(a, b)}
    assert set(got) == {"none", "p2p"}  # turn 3 took different paths: not paired
    assert got["p2p"].ratio.n == 8 and abs(got["p2p"].ratio.point - 1.2) < 1e-9
    assert got["p2p"].verdict == "slower"
    assert abs(got["none"].ratio.point - 1.0) < 1e-9 and got["none"].verdict == "not resolved"


def test_the_table_needs_tiered_adaptive_and_another_strategy() -> None:
    a = _run("tiered-adaptive", [("c0", 1, "p2p", 0.1)])
    b = _run("host-p2p", [("c0", 1, "p2p", 0.1)])
    assert same_path_markdown([b]) == "" and same_path_markdown([a]) == ""
    table = same_path_markdown([b, a])
    assert "| host-p2p | p2p | 1 |" in table


def _reused(name: str, turns: list[tuple[str, int, str, int, float]]) -> RunResult:
    return RunResult(name, [TurnRecord(name, c, i, 2000, reused, path, 2000 - reused, ttft,
                                       ttft * 2) for c, i, path, reused, ttft in turns], [], {})


def test_every_pair_of_paths_is_its_own_cell_with_reused_tokens_on_both_sides() -> None:
    convs = [f"c{k}" for k in range(8)]
    # turn 1: a reads a host copy (block-aligned) where b reads the device copy (to the token)
    a = _reused("tiered-adaptive", [(c, 1, "p2p", 1600, 0.104) for c in convs]
                + [(c, 2, "none", 0, 0.20) for c in convs])
    b = _reused("device-ttl", [(c, 1, "dp_read", 1616, 0.100) for c in convs]
                + [(c, 2, "none", 0, 0.20) for c in convs]
                + [("c9", 1, "dp_read", 1616, 0.1)])  # a never ran it: not paired
    cells = {(pp.path_a, pp.path_b): pp for pp in path_pairs(a, b)}
    assert set(cells) == {("p2p", "dp_read"), ("none", "none")}
    pp = cells[("p2p", "dp_read")]
    assert pp.paired.ratio.n == 8 and abs(pp.paired.ratio.point - 1.04) < 1e-9
    assert (pp.reused_a, pp.reused_b) == (1600, 1616)
    table = path_pairs_markdown([b, a], "device-ttl")
    assert "| p2p | dp_read | 8 | 1.040 [" in table and "| 1600 / 1616 |" in table
    assert path_pairs_markdown([b, a], None) == "" and path_pairs_markdown([a], "device-ttl") == ""
