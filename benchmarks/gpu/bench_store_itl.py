"""What kvtier's stores cost a decode step, torch only (no vLLM): gather vs DMA-only, waited vs polled.

A decode-step proxy, captured once as a CUDA graph on the forward stream: 32 layers of
``x[16, 4096] @ W1[4096, 28672]`` and ``@ W2[28672, 4096]`` in bf16 (15 GB of weights read
per step, memory-bound like an 8B decode step, ~5-6 ms on an H100). Each step does what vLLM's
model runner does with a KV connector: ``TierWorker.run`` (start_load_kv, only when a store is
queued), the forward, ``take_finished_sending`` / ``take_done`` (get_finished), then a small
device-to-host read of the output (sampling's sync). Every EVERY-th step queues one store of
BLOCKS blocks (2,048 tokens: 256 MiB of an 8B-shaped KV cache, vLLM's FlashAttention layout),
its blocks consecutive but descending and its slots ascending (what vLLM's free-block queue
hands a request once blocks have been freed and reused).

Variants, rotated over ROUNDS rounds, the same steps each: ``base`` (no store);
``gather_wait`` (SM gather into staging + DMA, get_finished waits for the store: the path
before 2026-12-06); ``gather_poll`` (the same, polled: the default); ``dma_wait`` and
``dma_poll`` (``dma_stores``: one ``cuMemcpyBatchAsync`` per store, no kernel). Per variant: step time
p50 / p90 / p99 and its ratio to ``base``. Also each store path alone (no decode): median
time of a 2,048- and a 16,000-token store against a pinned contiguous copy of the same bytes.

usage: bench_store_itl.py --out OUT.json [--rounds 3] [--steps 300] [--every 20]
       bench_store_itl.py --table OUT.json [MD]   (the tables, from the JSON)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid

LAYERS, BS, HEADS, HEAD = 32, 16, 8, 128
BLOCK_BYTES = LAYERS * 2 * BS * HEADS * HEAD * 2
VARIANTS = ("base", "gather_wait", "gather_poll", "dma_wait", "dma_poll")


def q(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(p * len(s)))]


def run(a: argparse.Namespace) -> dict:
    import torch

    from kvtier.tier.ops import StoreOp
    from kvtier.tier.worker import TierWorker

    dev = torch.device("cuda")
    nb = a.num_blocks
    kv = {f"model.layers.{i}.self_attn.attn": torch.randn(
        2, nb, BS, HEADS, HEAD, device=dev, dtype=torch.bfloat16) for i in range(LAYERS)}
    slots = max(a.blocks, 1000)
    workers = {}
    for name, dma in (("dma", True), ("gather", False)):
        w = TierWorker(f"itl-{uuid.uuid4().hex}", slots, BLOCK_BYTES, nb, tuple(kv),
                       dma_stores=dma)
        w.register_kv_caches(kv)
        assert w._cuda is not None
        workers[name] = w
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "cuda": torch.version.cuda, "block_bytes": BLOCK_BYTES,
                 "pool_pinned": workers["dma"]._pinned_addr is not None,
                 "dma_stores": workers["dma"]._cuda.dma_stores,  # type: ignore[union-attr]
                 "blocks_per_store": a.blocks, "every": a.every, "rounds": a.rounds,
                 "steps": a.steps, "alone": [], "itl": {}}
    print(json.dumps({k: res[k] for k in ("device", "torch", "cuda", "pool_pinned",
                                          "dma_stores")}), flush=True)
    job = iter(range(1, 1 << 30))

    def blocks_for(n: int, k: int) -> tuple[int, ...]:
        top = (k * 257) % (nb - n) + n - 1  # consecutive, descending, moving over the cache
        return tuple(range(top, top - n, -1))

    # each store path alone: wall time until the store is done, vs a pinned copy
    for n in (a.blocks, 1000):
        nbytes = n * BLOCK_BYTES
        src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
        case: dict = {"blocks": n, "tokens": n * BS, "bytes": nbytes}
        for name, w in workers.items():
            ts = []
            for r in range(a.reps + 1):
                torch.cuda.synchronize()
                t = time.perf_counter()
                w.run([], [StoreOp(next(job), "a", blocks_for(n, r), tuple(range(n)))])
                w.wait_stores()
                ts.append(time.perf_counter() - t)
                w.take_done()
                w.take_finished_sending()
            case[f"{name}_store_ms"] = statistics.median(ts[1:]) * 1e3
        ts = []
        for _ in range(a.reps + 1):
            torch.cuda.synchronize()
            t = time.perf_counter()
            host.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            ts.append(time.perf_counter() - t)
        case["pinned_d2h_ms"] = statistics.median(ts[1:]) * 1e3
        for name in workers:
            case[f"{name}_vs_pinned"] = case["pinned_d2h_ms"] / case[f"{name}_store_ms"]
        res["alone"].append(case)
        print(json.dumps(case), flush=True)
        del src, host

    # the decode-step proxy, one CUDA graph
    w1 = [torch.empty(4096, 28672, device=dev, dtype=torch.bfloat16).uniform_(-0.01, 0.01)
          for _ in range(LAYERS)]
    w2 = [torch.empty(28672, 4096, device=dev, dtype=torch.bfloat16).uniform_(-0.01, 0.01)
          for _ in range(LAYERS)]
    x = torch.randn(16, 4096, device=dev, dtype=torch.bfloat16)

    def step() -> torch.Tensor:
        y = x
        for a1, a2 in zip(w1, w2):
            y = (y @ a1) @ a2
        return y

    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = step()
    for _ in range(20):
        g.replay()
    torch.cuda.synchronize()

    gaps: dict[str, list[float]] = {v: [] for v in VARIANTS}
    t_end = time.time() + a.budget_s
    for r in range(a.rounds):
        if time.time() > t_end:
            print(f"stopped after {r} rounds (budget)", flush=True)
            break
        for v in VARIANTS:
            w = workers["dma" if v.startswith("dma") else "gather"]
            wait = v.endswith("_wait")
            torch.cuda.synchronize()
            for i in range(a.steps):
                t = time.perf_counter()
                if v != "base" and i % a.every == a.every // 2:
                    w.run([], [StoreOp(next(job), "s", blocks_for(a.blocks, i),
                                       tuple(range(a.blocks)))])
                g.replay()
                if wait:
                    w.wait_stores()
                w.take_finished_sending()
                w.take_done()
                out[0, 0].item()  # the step's output read back (sampling's sync)
                gaps[v].append(time.perf_counter() - t)
            w.wait_stores()
            w.take_done()
            w.take_finished_sending()
            gs = gaps[v][-a.steps:]
            print(f"round {r} {v}: p50 {statistics.median(gs) * 1e3:.3f} ms, "
                  f"p90 {q(gs, 0.9) * 1e3:.3f} ms", flush=True)
    for w in workers.values():
        w.close()
    base90 = q(gaps["base"], 0.9) if gaps["base"] else float("nan")
    for v, gs in gaps.items():
        if gs:
            res["itl"][v] = {"p50_ms": statistics.median(gs) * 1e3, "p90_ms": q(gs, 0.9) * 1e3,
                             "p99_ms": q(gs, 0.99) * 1e3, "mean_ms": statistics.mean(gs) * 1e3,
                             "steps": len(gs), "p90_vs_base": q(gs, 0.9) / base90}
    return res


def table(path: str) -> str:
    with open(path) as fh:
        r = json.load(fh)
    lines = [f"Generated by `benchmarks/gpu/bench_store_itl.py --table` from `{path.split('/')[-1]}`. "
             f"{r['device']}, torch {r['torch']} (CUDA {r['cuda']}); pool pinned: "
             f"{r['pool_pinned']}; batch-copy stores available: {r['dma_stores']}.", "",
             f"## Decode-step proxy while stores run ({r['blocks_per_store']} blocks = "
             f"{r['blocks_per_store'] * BS} tokens every {r['every']} steps), ms", "",
             "| variant | p50 | p90 | p99 | mean | p90 ÷ base | steps |", "|---|---|---|---|---|---|---|"]
    for v in VARIANTS:
        d = r["itl"].get(v)
        if d:
            lines.append(f"| {v} | {d['p50_ms']:.3f} | {d['p90_ms']:.3f} | {d['p99_ms']:.3f} | "
                         f"{d['mean_ms']:.3f} | {d['p90_vs_base']:.3f} | {d['steps']} |")
    lines += ["", "## Each store path alone (no decode), median ms, against a pinned copy", "",
              "| tokens | MiB | pinned d2h | gather store | % of pinned | DMA-only store | % of pinned |",
              "|---|---|---|---|---|---|---|"]
    for c in r["alone"]:
        lines.append(f"| {c['tokens']:,} | {c['bytes'] / 2**20:.0f} | {c['pinned_d2h_ms']:.2f} | "
                     f"{c['gather_store_ms']:.2f} | {c['gather_vs_pinned']:.0%} | "
                     f"{c['dma_store_ms']:.2f} | {c['dma_vs_pinned']:.0%} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--table", nargs="+")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--every", type=int, default=20)
    ap.add_argument("--blocks", type=int, default=128)
    ap.add_argument("--num-blocks", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--budget-s", type=float, default=90.0)
    a = ap.parse_args()
    if a.table:
        md = table(a.table[0])
        if len(a.table) > 1:
            with open(a.table[1], "w") as fh:
                fh.write(md)
        print(md)
        return 0
    res = run(a)
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(res, fh, indent=1)
    print(json.dumps(res["itl"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
