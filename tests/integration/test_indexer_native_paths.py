"""The indexer's two hot paths answer identically, end to end.

Two ``kvtier indexer`` daemons subscribe to the same publishers (vLLM's PUB + replay
protocol, ``test_indexer_subscriber.Publisher``): one with the C helper
(``kvtier.indexer.native``, built by ``./run``'s setup), one with
``KVTIER_INDEXER_NATIVE=0`` (pure Python). Events cover stores chained over batches,
removals, a clear, orphans, token ids of every msgpack width, a pod with two streams,
replayed and live batches. Every ``/v1/lookup``, ``/v1/route`` and ``/v1/source`` answer
and every pod's event accounting must be equal; each daemon logs the path it runs.

Skipped (saying so) where the helper is not built; under ``./run test`` after a build it
must run (KVTIER_INDEXER_NATIVE_REQUIRED=1).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvtier.runtime import free_ports
from kvtier.wire import kv_events as ev
from tests.helpers import wait_until

from .test_indexer_subscriber import Publisher

pytestmark = pytest.mark.integration
BS = 16
STREAMS = {  # stream -> (pod, topic, extra spec); "a" has two streams (engine + host tier)
    "a": ("a", "kv@a", ""),
    "a-host": ("a", "kv@a-host", ",p2p=10.0.0.1:7100,stream=host"),
    "b": ("b", "kv@b", ",p2p=10.0.0.2:7100"),
    "c": ("c", "kv@c", ",p2p=10.0.0.3:7100"),
}


class Daemon:
    def __init__(self, name: str, pods: list[str], logs: Path, env: dict[str, str]) -> None:
        (self.port,) = free_ports(1)
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = logs / f"{name}.log"
        cmd = [sys.executable, "-m", "kvtier.cli", "indexer", "--port", str(self.port),
               "--model", "m", "--block-size", str(BS), "--stale-after", "600"]
        for p in pods:
            cmd += ["--pod", p]
        with self.log.open("wb") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
        self.http = httpx.Client(base_url=self.url, timeout=20)

        def up() -> bool:
            assert self.proc.poll() is None, self.log.read_text()
            try:
                return self.http.get("/healthz").status_code == 200
            except httpx.HTTPError:
                return False
        assert wait_until(up, timeout=90), self.log.read_text()

    def post(self, path: str, body: dict[str, Any]) -> Any:
        r = self.http.post(path, json=body)
        return r.status_code, r.json()

    def seqs(self) -> dict[str, int]:
        pods = self.http.get("/v1/pods").json()["pods"]
        return {s: d["last_seq"] for p in pods.values() for s, d in p["streams"].items()}

    def accounting(self) -> dict[str, Any]:
        keep = ("last_seq", "gaps", "missing_batches", "malformed_frames", "blocks_stored",
                "blocks_removed", "dropped")
        pods = self.http.get("/v1/pods").json()["pods"]
        return {s: {k: d[k] for k in keep} for p in pods.values()
                for s, d in p["streams"].items()}

    def stop(self) -> None:
        self.http.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def _token(rng: random.Random) -> int:
    """Every msgpack integer width: fixint, uint8, uint16, uint32."""
    return rng.choice((rng.randrange(128), rng.randrange(128, 256), rng.randrange(256, 65536),
                       rng.randrange(65536, 2**32)))


class Workload:
    """Prompts sharing prefixes and the events engines would publish for them."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        roots = [[_token(self.rng) for _ in range(BS * self.rng.randrange(2, 6))]
                 for _ in range(4)]
        self.prompts = [r + [_token(self.rng) for _ in range(BS * self.rng.randrange(1, 8))]
                        for r in roots for _ in range(3)]
        self._hash: dict[tuple[int, ...], int] = {}

    def hashes(self, toks: list[int]) -> list[int]:
        """Opaque engine block hashes (the same block prefix: the same hash)."""
        out = []
        for i in range(len(toks) // BS):
            key = tuple(toks[: (i + 1) * BS])
            out.append(self._hash.setdefault(key, self.rng.getrandbits(64)))
        return out

    def events(self, n: int, medium: str) -> list[list[dict[str, Any]]]:
        """n batches: chained stores over batches, removals, now and then an orphan."""
        out = []
        for _ in range(n):
            toks = self.rng.choice(self.prompts)
            eh = self.hashes(toks)
            hi = self.rng.randrange(1, len(eh) + 1)
            lo = self.rng.randrange(0, hi)
            batch: list[dict[str, Any]] = []
            for a in range(0, hi, 2):   # the prefix in chunks of two blocks, chained
                b = min(hi, a + 2)
                batch.append(ev.encode_stored(eh[a:b], eh[a - 1] if a else None,
                                              toks[a * BS: b * BS], BS, medium))
            if self.rng.random() < 0.3:
                batch.append(ev.encode_removed(eh[lo:hi], medium))
            if self.rng.random() < 0.1:   # parent never seen: counted, not indexed
                batch.append(ev.encode_stored([self.rng.getrandbits(64)],
                                              self.rng.getrandbits(64), toks[:BS], BS, medium))
            out.append(batch)
        return out

    def queries(self) -> list[list[int]]:
        qs = []
        for toks in self.prompts:
            qs += [toks, toks[: len(toks) // 2], toks[: BS + 3], toks + [1, 2, 3]]
        qs.append([_token(self.rng) for _ in range(5 * BS)])     # nobody holds it
        qs.append([7])                                             # shorter than a block
        return qs


def _native_or_skip() -> None:
    from kvtier.indexer.native import NATIVE

    if NATIVE is None:
        from tests.unit.test_indexer_keys import skip_without_native

        skip_without_native("_kvtier_indexer_native not built (python -m "
                            "kvtier.indexer.native.build): nothing to compare the pure path with")


def test_native_and_pure_python_daemons_answer_identically(tmp_path):
    _native_or_skip()
    w = Workload(seed=16)
    pubs = {s: Publisher(topic=t) for s, (_, t, _) in STREAMS.items()}
    medium = {"a": "GPU", "a-host": "CPU", "b": "GPU", "c": "CPU"}
    daemons: list[Daemon] = []
    try:
        def publish(n: int) -> None:
            for s, pub in pubs.items():
                for batch in w.events(n, medium[s]):
                    pub.publish(batch)

        publish(12)                                # before the daemons: they replay these
        pubs["b"].publish([ev.encode_cleared()])   # b starts over
        pods = [f"{pod}=tcp://127.0.0.1:{pubs[s].port},replay=tcp://127.0.0.1:"
                f"{pubs[s].replay_port},topic={t}{extra}"
                for s, (pod, t, extra) in STREAMS.items()]
        base = {k: v for k, v in os.environ.items() if k != "KVTIER_INDEXER_NATIVE"}
        native = Daemon("native", pods, tmp_path, base)
        daemons.append(native)
        pure = Daemon("pure", pods, tmp_path, {**base, "KVTIER_INDEXER_NATIVE": "0"})
        daemons.append(pure)
        assert "indexer hot path: C helper" in native.log.read_text(), native.log.read_text()
        assert "indexer hot path: pure Python (KVTIER_INDEXER_NATIVE=0)" in \
            pure.log.read_text(), pure.log.read_text()

        seen: list[Any] = [None, time.monotonic()]   # last seqs, when they last moved

        def caught_up() -> bool:
            want = {("a" if s == "a" else f"{pod}#host" if s == "a-host" else s):
                    pubs[s].seq - 1 for s, (pod, _, _) in STREAMS.items()}
            now = [d.seqs() for d in daemons]
            if all(x == want for x in now):
                return True
            if now != seen[0]:
                seen[:] = [now, time.monotonic()]
            elif time.monotonic() - seen[1] > 2.0:
                # stuck: a live batch lost before the SUB joined; the next batch's seq
                # shows the gap and replay fetches it
                for pub in pubs.values():
                    pub.publish([])
                seen[1] = time.monotonic()
            return False

        assert wait_until(caught_up, timeout=120, interval=0.2), [d.seqs() for d in daemons]
        publish(8)                                 # live
        assert wait_until(caught_up, timeout=120, interval=0.2), [d.seqs() for d in daemons]
        acc = native.accounting()
        assert acc == pure.accounting()
        assert any(d["dropped"] for d in acc.values()), acc     # orphans were counted

        rng = random.Random(3)
        held = sources = 0
        for toks in w.queries():
            body: dict[str, Any] = {"model": "m", "token_ids": toks}
            a, b = native.post("/v1/lookup", body), pure.post("/v1/lookup", body)
            assert a == b, (toks, a, b)
            assert a[0] == 200
            held += bool(a[1]["matches"])
            for target in ("a", "b", "c", "nobody", None):
                q = dict(body, loads={p: rng.randrange(4) for p in "abc"},
                         min_cached_token_delta=rng.choice([0, 1, BS, 3 * BS]))
                if target is not None:
                    q["target_pod"] = target
                    assert native.post("/v1/source", q) == pure.post("/v1/source", q), q
                r = native.post("/v1/route", q)
                assert r == pure.post("/v1/route", q), q
                sources += r[1]["source"] is not None
        assert held >= len(w.prompts) and sources   # not a comparison of empty answers
    finally:
        for d in daemons:
            d.stop()
        for pub in pubs.values():
            pub.close()
