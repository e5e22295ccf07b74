"""``kvtier ab --stack``: the A/B against stacks that were started on their own, on vLLM-CPU.

Two local stacks are started as a user would start any two stacks, each in its own working
directory with ``kvtier stack up`` (one 1P1D at its defaults, kvtier's connector with feed and
leases, labelled ``device-ttl``; one single instance with ``--kv-config nixl-unidirectional``,
labelled ``recompute``) and a ``kvtier router`` reading that stack's state file. Then ``kvtier ab
--stack device-ttl=URL1 --stack recompute=URL2`` replays one tiny synthetic trace through
each router and writes the report: both strategies' rows and every turn's record, the engines'
metrics found from the routers, and a section per stack saying what it is.

The two stacks are three vLLM-CPU servers: started one after the other, under the
machine-wide lock, the pool's stack released first. Their shapes differ, so the report
measures both and simulates neither.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from kvtier.ab.live.lock import e2e_lock
from kvtier.runtime import free_ports
from tests.e2e.pd import spawn_kvtier, stop_group
from tests.helpers import wait_until

# Each `kvtier stack up` binds its instances to cores from the first one (one stack per machine,
# kvtier.devstack.spec): on two cores the second stack's engines share cores with the first's
# spinning NIXL progress threads and start slowly (2x1P1D at once, or one after the other: not
# up in 5 minutes; 1 instance then 1P1D: the second up after 4 min 19 s), past what CI on two
# cores can spend on one test. Four cores give each engine its own.
MIN_CORES = 4

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900),
              pytest.mark.skipif(len(os.sched_getaffinity(0)) < MIN_CORES,
                                 reason=f"two local stacks need {MIN_CORES} cores (see MIN_CORES)")]

# The recompute stack is one instance (its router serves every turn on it): a second 1P1D
# stack beside the first did not come up in 5 minutes on two cores, the first one's idle NIXL
# progress threads spinning (at nice 10) on both. The small stack starts first.
STACKS = {"recompute": ["--prefill", "0", "--decode", "1", "--kv-config", "nixl-unidirectional"],
          "device-ttl": []}
SHAPES = {"recompute": ("0P1D", {"decode-0"}), "device-ttl": ("1P1D", {"prefill-0", "decode-0"})}


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
            # One after the other: vLLM-CPU servers registering their KV with NIXL at once on
            # two cores did not come up in 5 minutes; a stack that is up has its NIXL
            # spinners demoted (kvtier.devstack.placement) and leaves the next more room.
            for label, flags in STACKS.items():
                cwd = tmp_path_factory.mktemp(label)
                proc = spawn_kvtier(["stack", "up", *flags], cwd, cwd / "stack-up.log")
                procs.append(proc)
                dirs[label] = cwd
                state = cwd / ".kvtier" / "stack.json"
                up = wait_until(lambda p=proc, f=state: f.exists() or p.poll() is not None,
                                300, 0.5)
                assert up and proc.poll() is None, \
                    f"kvtier stack up ({label}) did not start:\n" \
                    + (cwd / "stack-up.log").read_text()[-3000:]
            urls = {}
            for label, cwd in dirs.items():
                port = free_ports(1)[0]
                procs.append(spawn_kvtier(["router", "--port", str(port)], cwd, cwd / "router.log"))
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
    doc = json.loads((out / "report.json").read_text())
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
    assert doc["meta"]["stack_shapes_differ"] == ["0P1D", "1P1D"]
    stacks = doc["meta"]["stacks"]
    assert stacks["device-ttl"]["decode_metrics"] and not stacks["recompute"]["decode_metrics"]
    assert "decode leases: stack yes, device-ttl no" in stacks["device-ttl"]["verified"]["differs"]
    # the local dev stack serves /reset_prefix_cache: every run started cold
    assert not stacks["device-ttl"]["run_notes"] and not stacks["recompute"]["run_notes"]
    md = (out / "report.md").read_text()
    assert "## Running stacks" in md and "| device-ttl |" in md and "| recompute |" in md
