"""Host-tier store of scattered GPU blocks (the ``index_select`` path of ``CudaCopier._gather``)
at 3k tokens: the gather as one CUDA graph per chunk (the code since 2026-12-06) against one
``index_select`` kernel per layer and chunk (before), each checked byte for byte against the
pool layout, against a pinned copy of the same bytes (``pinned_d2h_ms``, timed in the same run).

Variants (store = ``TierWorker.run(stores)`` until reported done, median of ``--reps``, every
sample kept): ``graph`` / ``per-layer``, with the default 128 MiB of staging and with 512 MiB.
Two block patterns: ``every-other`` (ascending, a 382-block cache) and ``bench_copy``
(bench_copy.py's scattered case: descending every other block from the end of a
2,048-block cache, 1,000-slot pool).

usage: python benchmarks/gpu/bench_scatter.py [--out FILE.json] [--reps 25] [--blocks 187]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid

import torch

from kvtier.tier import cuda_copy as tier_worker
from kvtier.tier.ops import StoreOp
from kvtier.tier.worker import TierWorker

LAYERS, BS, HEADS, HEAD = 32, 16, 8, 128
BLOCK_BYTES = LAYERS * 2 * BS * HEADS * HEAD * 2  # 2 MiB
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
    for vname, graph, stage in (("graph", True, tier_worker.STAGE_BYTES),
                                ("per-layer", False, tier_worker.STAGE_BYTES),
                                ("graph+stage512", True, 512 << 20),
                                ("per-layer+stage512", False, 512 << 20)):
        w = None
        err = None
        try:
            w = TierWorker(f"scat-{uuid.uuid4().hex}", pool_slots, BLOCK_BYTES, num_blocks,
                           tuple(kv), stage_bytes=stage, dma_stores=False)  # the gather paths
            w.register_kv_caches(kv)
            assert w._cuda is not None
            used_graph = w._cuda._graphs is not None
            if not graph:
                w._cuda._graphs = None  # the per-layer kernels of before
            ts = []
            for r in range(reps + 1):
                torch.cuda.synchronize()
                t = time.perf_counter()
                w.run([], [StoreOp(r, f"r{r}", ids, slots)])
                w.wait_stores()
                w.take_done()
                ts.append(time.perf_counter() - t)
            assert w._pool_t is not None
            ok = bool(torch.equal(w._pool_t[:n], want))
        except Exception as e:  # noqa: BLE001 - a variant that does not run is reported, not fatal
            err, ok, ts, used_graph = repr(e), False, [float("nan")] * 2, False
        finally:
            if w is not None:
                w.close()
        med = statistics.median(ts[1:]) * 1e3
        res["variants"][vname] = {"median_ms": med, "ms": [x * 1e3 for x in ts[1:]],
                                  "vs_pinned": res["pinned_d2h_ms"] / med, "bytes_equal": ok,
                                  "graph_captured": used_graph, "error": err}
        print(json.dumps({name: {vname: res["variants"][vname] | {"ms": None}}}), flush=True)
    del kv
    torch.cuda.empty_cache()
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--blocks", type=int, default=187)
    a = ap.parse_args()
    n = a.blocks
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "patterns": [
        run_pattern("every-other", 2 * n + 8, tuple(range(0, 2 * n, 2)), n + 8, a.reps),
        run_pattern("bench_copy", 2048, tuple(range(2047, 2047 - 2 * n, -2))[:n], 1000, a.reps),
    ]}
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
