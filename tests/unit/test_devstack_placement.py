"""kvtier.devstack.placement against a real process that looks like a misplaced vLLM worker:
named VLLM::Worker, its main thread on the wrong core, one thread spinning, one sleeping."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from kvtier.devstack.placement import WORKER_COMM, place

CHILD = textwrap.dedent("""
    import os, sys, threading, time
    open("/proc/self/comm", "w").write(sys.argv[1])
    os.sched_setaffinity(0, {int(sys.argv[2])})   # vLLM's move to the 'reserved' core
    def spin():
        while True:
            pass
    def nap():
        while True:
            time.sleep(1)
    threading.Thread(target=spin, daemon=True, name="spin").start()
    threading.Thread(target=nap, daemon=True, name="nap").start()
    print(threading.get_native_id(), flush=True)
    sys.stdin.read()
""")

needs_two_cores = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2,
                                     reason="needs two cores to move a thread between")


def _start(comm: str, wrong_core: int) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", CHILD, comm, str(wrong_core)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip().isdigit()
    time.sleep(0.3)  # let the spinner run
    return p


def _threads(pid: int) -> list[int]:
    return [int(t) for t in os.listdir(f"/proc/{pid}/task")]


@needs_two_cores
def test_worker_rebound_and_spinner_idled():
    cores = sorted(os.sched_getaffinity(0))
    want, wrong = cores[0], cores[-1]
    p = _start(WORKER_COMM, wrong)
    try:
        placed = place(os.getpid(), want, sample_s=0.5)
        mine = [x for x in placed if x.pid == p.pid]
        assert len(mine) == 1 and mine[0].rebound
        assert os.sched_getaffinity(p.pid) == {want}
        # Exactly one thread spun: it, and only it, runs at nice 10 now.
        assert len(mine[0].demoted) == 1
        niced = [t for t in _threads(p.pid) if os.getpriority(os.PRIO_PROCESS, t) == 10]
        assert niced == mine[0].demoted
        assert all(os.sched_getscheduler(t) == os.SCHED_OTHER for t in _threads(p.pid))
        assert os.getpriority(os.PRIO_PROCESS, p.pid) == 0
        # placing again changes nothing
        again = [x for x in place(os.getpid(), want, sample_s=0.5) if x.pid == p.pid]
        assert again[0].demoted == [] and not again[0].rebound
    finally:
        p.kill()
        p.wait()


@needs_two_cores
def test_spinner_idled_on_request():
    cores = sorted(os.sched_getaffinity(0))
    p = _start(WORKER_COMM, cores[-1])
    try:
        mine = [x for x in place(os.getpid(), cores[0], sample_s=0.5, nice=None) if x.pid == p.pid]
        assert len(mine[0].demoted) == 1
        idle = [t for t in _threads(p.pid) if os.sched_getscheduler(t) == os.SCHED_IDLE]
        assert idle == mine[0].demoted
        with pytest.raises(ValueError):
            place(os.getpid(), cores[0], nice=25)
    finally:
        p.kill()
        p.wait()


def test_other_processes_left_alone():
    cores = sorted(os.sched_getaffinity(0))
    p = _start("not-a-worker", cores[-1])
    try:
        placed = place(os.getpid(), cores[0], sample_s=0.3)
        assert all(x.pid != p.pid for x in placed)
        assert os.sched_getaffinity(p.pid) == {cores[-1]}
        assert all(os.sched_getscheduler(t) != os.SCHED_IDLE for t in _threads(p.pid))
    finally:
        p.kill()
        p.wait()


@needs_two_cores
def test_many_busy_threads_are_left_alone():
    """More busy threads than NIXL would make: not spinners to demote (e.g. OpenMP at work)."""
    many = CHILD.replace('threading.Thread(target=spin, daemon=True, name="spin").start()',
                         'for _ in range(4): threading.Thread(target=spin, daemon=True).start()')
    # Spin without the GIL (hashlib releases it on large buffers), as OpenMP threads do: a
    # thread waiting for the GIL sleeps, so pure-Python spinners showed as 1-2 busy threads on
    # a loaded CI machine and one was demoted.
    gil_free = "    data = b'x' * (1 << 20)\n    while True:\n        hashlib.sha256(data).digest()\n"
    many = many.replace("import os, sys, threading, time", "import hashlib, os, sys, threading, time")
    many = many.replace("    while True:\n        pass\n", gil_free)
    assert "hashlib.sha256" in many
    p = subprocess.Popen([sys.executable, "-c", many, WORKER_COMM, str(os.sched_getaffinity(0).pop())],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip().isdigit()
    try:
        time.sleep(0.3)
        placed = [x for x in place(os.getpid(), None, sample_s=0.5) if x.pid == p.pid]
        assert len(placed) == 1 and placed[0].demoted == []
        assert all(os.sched_getscheduler(t) != os.SCHED_IDLE for t in _threads(p.pid))
        assert all(os.getpriority(os.PRIO_PROCESS, t) == 0 for t in _threads(p.pid))
    finally:
        p.kill()
        p.wait()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")
def test_transparent_hugepages_off_for_the_caller_and_what_it_starts() -> None:
    """khugepaged must never scan the stack's processes (placement's point 3): off for the
    caller and inherited by what it starts (PR_SET_THP_DISABLE survives fork and exec)."""
    code = (
        "import subprocess, sys\n"
        "from kvtier.devstack.placement import no_transparent_hugepages\n"
        "def thp(): return [l.split()[1] for l in open('/proc/self/status')"
        " if l.startswith('THP_enabled')][0]\n"
        "ok = no_transparent_hugepages()\n"
        "child = subprocess.run([sys.executable, '-c', 'print([l.split()[1] for l in "
        "open(\"/proc/self/status\") if l.startswith(\"THP_enabled\")][0])'],"
        " capture_output=True, text=True).stdout.strip()\n"
        "print(ok, thp(), child)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["True", "0", "0"], out
