"""Indexer replicas as real daemons on one real redis-server.

Two ``kvtier indexer --backend redis://...`` processes subscribe to the same
publishers (vLLM's PUB + replay protocol, ``test_indexer_subscriber.Publisher``):
they answer identically; one killed mid-stream and restarted answers at once
(from the shared index, resuming its streams from the saved seqs); Redis down
is a 503 naming the backend, and once Redis is back both catch up by replay,
also when it came back empty.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from kvtier.runtime import free_ports
from tests.helpers import RedisServer, wait_until

from .test_indexer_subscriber import BS, Prompt, Publisher

pytestmark = pytest.mark.integration
NS = "kvtier"


class Replica:
    def __init__(self, name: str, redis_url: str, pods: list[str], logs: Path) -> None:
        (self.port,) = free_ports(1)
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = logs / f"{name}.log"
        self.cmd = [sys.executable, "-m", "kvtier.cli", "indexer", "--port", str(self.port),
                    "--model", "m", "--block-size", str(BS), "--backend", redis_url]
        for p in pods:
            self.cmd += ["--pod", p]
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        with self.log.open("ab") as f:
            self.proc = subprocess.Popen(self.cmd, stdout=f, stderr=subprocess.STDOUT)

        def up() -> bool:
            assert self.proc is not None and self.proc.poll() is None, self.log.read_text()
            try:
                return httpx.get(f"{self.url}/healthz").status_code == 200
            except httpx.HTTPError:
                return False
        assert wait_until(up, timeout=60), self.log.read_text()

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=15)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def post(self, path: str, body: dict) -> httpx.Response:
        return httpx.post(f"{self.url}{path}", json=body, timeout=10)

    def connected(self) -> bool:
        pods = httpx.get(f"{self.url}/healthz").json()["pods"]
        return all(p["connected"] and not p["stale"] for p in pods.values())


def answers(rep: Replica, prompts: list[Prompt]) -> list[dict] | None:
    """Every /v1/route answer for these prompts and targets; None if one was not a 200."""
    out = []
    for pr in prompts:
        for target in ("p", "q", "t"):
            r = rep.post("/v1/route", {"model": "m", "token_ids": pr.toks, "target_pod": target})
            if r.status_code != 200:
                return None
            out.append(r.json())
    return out


def gpu(rep: Replica, pr: Prompt, pod: str = "p") -> int:
    r = rep.post("/v1/lookup", {"model": "m", "token_ids": pr.toks})
    if r.status_code != 200:
        return -1
    return next((m["matched_tokens"] // BS for m in r.json()["matches"]
                 if m["pod"] == pod and m["tier"] == "GPU"), 0)


def test_two_replicas_on_one_redis(tmp_path):
    redis_srv = RedisServer(tmp_path)
    p, q = Publisher(topic="kv@p"), Publisher(topic="kv@q")
    pods = [f"p=tcp://127.0.0.1:{p.port},replay=tcp://127.0.0.1:{p.replay_port},"
            "p2p=10.0.0.1:7100,topic=kv@p",
            f"q=tcp://127.0.0.1:{q.port},replay=tcp://127.0.0.1:{q.replay_port},"
            "p2p=10.0.0.2:7100,topic=kv@q"]
    a, b, c = Prompt(0, 6), Prompt(1000, 3), Prompt(2000, 2)
    reps: list[Replica] = []
    try:
        reps += [Replica("A", redis_srv.url, pods, tmp_path), Replica("B", redis_srv.url, pods,
                                                                      tmp_path)]
        A, B = reps
        assert wait_until(lambda: A.connected() and B.connected(), timeout=20)
        assert p.wait_subscribed(2) and q.wait_subscribed(2)  # both replicas' SUBs
        p.publish([a.stored(0, 4), a.stored(0, 3, "CPU")])
        q.publish([a.stored(0, 5, "CPU")])
        assert wait_until(lambda: gpu(A, a) == 4 and gpu(B, a) == 4)
        # 1. identical answers
        assert wait_until(lambda: answers(A, [a]) == answers(B, [a]) is not None)
        first = answers(A, [a])
        assert first is not None
        assert first[2]["source"]["pod"] == "q" and first[2]["matches"][0]["pod"] == "q"

        # 2. B killed mid-stream; events go on; B restarted answers at once
        r = redis_srv.client()
        assert wait_until(lambda: int(r.hget(f"{NS}:seq", "p") or -1) >= 0)
        B.kill()
        p.publish([b.stored(0, 3)])
        p.publish([a.removed(3, 4)])
        assert wait_until(lambda: gpu(A, b) == 3 and gpu(A, a) == 3)
        B.start()
        assert gpu(B, b) == 3 and gpu(B, a) == 3      # its very first answers
        assert answers(B, [a, b]) == answers(A, [a, b]) is not None
        assert wait_until(B.connected, timeout=20)
        details = httpx.get(f"{B.url}/v1/pods").json()["pods"]["p"]
        # resumed from the saved seq: at most the batches after it were re-applied
        assert details["blocks_stored"] <= 3, details
        assert "resuming" in B.log.read_text()

        # 3. Redis down: a clear 503; events meanwhile are caught up by replay
        redis_srv.stop(save=True)
        for rep in reps:
            resp = rep.post("/v1/lookup", {"model": "m", "token_ids": a.toks})
            assert resp.status_code == 503, resp.text
            assert "index backend unavailable" in resp.json()["error"]
            assert str(redis_srv.port) in resp.json()["error"]
            h = httpx.get(f"{rep.url}/healthz")
            assert h.status_code == 503 and h.json()["status"] == "backend_unavailable"
        p.publish([c.stored(0, 2)])
        time.sleep(1.5)   # let both replicas fail and retry while Redis is down
        redis_srv.start()
        assert wait_until(lambda: gpu(A, c) == 2 and gpu(B, c) == 2, timeout=20)
        assert answers(A, [a, b, c]) == answers(B, [a, b, c]) is not None
        assert all(httpx.get(f"{rep.url}/v1/pods").json()["pods"]["p"]["resyncs"] >= 1
                   for rep in reps)

        # 4. Redis back *empty*: both rebuild everything by replay from 0
        expected = answers(A, [a, b, c])
        assert expected is not None and expected[0]["matches"] != []
        redis_srv.stop(save=False)
        redis_srv.start()
        assert wait_until(lambda: answers(A, [a, b, c]) == expected ==
                          answers(B, [a, b, c]), timeout=30)
        # Whichever replica sees the empty Redis first rebuilds it, so the answers can
        # match before the other has noticed; each notices at its next check.
        assert wait_until(lambda: all("lost its data" in rep.log.read_text() for rep in reps),
                          timeout=15), A.log.read_text()[-2000:]
    finally:
        for rep in reps:
            rep.stop()
        p.close()
        q.close()
        if redis_srv.proc is not None and redis_srv.proc.poll() is None:
            redis_srv.proc.terminate()
            redis_srv.proc.wait(timeout=10)
