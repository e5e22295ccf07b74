"""Host-tier store of scattered GPU blocks (every other block, the ``index_select`` path of
``CudaCopier._gather``) at 3k tokens: candidate fixes against today's code, each checked
byte for byte against the pool layout, against a pinned copy of the same bytes.

Variants (store = ``TierWorker.run(stores)`` until reported done, median of ``--reps``):
- ``tmp``: index_select into a temporary, then a strided copy into the stage (2 kernels
  per layer and chunk; the code of 2026-12-03), 128 MiB of staging (chunks of 32 blocks);
- ``out``: ``torch.index_select(..., out=stage view)``: 1 kernel per layer and chunk (the
  code since 2026-12-04);
- ``tmp+stage512`` / ``out+stage512``: the same with 512 MiB of staging (chunks of 128).
Two block patterns: ``every-other`` (ascending, a 382-block cache) and ``bench_copy``
(bench_copy.py's scattered case: descending every other block from the end of a
2,048-block cache, 1,000-slot pool).

usage: python benchmarks/gpu/bench_scatter.py [--out FILE.json] [--reps 9] [--blocks 187]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid

import torch

from kvtier.tier import cuda_copy as tier_worker
from kvtier.tier.cuda_copy import CudaCopier
from kvtier.tier.ops import StoreOp, runs
from kvtier.tier.worker import TierWorker

LAYERS, BS, HEADS, HEAD = 32, 16, 8, 128
BLOCK_BYTES = LAYERS * 2 * BS * HEADS * HEAD * 2  # 2 MiB
ORIG = CudaCopier._gather


def gather_tmp(self, block_ids, views):  # type: ignore[no-untyped-def]
    if len(runs(block_ids, range(len(block_ids)))) <= tier_worker.MAX_RUN_COPIES:
        return ORIG(self, block_ids, views)
    idx = self._index(block_ids)
    n = len(block_ids)
    for layer, dst in zip(self.layers, views):
        dst[:n].copy_(layer.view.index_select(0, idx))


def gather_out(self, block_ids, views):  # type: ignore[no-untyped-def]
    if len(runs(block_ids, range(len(block_ids)))) <= tier_worker.MAX_RUN_COPIES:
        return ORIG(self, block_ids, views)
    idx = self._index(block_ids)
    n = len(block_ids)
    for layer, dst in zip(self.layers, views):
        torch.index_select(layer.view, 0, idx, out=dst[:n])


def run_pattern(name: str, num_blocks: int, ids: tuple[int, ...], pool_slots: int,
                reps: int) -> dict:
    n = len(ids)
    kv = {f"l{i}": torch.randn(2, num_blocks, BS, HEADS, HEAD, device="cuda",
                               dtype=torch.bfloat16) for i in range(LAYERS)}
    slots = tuple(range(n))
    want = torch.cat([t.movedim(1, 0)[list(ids)].reshape(n, -1).view(torch.uint8)
                      for t in kv.values()], dim=1).cpu()
    res: dict = {"pattern": name, "blocks": n, "bytes": n * BLOCK_BYTES,
                 "num_blocks": num_blocks, "variants": {}}
    host = torch.empty(n * BLOCK_BYTES, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n * BLOCK_BYTES, dtype=torch.uint8, device="cuda")
    ts = []
    for _ in range(reps + 1):
        torch.cuda.synchronize()
        t = time.perf_counter()
        host.copy_(dev, non_blocking=True)
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    res["pinned_d2h_ms"] = statistics.median(ts[1:]) * 1e3
    for vname, gather, stage in (("tmp", gather_tmp, tier_worker.STAGE_BYTES),
                                 ("out", gather_out, tier_worker.STAGE_BYTES),
                                 ("tmp+stage512", gather_tmp, 512 << 20),
                                 ("out+stage512", gather_out, 512 << 20)):
        CudaCopier._gather = gather  # type: ignore[method-assign]
        w = None
        err = None
        try:
            w = TierWorker(f"scat-{uuid.uuid4().hex}", pool_slots, BLOCK_BYTES, num_blocks,
                           tuple(kv), stage_bytes=stage)
            w.register_kv_caches(kv)
            ts = []
            for r in range(reps + 1):
                torch.cuda.synchronize()
                t = time.perf_counter()
                w.run([], [StoreOp(r, f"r{r}", ids, slots)])
                w.take_done()
                ts.append(time.perf_counter() - t)
            assert w._pool_t is not None
            ok = bool(torch.equal(w._pool_t[:n], want))
        except Exception as e:  # noqa: BLE001 - a variant that does not run is reported, not fatal
            err, ok, ts = repr(e), False, [float("nan")] * 2
        finally:
            if w is not None:
                w.close()
            CudaCopier._gather = ORIG  # type: ignore[method-assign]
        med = statistics.median(ts[1:]) * 1e3
        res["variants"][vname] = {"median_ms": med, "ms": [x * 1e3 for x in ts[1:]],
                                  "vs_pinned": res["pinned_d2h_ms"] / med, "bytes_equal": ok,
                                  "error": err}
        print(json.dumps({name: {vname: res["variants"][vname] | {"ms": None}}}), flush=True)
    del kv
    torch.cuda.empty_cache()
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--blocks", type=int, default=187)
    a = ap.parse_args()
    n = a.blocks
    out = {"patterns": [
        run_pattern("every-other", 2 * n + 8, tuple(range(0, 2 * n, 2)), n + 8, a.reps),
        run_pattern("bench_copy", 2048, tuple(range(2047, 2047 - 2 * n, -2))[:n], 1000, a.reps),
    ]}
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
