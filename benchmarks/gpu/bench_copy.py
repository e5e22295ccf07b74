"""Host-tier store/load bandwidth on a GPU against a pinned torch copy of the same bytes.

Geometry: Llama-3.1-8B's KV (32 layers, 8 KV heads of 128, bf16, block size 16: 2 MiB per
block of all layers) in vLLM's FlashAttention layout ([2, num_blocks, 16, 8, 128] per
layer). Store = TierWorker.run(stores) until the store has landed (wait_stores);
load = TierWorker.run(loads) + synchronize. Reference: one contiguous
``copy_(non_blocking=True)`` of the same number of bytes between the device and
``pin_memory()`` host memory (cudaMemcpyAsync on pinned memory), and the same into the
registered pool. Median of ``--reps``.

usage: python benchmarks/gpu/bench_copy.py [--out FILE.json] [--reps 9]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid

import torch

from kvtier.tier.ops import LoadOp, StoreOp
from kvtier.tier.worker import TierWorker

LAYERS, BS, HEADS, HEAD = 32, 16, 8, 128
BLOCK_BYTES = LAYERS * 2 * BS * HEADS * HEAD * 2  # 2 MiB


def timed(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--num-blocks", type=int, default=2048)
    ap.add_argument("--sizes", default="187,1000", help="blocks per op (3k, 16k tokens)")
    a = ap.parse_args()
    nb = a.num_blocks
    kv = {f"model.layers.{i}.self_attn.attn": torch.randn(
        2, nb, BS, HEADS, HEAD, device="cuda", dtype=torch.bfloat16) for i in range(LAYERS)}
    sizes = [int(x) for x in a.sizes.split(",")]
    slots = max(sizes)
    w = TierWorker(f"bench-{uuid.uuid4().hex}", slots, BLOCK_BYTES, nb, tuple(kv))
    w.register_kv_caches(kv)
    assert w._cuda is not None
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "block_bytes": BLOCK_BYTES, "pool_pinned": w._pinned_addr is not None,
                 "reps": a.reps, "cases": []}
    job = iter(range(1, 1 << 30))
    for n in sizes:
        nbytes = n * BLOCK_BYTES
        blocks = tuple(range(7, 7 + n))
        sl = tuple(range(n))
        scattered = tuple(range(nb - 1, nb - 1 - 2 * n, -2))[:n]  # non-consecutive GPU blocks

        def store(b=blocks):
            w.run([], [StoreOp(next(job), "r", b, sl)])
            w.wait_stores()  # stores are polled: wait here for the timing
            w.take_done()
            w.take_finished_sending()

        def load(b=blocks):
            w.run([LoadOp(next(job), b, sl)], [])
            w.take_done()

        dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
        assert w._pool_t is not None
        pool = w._pool_t[:n].view(-1)
        store()
        load()  # warm-up
        case = {"blocks": n, "tokens": n * BS, "bytes": nbytes}
        for name, fn in [("tier_store", store), ("tier_load", load),
                         ("tier_store_scattered", lambda: store(scattered)),
                         ("tier_load_scattered", lambda: load(scattered)),
                         ("pinned_d2h", lambda: host.copy_(dev, non_blocking=True)),
                         ("pinned_h2d", lambda: dev.copy_(host, non_blocking=True)),
                         ("pool_d2h", lambda: pool.copy_(dev, non_blocking=True)),
                         ("pool_h2d", lambda: dev.copy_(pool, non_blocking=True))]:
            ts = timed(fn, a.reps)
            med = statistics.median(ts)
            case[name] = {"median_ms": med * 1e3, "min_ms": min(ts) * 1e3,
                          "GBps": nbytes / med / 1e9}
        case["store_vs_pinned"] = case["pinned_d2h"]["median_ms"] / case["tier_store"]["median_ms"]
        case["load_vs_pinned"] = case["pinned_h2d"]["median_ms"] / case["tier_load"]["median_ms"]
        res["cases"].append(case)
        print(json.dumps(case), flush=True)
    w.close()
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
