"""What else used the machine's CPU while a run ran: the machine's busy CPU against this
process's tree.

A live A/B on a 2-core machine measures contention as much as work: the same turns, run while
something else computes beside them, come out slower (session 23: tiered-adaptive ÷ host-p2p
in decode-scarce 1.121 with reports regenerated beside it, 1.014 on an idle machine). So every
run records, from ``/proc`` (Linux; elsewhere nothing is recorded):

- ``machine_busy_s``: the machine's busy CPU over the run (``/proc/stat``: every state but
  idle and iowait; guest time is inside user);
- ``ours_s``: the CPU of this process and every descendant (the harness, and the stack, router
  and indexer it started; found as ``kvtier ab``'s placement finds engine workers), alive or
  reaped by one of them (``/proc/PID/stat``: utime + stime, plus cutime + cstime of reaped
  children);
- ``foreign_s`` = busy - ours: CPU used by anything else on the machine (another benchmark, a
  test run, a build); ``foreign_share``: that over the run's capacity (wall x cores);
- ``steal_s``: CPU the hypervisor gave other guests while this one wanted it.

A running stack (``kvtier ab --stack``) is not this process's tree: its CPU counts as foreign
there (``stack_is_ours`` false).

Threading model: plain functions; the runner calls ``snapshot`` at the start and the end of a
run from its own thread.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.devstack.placement import descendants

PROC = Path("/proc")


@dataclass(frozen=True)
class CpuSnapshot:
    t: float          # monotonic seconds
    busy_s: float     # the machine's busy CPU since boot
    steal_s: float
    ours_s: float     # this process's tree
    cores: int


def _ticks() -> float:
    return float(os.sysconf("SC_CLK_TCK"))


def machine_busy(proc: Path = PROC) -> tuple[float, float, int] | None:
    """(busy seconds, steal seconds, cores) since boot from ``/proc/stat``; None off Linux."""
    try:
        lines = (proc / "stat").read_text().splitlines()
    except OSError:
        return None
    head = lines[0].split()
    if not head or head[0] != "cpu":
        return None
    f = [int(x) for x in head[1:]] + [0] * 10
    user, nice, system, _idle, _iowait, irq, softirq, steal = f[:8]
    cores = sum(1 for ln in lines[1:] if ln.startswith("cpu") and ln[3:4].isdigit())
    hz = _ticks()
    return (user + nice + system + irq + softirq + steal) / hz, steal / hz, max(cores, 1)


def _cpu_s(pid: int, proc: Path) -> float:
    """CPU seconds of one process, own and its reaped children's; 0 when it is gone."""
    try:
        raw = (proc / str(pid) / "stat").read_text()
    except OSError:
        return 0.0
    rest = raw[raw.rfind(")") + 2:].split()  # after "pid (comm) "
    try:
        return sum(int(x) for x in rest[11:15]) / _ticks()  # utime stime cutime cstime
    except (IndexError, ValueError):
        return 0.0


def tree_cpu(root: int | None = None, proc: Path = PROC) -> float:
    """CPU seconds of ``root`` (this process) and every descendant alive now
    (``kvtier.devstack.placement.descendants``), with what each reaped of its children."""
    root = os.getpid() if root is None else root
    return sum(_cpu_s(p, proc) for p in (root, *descendants(root, proc)))


def snapshot(proc: Path = PROC) -> CpuSnapshot | None:
    """Now, or None where ``/proc`` cannot say."""
    m = machine_busy(proc)
    if m is None:
        return None
    return CpuSnapshot(time.monotonic(), m[0], m[1], tree_cpu(proc=proc), m[2])


def account(start: CpuSnapshot | None, end: CpuSnapshot | None,
            stack_is_ours: bool = True) -> dict[str, Any] | None:
    """``meta["cpu"]`` of a run between two snapshots (module docstring); None when either is
    missing."""
    if start is None or end is None:
        return None
    wall = max(end.t - start.t, 1e-9)
    busy = max(end.busy_s - start.busy_s, 0.0)
    ours = max(end.ours_s - start.ours_s, 0.0)
    foreign = max(busy - ours, 0.0)
    return {"wall_s": round(wall, 1), "cores": end.cores, "machine_busy_s": round(busy, 1),
            "ours_s": round(ours, 1), "foreign_s": round(foreign, 1),
            "foreign_share": round(foreign / (wall * end.cores), 4),
            "steal_s": round(max(end.steal_s - start.steal_s, 0.0), 1),
            "stack_is_ours": stack_is_ours}
