"""Peer fetch between two processes: real ZMQ side channel, real NIXL READ of pool slots."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time

import numpy as np
import pytest

from kvtier.ids import RequestKey
from kvtier.runtime import free_ports
from kvtier.tier.manager import HostTier
from kvtier.tier.pool import HostPool

pytestmark = pytest.mark.integration

SLOT = 4096
KEYS = [RequestKey(1000 + i) for i in range(8)]


def ident(block_size=32):
    from kvtier.wire.peer import Identity

    return Identity("tiny", block_size, 0, "test-layout", SLOT)


def _pattern(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, SLOT, dtype=np.uint8)


def _source(port: int, conn) -> None:
    from kvtier.tier.nixl import NixlPool
    from kvtier.tier.peer import PeerServer
    from kvtier.wire.peer import Release

    pool = HostPool(16, SLOT)
    tier = HostTier(16, SLOT)
    lock = threading.RLock()
    job = tier.prepare_store(KEYS)
    for i, slot in enumerate(job.slots):
        pool.array[slot] = _pattern(i)
    tier.complete_store(job.job_id, True)
    server = PeerServer(tier, lock, NixlPool(pool, "source"), ident(), "127.0.0.1", port)
    acks = threading.Event()
    acks.set()
    handle = server.handle

    def gated(req):
        if isinstance(req, Release):
            acks.wait()  # "hold-acks": the Ack of a Release waits until "free-acks"
        return handle(req)

    server.handle = gated  # type: ignore[method-assign]
    conn.send("ready")
    while True:
        cmd = conn.recv()
        if cmd == "hold-acks":
            acks.clear()
            conn.send("ok")
        elif cmd == "free-acks":
            acks.set()
            conn.send("ok")
        elif cmd == "evict":
            with lock:
                tier.evict(KEYS[4:])
            conn.send("ok")
        elif cmd == "stats":
            with lock:
                conn.send(tier.stats.snapshot())
        else:
            break
    server.close()


@pytest.fixture
def source():
    port = free_ports(1)[0]
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    proc = ctx.Process(target=_source, args=(port, b), daemon=True)
    proc.start()
    assert a.poll(60) and a.recv() == "ready"
    yield port, a, proc
    if proc.is_alive():
        a.send("stop")
        proc.join(10)
    if proc.is_alive():
        proc.kill()


def _consumer(name="consumer", block_size=32):
    from kvtier.tier.nixl import NixlPool
    from kvtier.tier.peer import PeerClient

    pool = HostPool(16, SLOT)
    tier = HostTier(16, SLOT)
    client = PeerClient(tier, threading.RLock(), NixlPool(pool, name), ident(block_size),
                        timeout_s=3.0)
    return pool, tier, client


def test_fetch_reads_slots_bytes_identical_and_unpins(source):
    port, ctl, _ = source
    pool, tier, client = _consumer()
    res = client.fetch("127.0.0.1", port, KEYS)
    assert (res.blocks, res.fetched, res.reason) == (8, 8, None)
    for i, k in enumerate(KEYS):
        assert np.array_equal(pool.array[tier.slot_of(k)], _pattern(i))
    # The source unpins (and counts) at the Release, which the reader does not wait for.
    assert _source_stats(ctl, lambda s: s["bytes_moved"]["peer_out"] == 8 * SLOT)
    assert tier.stats.bytes_moved["peer_in"] == 8 * SLOT
    # Each phase of the reader's side is timed: first contact, pin, READ, Release.
    snap = tier.stats.snapshot()
    assert snap["peer_fetches"] == 1
    assert all(snap["peer_fetch_s"][p] > 0 for p in ("handshake", "hold", "read", "release"))
    # Already local: no second transfer, and the source is not asked.
    again = client.fetch("127.0.0.1", port, KEYS)
    assert (again.blocks, again.fetched) == (8, 0)
    assert tier.stats.snapshot()["peer_fetches"] == 1


def _source_stats(ctl, ok, wait_s: float = 10.0) -> bool:
    deadline = time.monotonic() + wait_s
    while True:
        ctl.send("stats")
        if ok(ctl.recv()):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def test_fetch_does_not_wait_for_the_ack_of_its_release(source):
    # The source's PeerServer shares a busy engine's process and GIL: its Ack can be late.
    # The reader sends the Release and goes on; the next request to that peer reads the Ack.
    port, ctl, _ = source
    ctl.send("hold-acks")
    assert ctl.recv() == "ok"
    pool, tier, client = _consumer("consumer-unacked")
    client.timeout_s = 60.0  # waiting for the Ack would hold the fetch this long
    done: list = []
    t = threading.Thread(target=lambda: done.append(client.fetch("127.0.0.1", port, KEYS[:4])))
    t.start()
    t.join(20)
    assert done, "fetch waited for the Ack of its Release"
    assert (done[0].blocks, done[0].fetched, done[0].reason) == (4, 4, None)
    ctl.send("free-acks")
    assert ctl.recv() == "ok"
    # The next fetch from that peer reads the late Ack first, then pulls the rest.
    res = client.fetch("127.0.0.1", port, KEYS)
    assert (res.blocks, res.fetched, res.reason) == (8, 4, None)
    for i, k in enumerate(KEYS):
        assert np.array_equal(pool.array[tier.slot_of(k)], _pattern(i))
    assert _source_stats(ctl, lambda s: s["bytes_moved"]["peer_out"] == 8 * SLOT)


def test_a_peer_gone_before_acking_a_release_falls_back_once_then_reconnects(source):
    port, ctl, proc = source
    ctl.send("hold-acks")
    assert ctl.recv() == "ok"
    _, tier, client = _consumer("consumer-gone")
    client.timeout_s = 1.0
    assert client.fetch("127.0.0.1", port, KEYS[:4]).fetched == 4
    proc.kill()
    proc.join(10)
    res = client.fetch("127.0.0.1", port, KEYS)
    assert (res.blocks, res.fetched) == (4, 0) and res.reason.startswith("unreachable")
    assert tier.stats.peer_fallbacks == {"unreachable": 1}
    assert not client._socks and not client._unacked  # nothing stale kept for that peer
    assert tier.stats.peer_fetches == 2  # a fetch that fell back is timed too


def test_source_evicted_before_fetch_gives_partial_and_counts(source):
    port, ctl, _ = source
    ctl.send("evict")
    assert ctl.recv() == "ok"
    pool, tier, client = _consumer("consumer2")
    res = client.fetch("127.0.0.1", port, KEYS)
    assert res.blocks == 4 and res.reason is not None
    assert tier.stats.peer_fallbacks == {"partial": 1}
    for i, k in enumerate(KEYS[:4]):
        assert np.array_equal(pool.array[tier.slot_of(k)], _pattern(i))


def test_mismatched_block_size_is_refused(source):
    port, _, _ = source
    _, tier, client = _consumer("consumer3", block_size=64)
    res = client.fetch("127.0.0.1", port, KEYS)
    assert res.blocks == 0 and "block_size" in res.reason
    assert tier.stats.peer_fallbacks == {"refused": 1}


def test_dead_source_falls_back(source):
    port, _, proc = source
    proc.kill()
    proc.join(10)
    _, tier, client = _consumer("consumer4")
    res = client.fetch("127.0.0.1", port, KEYS)
    assert res.blocks == 0
    assert tier.stats.peer_fallbacks == {"unreachable": 1}
