"""Peer fetch with CUDA engines on both ends: blocks stored from one process's GPU KV
into its pinned host pool are READ over NIXL (UCX, DRAM -> DRAM) into another process's
pool and loaded into that process's GPU KV, bytes equal.

Each side is set up as KVTierConnector sets up one engine: the worker's mapping of the
``/dev/shm`` pool is pinned (cudaHostRegister) by ``TierWorker``, the scheduler's own
mapping of the same file is registered with NIXL (``NixlPool``) and served by
``PeerServer`` / read by ``PeerClient``. Skipped where nixl is not installed."""

from __future__ import annotations

import multiprocessing as mp
import threading
import uuid

import pytest

pytest.importorskip("nixl")

pytestmark = pytest.mark.gpu

NUM_BLOCKS, LAYERS, BS, HEADS, HEAD = 48, 4, 16, 8, 128
SLOTS = 32
SRC_BLOCKS = (3, 4, 5, 6, 20, 21, 30, 9, 10, 11)  # runs and strays, as a prompt's blocks are
DST_BLOCKS = (40, 41, 42, 43, 44, 45, 46, 47, 1, 2)


def _caches(device: str, seed: int, zero: bool = False):
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    return {f"l{i}": (torch.zeros(2, NUM_BLOCKS, BS, HEADS, HEAD, device=device,
                                  dtype=torch.bfloat16) if zero else
                      torch.randn(2, NUM_BLOCKS, BS, HEADS, HEAD, device=device, generator=g,
                                  dtype=torch.float32).to(torch.bfloat16))
            for i in range(LAYERS)}


def _slot_bytes() -> int:
    return LAYERS * 2 * BS * HEADS * HEAD * 2


def _identity():
    from kvtier.wire.peer import Identity

    return Identity("gputest", BS, 0, "flash-nhd|bs16", _slot_bytes())


def _keys():
    from kvtier.ids import RequestKey

    return [RequestKey(5000 + i) for i in range(len(SRC_BLOCKS))]


def _engine(tag: str, kv):
    """(TierWorker, HostTier, NixlPool): the two halves of one engine's connector."""
    from kvtier.tier.manager import HostTier
    from kvtier.tier.nixl import NixlPool
    from kvtier.tier.pool import HostPool
    from kvtier.tier.worker import TierWorker

    w = TierWorker(tag, SLOTS, _slot_bytes(), NUM_BLOCKS, tuple(kv))
    w.register_kv_caches(kv)
    tier = HostTier(SLOTS, _slot_bytes())
    nixl = NixlPool(HostPool.shared(tag, SLOTS, _slot_bytes()), f"agent-{tag}")
    return w, tier, nixl


def _source(device: str, tag: str, port: int, conn) -> None:
    from kvtier.tier.ops import StoreOp
    from kvtier.tier.peer import PeerServer

    kv = _caches(device, seed=11)
    w, tier, nixl = _engine(tag, kv)
    job = tier.prepare_store(_keys())
    assert job is not None and len(job.slots) == len(SRC_BLOCKS)
    w.run([], [StoreOp(job.job_id, "turn1", SRC_BLOCKS, tuple(job.slots))])
    w.wait_stores()
    assert w.take_done()[0] == [job.job_id]
    tier.complete_store(job.job_id, True)
    server = PeerServer(tier, threading.RLock(), nixl, _identity(), "127.0.0.1", port)
    conn.send(("ready", w._pinned_addr is not None if device == "cuda" else True))
    conn.recv()
    out = tier.stats.snapshot()
    server.close()
    w.close()
    nixl.close()
    conn.send(out)


def peer_roundtrip(device: str) -> None:
    """The whole check; ``device="cpu"`` runs the same steps without a GPU (dry run)."""
    import torch

    from kvtier.runtime import free_ports
    from kvtier.tier.ops import LoadOp
    from kvtier.tier.peer import PeerClient

    port = free_ports(1)[0]
    run = uuid.uuid4().hex[:8]
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    proc = ctx.Process(target=_source, args=(device, f"gpt-src-{run}", port, b), daemon=True)
    proc.start()
    try:
        assert a.poll(120), "source process did not start"
        msg, pinned = a.recv()
        assert msg == "ready" and pinned
        kv = _caches(device, seed=0, zero=True)
        w, tier, nixl = _engine(f"gpt-dst-{run}", kv)
        if device == "cuda":
            assert w._cuda is not None and w._pinned_addr is not None
        client = PeerClient(tier, threading.RLock(), nixl, _identity(), timeout_s=30.0)
        keys = _keys()
        res = client.fetch("127.0.0.1", port, keys)
        assert (res.blocks, res.fetched, res.reason) == (len(keys), len(keys), None)
        job = tier.prepare_load(keys)
        assert job is not None
        w.run([LoadOp(job.job_id, DST_BLOCKS, tuple(job.slots))], [])
        assert w.take_done()[1] == [(job.job_id, True)]
        tier.complete_load(job.job_id, True)
        want = _caches(device, seed=11)
        src = torch.tensor(SRC_BLOCKS, device=device)
        dst = torch.tensor(DST_BLOCKS, device=device)
        for name, t in kv.items():
            assert torch.equal(t.index_select(1, dst), want[name].index_select(1, src)), name
        others = torch.tensor([i for i in range(NUM_BLOCKS) if i not in DST_BLOCKS],
                              device=device)
        assert all(not t.index_select(1, others).any() for t in kv.values())
        assert tier.stats.bytes_moved["peer_in"] == len(keys) * _slot_bytes()
        a.send("stop")
        assert a.poll(60)
        snap = a.recv()
        assert snap["bytes_moved"]["peer_out"] == len(keys) * _slot_bytes()
        client.close()
        w.close()
        nixl.close()
    finally:
        proc.join(20)
        if proc.is_alive():
            proc.kill()


def test_peer_fetch_between_cuda_engines_moves_exact_bytes():
    peer_roundtrip("cuda")
