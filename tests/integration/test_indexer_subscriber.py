"""The subscriber over real ZMQ sockets: replay on start and on gaps, garbage, restarts, dead pods.

``Publisher`` below speaks vLLM's PUB + replay-ROUTER protocol (checked against
vLLM's own ZmqEventPublisher in the last test) and can drop or garble batches,
which the real engine cannot be made to do on demand. Its socket is an XPUB, so a test
can wait until the indexer's subscription has really arrived (``ready``): a PUB drops what
it sends before then, and on a loaded CI machine a fixed sleep after the TCP connect was
not always enough.
"""

from __future__ import annotations

import threading
import time
from collections import deque

import pytest
import zmq

from kvtier.hashing import EngineHasher
from kvtier.ids import Tier
from kvtier.indexer.config import IndexerConfig, PodSpec
from kvtier.indexer.service import IndexerService
from kvtier.wire import kv_events as ev
from tests.helpers import wait_until

pytestmark = pytest.mark.integration
BS = 4
END = (2**64 - 1).to_bytes(8, "big")


class Publisher:
    def __init__(self, topic="kv@p", buffer=10_000, port=None, replay_port=None, replay=True,
                 host="127.0.0.1"):
        self.host = host
        self.ctx = zmq.Context()
        self.topic = topic
        self.pub = self.ctx.socket(zmq.XPUB)  # a PUB that tells its subscriptions
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # each subscriber's, not just the first
        self.port = self._bind(self.pub, port)
        self.subscriptions = 0
        self.seq = 0
        self.buffer: deque = deque(maxlen=buffer)
        self.lock = threading.Lock()
        self.stop_ev = threading.Event()
        self.replay_port = None
        self.thread = None
        if replay:
            self.router = self.ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            self.replay_port = self._bind(self.router, replay_port)
            self.thread = threading.Thread(target=self._serve, daemon=True)
            self.thread.start()

    def _bind(self, sock, port):
        if port is None:
            return sock.bind_to_random_port(f"tcp://{self.host}")
        sock.bind(f"tcp://{self.host}:{port}")
        return port

    def spec(self, name="p", **kw) -> PodSpec:
        replay = f"tcp://{self.host}:{self.replay_port}" if self.replay_port else None
        return PodSpec(name=name, events=f"tcp://{self.host}:{self.port}", replay=replay,
                       topic=self.topic, **kw)

    def publish(self, events, drop=False):
        with self.lock:
            frames = ev.encode_frames(self.topic, self.seq, events)
            self.buffer.append((self.seq, frames[2]))
            self.seq += 1
        if not drop:
            self.pub.send_multipart(frames)

    def raw(self, frames):
        self.pub.send_multipart(frames)

    def wait_subscribed(self, count=1, timeout=10.0) -> bool:
        """Until ``count`` subscriptions have reached this socket (in its lifetime)."""
        deadline = time.monotonic() + timeout
        while self.subscriptions < count:
            left = deadline - time.monotonic()
            if left <= 0 or not self.pub.poll(int(left * 1000)):
                return False
            if self.pub.recv()[:1] == b"\x01":
                self.subscriptions += 1
        return True

    def _serve(self):
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        while not self.stop_ev.is_set():
            if not poller.poll(20):
                continue
            ident, _, start = self.router.recv_multipart()
            start = int.from_bytes(start, "big")
            with self.lock:
                items = [(s, p) for s, p in self.buffer if s >= start]
            for s, p in items:
                self.router.send_multipart([ident, b"", self.topic.encode(), s.to_bytes(8, "big"), p])
            self.router.send_multipart([ident, b"", b"", END, b""])

    def close(self):
        self.stop_ev.set()
        if self.thread:
            self.thread.join()
            self.router.close(0)
        self.pub.close(0)
        self.ctx.term()


class Prompt:
    """A prompt and the events an engine would publish for it."""

    def __init__(self, start, nblocks):
        self.toks = list(range(start, start + nblocks * BS))
        self.eh = EngineHasher(BS).hashes(self.toks)

    def stored(self, lo, hi, medium="GPU"):
        parent = self.eh[lo - 1] if lo else None
        return ev.encode_stored(self.eh[lo:hi], parent, self.toks[lo * BS: hi * BS], BS, medium)

    def removed(self, lo, hi, medium="GPU"):
        return ev.encode_removed(self.eh[lo:hi], medium)


def make(pods, **kw) -> IndexerService:
    cfg = IndexerConfig(pods=tuple(pods), block_size=BS, default_model="m", replay_timeout_s=2.0,
                        **kw)
    return IndexerService(cfg)


def matched(svc, prompt, pod="p", tier="GPU"):
    for m in svc.lookup("m", prompt.toks).matches:
        if m.pod == pod and m.tier == tier:
            return m.matched_tokens // BS
    return 0


