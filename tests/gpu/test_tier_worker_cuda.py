"""TierWorker's CUDA path on a real GPU: pinned pool, batched copies on a side stream.

The layout is vLLM's FlashAttention one (``[2, num_blocks, block_size, kv_heads, head]``
per layer, block dimension second), bf16, as on the H200 with vLLM 0.26.0."""

from __future__ import annotations

import uuid

import pytest
import torch

from kvtier.tier.cuda_copy import STAGE_BYTES, HostPins
from kvtier.tier.ops import LoadOp, StoreOp
from kvtier.tier.pool import HostPool, pool_tag
from kvtier.tier.worker import TierWorker

pytestmark = pytest.mark.gpu

NUM_BLOCKS, LAYERS, BS, HEADS, HEAD = 64, 4, 16, 8, 128


def _caches() -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(0)
    return {f"l{i}": torch.randn(2, NUM_BLOCKS, BS, HEADS, HEAD, device="cuda", generator=g,
                                 dtype=torch.float32).to(torch.bfloat16) for i in range(LAYERS)}


def _slot_bytes() -> int:
    return LAYERS * 2 * BS * HEADS * HEAD * 2


def _worker(kv: dict[str, torch.Tensor], num_slots: int = 32, **kw) -> TierWorker:
    w = TierWorker(f"gputest-{uuid.uuid4().hex}", num_slots, _slot_bytes(), NUM_BLOCKS,
                   tuple(kv), **kw)
    w.register_kv_caches(kv)
    return w


@pytest.mark.parametrize("dma_stores", [True, False], ids=["dma-store", "gather-store"])
@pytest.mark.parametrize("stage_bytes", [STAGE_BYTES, 2 * 3 * LAYERS * 2 * BS * HEADS
                                         * HEAD * 2], ids=["one-chunk", "chunks-of-3"])
@pytest.mark.parametrize("block_ids,slots", [(tuple(range(10, 30)), tuple(range(20))),
                                              ((9, 2, 14, 7, 8), (5, 0, 3, 6, 7)),
                                              ((1, 3, 5, 7, 9, 11, 13), (6, 5, 4, 3, 2, 1, 0))],
                         ids=["one-run", "four-runs", "scattered-index-select"])
def test_store_then_load_restores_exact_bytes(stage_bytes, block_ids, slots, dma_stores):
    kv = _caches()
    w = _worker(kv, stage_bytes=stage_bytes, dma_stores=dma_stores)
    try:
        assert w._cuda is not None and w._pinned_addr is not None
        assert w._cuda.dma_stores is dma_stores  # the driver has cuMemcpyBatchAsync
        saved = {n: t.index_select(1, torch.tensor(block_ids, device="cuda")).clone()
                 for n, t in kv.items()}
        w.run([], [StoreOp(1, "r1", block_ids, slots)])
        w.wait_stores()
        assert w.take_finished_sending() == {"r1"}
        for t in kv.values():
            t.zero_()
        dst = tuple(NUM_BLOCKS - 1 - i for i in range(len(block_ids)))
        w.run([LoadOp(2, dst, slots)], [])
        # the forward stream waits for the load: read on the current stream without a sync
        for n, t in kv.items():
            assert torch.equal(t.index_select(1, torch.tensor(dst, device="cuda")), saved[n])
        others = [b for b in range(NUM_BLOCKS) if b not in dst]
        assert all(not t.index_select(1, torch.tensor(others, device="cuda")).any()
                   for t in kv.values())
        assert w.take_done() == ([1], [(2, True)])
    finally:
        w.close()


@pytest.mark.parametrize("dma_stores", [True, False], ids=["dma-store", "gather-store"])
def test_pool_bytes_are_the_cpu_layout(dma_stores):
    """The slot layout is the one the CPU path and the peer protocol use: layer after
    layer, each layer's block in the per-layer view's order with the block dim first."""
    kv = _caches()
    w = _worker(kv, dma_stores=dma_stores)
    try:
        w.run([], [StoreOp(1, "r", (5,), (3,))])
        w.wait_stores()
        assert w.take_done() == ([1], [])
        assert w.pool is not None
        row = torch.from_numpy(w.pool.array[3].copy())
        want = torch.cat([t.movedim(1, 0)[5].contiguous().view(torch.uint8).reshape(-1).cpu()
                          for t in kv.values()])
        assert torch.equal(row, want)
    finally:
        w.close()


