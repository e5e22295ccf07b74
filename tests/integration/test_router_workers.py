"""`kvtier router --workers N`: one port served by N processes sharing a Redis store; with
the memory store the command refuses to start."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvtier.runtime import free_ports

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable


def wait_http(url: str, proc: subprocess.Popen, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode}")
        try:
            httpx.get(url, timeout=1)
            return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


@pytest.fixture()
def procs() -> Iterator[list[subprocess.Popen]]:
    started: list[subprocess.Popen] = []
    yield started
    for p in started:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in started:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)


def spawn(procs: list[subprocess.Popen], argv: list[str]) -> subprocess.Popen:
    p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         start_new_session=True)
    procs.append(p)
    return p


def children(pid: int) -> list[str]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid and "spawn_main" in cmd:
                out.append(d.name)
    return out


def test_two_workers_serve_one_port_over_redis(procs: list[subprocess.Popen],
                                               redis_url: str) -> None:
    eport, port = free_ports(2)
    eng = spawn(procs, [PY, str(ROOT / "tests/fakes/engine.py"), "--port", str(eport)])
    wait_http(f"http://127.0.0.1:{eport}/health", eng)
    e = f"http://127.0.0.1:{eport}"
    router = spawn(procs, [PY, "-m", "kvtier.cli", "router", "--prefill", e, "--decode", e,
                           "--port", str(port), "--workers", "2",
                           "--store", redis_url])
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/healthz", router)
    with httpx.Client(timeout=30) as c:
        for i in range(20):
            r = c.post(url + "/v1/completions", json={
                "model": "fake", "prompt": [1, 2, 3, i], "max_tokens": 4,
                "conversation_id": f"w{i % 3}"})
            assert r.status_code == 200, r.text
        h = c.get(url + "/healthz").json()
    assert h["dependencies"]["store"] == {"backend": "redis", "ok": True, "error": None}
    assert len(children(router.pid)) == 2


def test_workers_with_the_memory_store_refuse_to_start() -> None:
    r = subprocess.run([PY, "-m", "kvtier.cli", "router", "--decode", "http://127.0.0.1:9",
                        "--workers", "2"], capture_output=True, text=True, timeout=60,
                       check=False)
    assert r.returncode == 2 and "shared store" in r.stderr