def connected(svc, name="p"):
    return lambda: svc.pod_status()[name]["connected"]


def ready(svc, *pubs) -> bool:
    """Every pod connected, and the subscription has reached each publisher."""
    assert pubs, "name the publishers the test drives"
    return svc.wait_connected(10.0, settle_s=0) and all(p.wait_subscribed() for p in pubs)


def test_started_after_the_engine_rebuilds_from_replay():
    pub = Publisher()
    a = Prompt(0, 6)
    try:
        pub.publish([a.stored(0, 3)])
        pub.publish([a.stored(3, 6)])
        pub.publish([a.removed(5, 6)])
        with make([pub.spec()]) as svc:
            assert wait_until(lambda: matched(svc, a) == 5)
            st = svc.pod_status()["p"]
            assert st["last_seq"] == 2 and st["gaps"] == 0
            assert ready(svc, pub)
            pub.publish([a.stored(5, 6, medium="CPU")])
            assert wait_until(lambda: matched(svc, a, tier="CPU") == 0 and
                              svc.pod_status()["p"]["last_seq"] == 3)
            d = svc.pod_details()["p"]
            assert d["missing_batches"] == 0 and d["replays"] >= 1
    finally:
        pub.close()


def test_gap_is_recovered_by_replay():
    pub = Publisher()
    a = Prompt(0, 6)
    try:
        with make([pub.spec()]) as svc:
            assert ready(svc, pub)
            pub.publish([a.stored(0, 2)])
            assert wait_until(lambda: matched(svc, a) == 2)
            pub.publish([a.stored(2, 4)], drop=True)   # lost on the wire
            pub.publish([a.stored(4, 6)])
            assert wait_until(lambda: matched(svc, a) == 6)
            d = svc.pod_details()["p"]
            assert d["gaps"] == 1 and d["missing_batches"] == 0 and d["replays"] >= 2
            assert d["dropped"] == {}
    finally:
        pub.close()


def test_unrecoverable_gap_is_counted_and_indexing_goes_on():
    pub = Publisher(buffer=2)
    a, b = Prompt(0, 4), Prompt(1000, 2)
    try:
        with make([pub.spec()]) as svc:
            assert ready(svc, pub)
            pub.publish([a.stored(0, 2)])
            assert wait_until(lambda: matched(svc, a) == 2)
            pub.publish([a.stored(2, 3)], drop=True)
            pub.publish([a.stored(3, 4)], drop=True)   # seq 1 is out of the buffer once seq 3 is in
            pub.publish([b.stored(0, 2)])
            assert wait_until(lambda: matched(svc, b) == 2)
            d = svc.pod_details()["p"]
            assert d["missing_batches"] == 1 and d["gaps"] == 1
            assert d["dropped"].get("orphan") == 1   # block 3's parent was in the lost batch
            assert matched(svc, a) == 2
    finally:
        pub.close()


def test_garbage_frames_are_counted_and_skipped():
    pub = Publisher(topic="")
    a = Prompt(0, 3)
    try:
        with make([pub.spec()]) as svc:
            assert ready(svc, pub)
            pub.raw([b"only one frame"])
            pub.raw([b"", b"\x00" * 3, b"bad seq"])
            pub.raw([b"", (0).to_bytes(8, "big"), b"\xc1\xc1 not msgpack"])  # seq 0 consumed
            pub.seq = 1
            pub.publish([a.stored(0, 3)])
            assert wait_until(lambda: matched(svc, a) == 3)
            d = svc.pod_details()["p"]
            assert d["malformed_frames"] == 3 and d["missing_batches"] == 0
            metrics = svc.metrics.render().decode()
            assert 'kvtier_indexer_malformed_frames_total{pod="p",stream="p"} 3.0' in metrics
    finally:
        pub.close()


def test_publisher_restart_clears_the_pod():
    pub = Publisher()
    a, b = Prompt(0, 4), Prompt(500, 2)
    try:
        with make([pub.spec()]) as svc:
            assert ready(svc, pub)
            for i in range(4):
                pub.publish([a.stored(i, i + 1)])
            assert wait_until(lambda: matched(svc, a) == 4)
            port, rport = pub.port, pub.replay_port
            pub.close()
            assert wait_until(lambda: not connected(svc)())
            pub = Publisher(port=port, replay_port=rport)   # a fresh engine: seq from 0
            assert wait_until(connected(svc), timeout=15)
            # The first batch may go out before the subscription has reached the new
            # PUB (ZMQ's slow joiner); the second one then reveals the restart (seq 1
            # <= 3) and the replay from 0 brings the first one back.
            pub.publish([b.stored(0, 1)])
            time.sleep(0.2)
            pub.publish([b.stored(1, 2)])
            assert wait_until(lambda: matched(svc, b) == 2, timeout=15)
            assert matched(svc, a) == 0
            assert svc.pod_details()["p"]["restarts"] == 1
    finally:
        pub.close()