def test_pinning_is_idempotent_and_undone_on_close():
    kv = _caches()
    w1 = _worker(kv)
    try:
        addr = w1._pinned_addr
        assert addr is not None and w1.pins.ranges()[addr][1] == 1
        # a second registration of the same range counts a reference, raises nothing,
        # and leaves no CUDA error behind for the next kernel
        assert w1.pins.pin(addr, w1.pool.nbytes)
        assert w1.pins.ranges()[addr][1] == 2
        w1.pins.unpin(addr)
        torch.ones(8, device="cuda").sum().item()
    finally:
        w1.close()
    assert addr not in w1.pins.ranges()
    # registered by someone else first (cudaErrorHostMemoryAlreadyRegistered): accepted,
    # the error is cleared, and close() does not unregister what it did not register
    pool = HostPool(4, 1 << 20)
    a = pool.base_address
    assert int(torch.cuda.cudart().cudaHostRegister(a, pool.nbytes, 0)) == 0
    pins = HostPins()
    try:
        assert pins.pin(a, pool.nbytes)
        torch.ones(8, device="cuda").sum().item()  # no sticky error surfaces here
        pins.unpin(a)
        assert a not in pins.ranges()
    finally:
        assert int(torch.cuda.cudart().cudaHostUnregister(a)) == 0


def test_tp_ranks_get_separate_pools():
    tags = {pool_tag("e0", r, 2) for r in range(2)}
    assert len(tags) == 2
    pools = [HostPool.shared(t, 2, 4096) for t in sorted(tags)]
    try:
        pools[0].array[0, :] = 1
        assert not pools[1].array.any()
    finally:
        for p in pools:
            p.close()


def test_store_overlaps_a_running_kernel_and_is_reported_only_when_done():
    kv = _caches()
    w = _worker(kv)
    try:
        a = torch.randn(4096, 4096, device="cuda")
        for _ in range(20):  # queue tens of ms of work on the forward stream
            a = a @ a / 64
        w.run([], [StoreOp(7, "r7", tuple(range(20)), tuple(range(20)))])
        # the store waits for the forward stream's earlier work; asking does not wait for it
        assert w.take_finished_sending() == set()
        assert w.take_done() == ([], [])
        torch.cuda.synchronize()
        assert w.take_finished_sending() == {"r7"}  # reported once done
        assert w.take_done() == ([7], [])
        assert w._cuda is not None and w._cuda.dma.query()
    finally:
        w.close()


def test_dma_store_launches_no_kernel():
    """A store is one batch copy on the copy stream: the profiler sees memcpys and no
    kernel on the worker's streams (the gather store, for contrast, runs kernels)."""
    kv = _caches()
    kernels = {}
    # the control stores one run of blocks: strided copy kernels, seen by any profiler
    for dma, ids in ((True, (1, 3, 5, 7, 9, 11, 13)), (False, (20, 21, 22))):
        w = _worker(kv, dma_stores=dma)
        try:
            torch.cuda.synchronize()
            with torch.profiler.profile(
                    activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                w.run([], [StoreOp(1, "r", ids, tuple(range(len(ids))))])
                w.wait_stores()
                torch.cuda.synchronize()
            kernels[dma] = [e.name for e in prof.events()
                            if e.device_type == torch.autograd.DeviceType.CUDA
                            and "memcpy" not in e.name.lower()
                            and "memset" not in e.name.lower()]
        finally:
            w.close()
    assert kernels[True] == []
    assert kernels[False]


def test_store_and_load_in_one_step_share_the_pipeline():
    """A step with stores and loads over more chunks than staging buffers: every byte
    lands where it belongs (the stages are reused only when their last user is done)."""
    kv = _caches()
    stage = 2 * 2 * _slot_bytes()  # two stages of 2 slots
    w = _worker(kv, stage_bytes=stage)
    try:
        first = tuple(range(10))
        w.run([], [StoreOp(1, "a", first, tuple(range(10)))])
        w.wait_stores()
        w.take_done()
        saved = {n: t.index_select(1, torch.tensor(first, device="cuda")).clone()
                 for n, t in kv.items()}
        second = tuple(range(20, 30))
        saved2 = {n: t.index_select(1, torch.tensor(second, device="cuda")).clone()
                  for n, t in kv.items()}
        dst = tuple(range(40, 50))
        w.run([LoadOp(3, dst, tuple(range(10)))], [StoreOp(2, "b", second, tuple(range(10, 20)))])
        for n, t in kv.items():
            assert torch.equal(t.index_select(1, torch.tensor(dst, device="cuda")), saved[n])
        w.wait_stores()
        assert w.take_done() == ([2], [(3, True)])
        w.run([LoadOp(4, first, tuple(range(10, 20)))], [])
        for n, t in kv.items():
            assert torch.equal(t.index_select(1, torch.tensor(first, device="cuda")), saved2[n])
        assert w.take_done() == ([], [(4, True)])
    finally:
        w.close()
