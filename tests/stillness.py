"""How long this machine stood still: wall time in which the kernel ran no CPU at all.

The kernel accounts every tick of every CPU to one state (``/proc/stat``: user, nice,
system, idle, iowait, irq, softirq, steal). Over an interval of ``dt`` seconds on ``n`` CPUs
those add up to ``n * dt`` while the machine runs, whether busy or idle. On the 2-core test
VM they did not, for tens of seconds at a time, during the deploy test (session 19,
``benchmarks/stalls/README.md``): over 298 s of one failing run, 124 s were accounted to no
state on either CPU, with no steal reported, while every process (engines, routers, Redis,
the indexer, a sampler reading ``/proc``) fell behind together and the kernel logged
workqueue lockups with no worker running. The virtual machine itself was stopped; nothing in
it ran, so a lease or a timeout measured on the monotonic clock expired meanwhile.

``Stillness`` measures that: ``lost_s()`` is the wall time since it was made in which the
machine ran nothing (per CPU, averaged). Time a process merely waited for a CPU is accounted
(to whoever ran) and does not count.
"""

from __future__ import annotations

import os
import time

HZ = os.sysconf("SC_CLK_TCK")


def _ticks() -> tuple[float, int, int]:
    """(monotonic seconds, ticks of all CPUs in all states, the CPU count) now."""
    with open("/proc/stat") as f:
        lines = f.read().splitlines()
    total = sum(int(x) for x in lines[0].split()[1:9])
    cpus = sum(1 for ln in lines[1:] if ln.startswith("cpu"))
    return time.monotonic(), total, max(cpus, 1)


class Stillness:
    def __init__(self) -> None:
        self.t0, self.ticks0, self.cpus = _ticks()

    def lost_s(self) -> float:
        """Seconds since this was made in which the machine ran nothing (0 when it ran)."""
        t, ticks, _ = _ticks()
        accounted = (ticks - self.ticks0) / HZ / self.cpus
        return max(0.0, (t - self.t0) - accounted)