def test_pod_that_never_answers_does_not_hold_up_others():
    pub = Publisher()
    a = Prompt(0, 2)
    from kvtier.runtime import free_ports

    p1, p2 = free_ports(2)
    dead = PodSpec(name="dead", events=f"tcp://127.0.0.1:{p1}", replay=f"tcp://127.0.0.1:{p2}")
    try:
        with make([dead, pub.spec()]) as svc:
            assert not svc.wait_connected(1.0)  # "dead" never connects
            assert wait_until(connected(svc)) and pub.wait_subscribed()
            pub.publish([a.stored(0, 2)])
            assert wait_until(lambda: matched(svc, a) == 2)
            assert wait_until(lambda: svc.pod_details()["dead"]["replay_timeouts"] >= 1)
            st = svc.pod_status()["dead"]
            assert {k: st[k] for k in ("connected", "last_seq", "gaps")} == {
                "connected": False, "last_seq": -1, "gaps": 0}
    finally:
        pub.close()


def test_pods_added_and_removed_at_runtime():
    pub1, pub2 = Publisher(topic="kv@a"), Publisher(topic="kv@b")
    a = Prompt(0, 2)
    try:
        with make([]) as svc:
            svc.add_pod(pub1.spec("a"))
            svc.add_pod(pub2.spec("b", p2p="127.0.0.1:7000"))
            assert ready(svc, pub1, pub2)
            pub1.publish([a.stored(0, 2)])
            pub2.publish([a.stored(0, 1, medium="CPU")])
            assert wait_until(lambda: matched(svc, a, "a") == 2 and
                              matched(svc, a, "b", "CPU") == 1)
            svc.remove_pod("b")
            svc.subscriber.drain()
            assert wait_until(lambda: matched(svc, a, "b", "CPU") == 0)
            assert set(svc.pod_status()) == {"a"}
    finally:
        pub1.close()
        pub2.close()


class _VllmPublisher:
    """vLLM's own ZmqEventPublisher (GPU-medium events from the engine)."""

    medium = "GPU"

    def __init__(self, p1, p2, topic):
        self.kv = pytest.importorskip("vllm.distributed.kv_events")
        self.pub = self.kv.ZmqEventPublisher(0, endpoint=f"tcp://*:{p1}",
                                             replay_endpoint=f"tcp://*:{p2}", topic=topic)

    def store(self, prompt, lo):
        kv = self.kv
        parent = prompt.eh[lo - 1] if lo else None
        self.pub.publish(kv.KVEventBatch(ts=0.0, events=[kv.BlockStored(
            block_hashes=[prompt.eh[lo]], parent_block_hash=parent,
            token_ids=prompt.toks[lo * BS:(lo + 1) * BS], block_size=BS, lora_id=None,
            medium="GPU", lora_name=None)]))

    def close(self):
        self.pub.shutdown()


class _TierPublisher:
    """kvtier's host tier publisher (CPU-medium events from KVTierConnector)."""

    medium = "CPU"

    def __init__(self, p1, p2, topic):
        from kvtier.tier.events import TierEventPublisher

        self.pub = TierEventPublisher(f"tcp://127.0.0.1:{p1}", f"tcp://127.0.0.1:{p2}", topic)

    def store(self, prompt, lo):
        from kvtier.ids import EngineBlockHash, RequestKey
        from kvtier.tier.manager import BlockMeta, TierEvent, TierEventKind

        meta = BlockMeta(token_ids=tuple(prompt.toks[lo * BS:(lo + 1) * BS]),
                         engine_hash=EngineBlockHash(prompt.eh[lo]),
                         parent_engine_hash=EngineBlockHash(prompt.eh[lo - 1]) if lo else None)
        self.pub.publish([TierEvent(TierEventKind.STORED, (RequestKey(1000 + lo),), (meta,))],
                         block_size=BS)

    def close(self):
        self.pub.close()


@pytest.mark.parametrize("impl", [_VllmPublisher, _TierPublisher], ids=["vllm", "kvtier-tier"])
def test_replay_rebuilds_what_was_published_before_subscribing(impl):
    # The same contract for every publisher the indexer subscribes to: batches sent before
    # the indexer started come back by replay, answered (no replay timeout), in order.
    from kvtier.runtime import free_ports

    p1, p2 = free_ports(2)
    pub = impl(p1, p2, "kv@v")
    a = Prompt(0, 4)
    try:
        for lo in range(4):
            pub.store(a, lo)
        time.sleep(0.1)  # the publisher thread has sent (to nobody) and buffered them
        spec = PodSpec(name="v", events=f"tcp://127.0.0.1:{p1}",
                       replay=f"tcp://127.0.0.1:{p2}", topic="kv@v")
        with make([spec]) as svc:
            assert wait_until(lambda: matched(svc, a, "v", tier=pub.medium) == 4)
            d = svc.pod_details()["v"]
            assert d["last_seq"] == 3 and d["replay_timeouts"] == 0 and d["missing_batches"] == 0
    finally:
        pub.close()


