"""kvtier.ab.compare.same_path: tiered-adaptive against another strategy on only the turns both
took the same way, one paired ratio per path."""

from __future__ import annotations

from kvtier.ab.compare import same_path, same_path_markdown
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
