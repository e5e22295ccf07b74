"""The CPU a run shares with other work (``kvtier.ab.live.cpu``): a fake ``/proc`` (the seam
that cannot be made to hold chosen numbers for real), this machine's own ``/proc``, and the
report's section and glance cell."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvtier.ab.live import cpu
from kvtier.ab.records import RunResult, merge_repeats
from kvtier.ab.report import cpu_section, foreign_worst

HZ = float(os.sysconf("SC_CLK_TCK"))


def _proc(root: Path, busy: int, steal: int, procs: dict[int, tuple[int, int, int]]) -> Path:
    """A /proc with ``busy`` ticks of user time (``steal`` of steal) on 2 cores and
    ``procs``: pid -> (ppid, own ticks, reaped children's ticks)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "stat").write_text(f"cpu  {busy - steal} 0 0 999 5 0 0 {steal} 0 0\n"
                               "cpu0 1 0 0 0 0 0 0 0 0 0\ncpu1 1 0 0 0 0 0 0 0 0 0\n"
                               "intr 0\n")
    for pid, (ppid, own, reaped) in procs.items():
        d = root / str(pid)
        (d / "task" / str(pid)).mkdir(parents=True, exist_ok=True)
        # pid (comm with ) and spaces) state ppid pgrp session tty tpgid flags minflt cminflt
        # majflt cmajflt utime stime cutime cstime ...
        (d / "stat").write_text(f"{pid} (a ) b) S {ppid} 1 1 0 -1 0 0 0 0 0 {own} 0 "
                                f"{reaped} 0 20 0 1 0\n")
    for pid in procs:  # the kernel's /proc/PID/task/TID/children, as the tree walk reads it
        kids = " ".join(str(c) for c, (pp, _, _) in procs.items() if pp == pid)
        (root / str(pid) / "task" / str(pid) / "children").write_text(kids)
    return root


def test_tree_counts_descendants_and_reaped_children_not_strangers(tmp_path: Path) -> None:
    me = os.getpid()
    proc = _proc(tmp_path, 1000, 0, {me: (1, 100, 50), 9001: (me, 200, 0),
                                     9002: (9001, 300, 0), 9003: (1, 7000, 0)})
    assert cpu.tree_cpu(proc=proc) == pytest.approx((100 + 50 + 200 + 300) / HZ)


def test_account_foreign_is_busy_less_ours(tmp_path: Path) -> None:
    me = os.getpid()
    a = cpu.snapshot(_proc(tmp_path / "a", 1000, 10, {me: (1, 100, 0)}))
    b = cpu.snapshot(_proc(tmp_path / "b", 1000 + 30 * int(HZ), 10 + 2 * int(HZ),
                           {me: (1, 100 + 20 * int(HZ), 0)}))
    assert a is not None and b is not None
    b = cpu.CpuSnapshot(a.t + 20.0, b.busy_s, b.steal_s, b.ours_s, b.cores)
    doc = cpu.account(a, b)
    assert doc == {"wall_s": 20.0, "cores": 2, "machine_busy_s": 30.0, "ours_s": 20.0,
                   "foreign_s": 10.0, "foreign_share": 0.25, "steal_s": 2.0,
                   "stack_is_ours": True}
    assert a.cores == 2
    assert cpu.account(None, b) is None


def test_no_proc_records_nothing(tmp_path: Path) -> None:
    assert cpu.snapshot(tmp_path / "missing") is None


def test_this_machine_sees_its_own_work() -> None:
    if not Path("/proc/stat").exists():
        pytest.skip("no /proc here")
    a = cpu.snapshot()
    assert a is not None  # a real /proc that it cannot read is a failure, not a skip
    t = 0
    end = a.t + 0.3
    import time
    while time.monotonic() < end:
        t += 1
    doc = cpu.account(a, cpu.snapshot())
    assert doc is not None and doc["ours_s"] > 0.1
    assert doc["machine_busy_s"] >= doc["ours_s"] - 0.05


def _run(strategy: str, doc: dict[str, object] | None) -> RunResult:
    return RunResult(strategy, [], [], {"t_end": 10.0, **({"cpu": doc} if doc else {})})


def test_report_lists_every_run_and_the_worst_share() -> None:
    c = {"wall_s": 20.0, "cores": 2, "machine_busy_s": 30.0, "ours_s": 20.0,
         "foreign_s": 10.0, "foreign_share": 0.25, "steal_s": 2.0, "stack_is_ours": True}
    quiet = {**c, "foreign_s": 0.4, "foreign_share": 0.01}
    merged = merge_repeats([_run("host-p2p", quiet), _run("host-p2p", c)])
    partial = merge_repeats([_run("recompute", c), _run("recompute", None)])
    lines = cpu_section([merged, partial])
    text = "\n".join(lines)
    assert "| host-p2p | 1 | 20.0 | 30.0 | 20.0 | 0.4 (1.0%) | 2.0 |" in text
    assert "| host-p2p | 2 | 20.0 | 30.0 | 20.0 | 10.0 (25.0%) | 2.0 |" in text
    assert "| recompute | 2 | not recorded |" in text
    assert "largest foreign share of any run: 25.0% (1 run(s) not recorded)" in text
    assert foreign_worst([RunResult("x", [], [], {})]) == "not recorded"
    assert cpu_section([RunResult("x", [], [], {})]) == []