def test_snapshot_restores_and_resumes_after_restart(tmp_path):
    pub = Publisher(buffer=2)
    a = Prompt(0, 6)
    snap = tmp_path / "idx.snap"
    try:
        with make([pub.spec()], snapshot_path=str(snap)) as svc:
            assert ready(svc, pub)
            for i in range(4):
                pub.publish([a.stored(i, i + 1)])
            assert wait_until(lambda: matched(svc, a) == 4)
        assert snap.exists()
        # while the indexer is down, two more batches; the buffer (2) still has them
        pub.publish([a.stored(4, 5)])
        pub.publish([a.stored(5, 6)])
        with make([pub.spec()], snapshot_path=str(snap)) as svc:
            assert wait_until(lambda: matched(svc, a) == 6)
            d = svc.pod_details()["p"]
            assert d["missing_batches"] == 0 and d["dropped"] == {}
        # without the snapshot, a buffer of 2 cannot rebuild the chain
        with make([pub.spec()]) as svc:
            assert wait_until(lambda: svc.pod_details()["p"]["dropped"].get("orphan") == 2)
            assert matched(svc, a) == 0
    finally:
        pub.close()


def test_source_prefers_cpu_peers_by_delta_and_never_the_target():
    pubs = {n: Publisher(topic=f"kv@{n}") for n in ("t", "x", "y", "z")}
    a = Prompt(0, 8)
    try:
        specs = [pubs["t"].spec("t", p2p="127.0.0.1:7001"),
                 pubs["x"].spec("x", p2p="127.0.0.1:7002"),
                 pubs["y"].spec("y", p2p="127.0.0.1:7003"),
                 pubs["z"].spec("z")]                         # no p2p address: not a source
        with make(specs) as svc:
            assert ready(svc, *pubs.values())
            pubs["t"].publish([a.stored(0, 2), a.stored(0, 3, "CPU")])
            pubs["x"].publish([a.stored(0, 6, "CPU")])
            pubs["y"].publish([a.stored(0, 6, "CPU"), a.stored(0, 8)])  # GPU does not count
            pubs["z"].publish([a.stored(0, 8, "CPU")])
            assert wait_until(lambda: matched(svc, a, "z", "CPU") == 8 and
                              matched(svc, a, "y") == 8 and matched(svc, a, "t", "CPU") == 3)
            r = svc.source("m", a.toks, "t", 1)
            assert r.target_matched_tokens == 3 * BS and r.delta == 3 * BS
            assert (r.source.pod, r.source.tier, r.source.matched_tokens) == ("x", "CPU", 24)
            assert (r.source.p2p_host, r.source.p2p_port) == ("127.0.0.1", 7002)
            # the delta threshold
            assert svc.source("m", a.toks, "t", 3 * BS + 1).source is None
            # never the target itself, even if it holds the most; y holds what x holds, so
            # it gains nothing, and the one reuse gate (kvtier.reuse_gate) refuses a pull of
            # nothing even at a threshold of 0, as the router and the engine always did
            r = svc.source("m", a.toks, "x", 0)
            assert r.source is None and r.delta == 0
            r = svc.source("m", a.toks, "y", 1)   # y holds 8 on GPU: nobody beats it
            assert r.source is None and r.target_matched_tokens == 8 * BS
            assert Tier.CPU.value == "CPU"
    finally:
        for p in pubs.values():
            p.close()


def test_wait_connected_waits_for_every_pod_and_names_the_missing():
    pub = Publisher()
    dead = Publisher(replay=False)
    dead_spec = dead.spec("dead")
    dead.close()  # nothing listens on its port now
    try:
        with make([pub.spec()]) as svc:
            assert svc.wait_connected(10.0, settle_s=0.1)
            # The settle is a guess at the subscription's travel (vLLM's PUB cannot tell);
            # this publisher can, and a loaded machine may need longer than the guess.
            assert pub.wait_subscribed()
            a = Prompt(0, 2)
            pub.publish([a.stored(0, 2)])
            assert wait_until(lambda: matched(svc, a) == 2)
        with make([pub.spec(), dead_spec]) as svc:
            assert not svc.wait_connected(0.5)
    finally:
        pub.close()
