"""kvtier's indexer vs Dynamo's RadixTree (ai-dynamo-runtime), side by side, one run.

    .venv/bin/python benchmarks/bench_indexer.py [--cpu N] [--quick] [--out FILE.json]

Measures, with the whole process (and so Dynamo's Rust worker thread, which
is created after the pin) pinned to one CPU:

1. ingest (blocks/s): a stream of BlockStored events of 16 blocks, 64 pods,
   conversations that share a system prompt and then diverge.
   - kvtier full: msgpack payload -> decode (the subscriber's typed fast path,
     kvtier.indexer.fastdecode) -> request-key hashing of the
     tokens -> parent resolution -> MemoryIndex.store (what the daemon does
     per event; vLLM events carry tokens, so kvtier must hash them);
   - kvtier index only: MemoryIndex.store of precomputed keys;
   - Dynamo: RadixTree.apply_event of JSON events whose tokens_hash was
     precomputed (Dynamo's engine-side publisher hashes, not the tree);
   - Dynamo + hashing: the same plus compute_block_hash_for_seq of every event's
     tokens (what kvtier full does on its side: same work on both sides).
2. lookup latency for prompts of 1k / 32k / 128k tokens over 8 / 64 / 512
   pods: every pod holds a prefix of the prompt of a different length (all
   share at least the first block: a common system prompt).
   - hashing: kvtier.indexer.keys.request_keys (compiled helper if built, see
     kvtier.indexer.native), its pure-Python path, and the reference
     kvtier.hashing.RequestKeyHasher.keys vs compute_block_hash_for_seq;
   - matching: MemoryIndex.lookup (LRU touch off: Dynamo's tree keeps no LRU; the
     touch is measured apart) vs RadixTree.find_matches(...).scores (read back
     into a Python dict, as kvtier's answer is one);
   - total = both; route = IndexerService.route in process (hash, lookup, sorted
     matches, source choice: the whole /v1/route answer before JSON).

KVTIER_INDEXER_NATIVE=0 runs kvtier without its compiled helper.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time

from kvtier.hashing import RequestKeyHasher
from kvtier.ids import EngineBlockHash, ModelName, PodId, Tier
from kvtier.indexer.config import IndexerConfig
from kvtier.indexer.fastdecode import decode_payload
from kvtier.indexer.index import MemoryIndex
from kvtier.indexer.ingest import EventApplier, HasherCache, PodCounters
from kvtier.indexer.keys import python_request_keys, request_keys
from kvtier.indexer.native import NATIVE
from kvtier.indexer.service import IndexerService
from kvtier.wire import kv_events as ev

BS = 32
MODEL = "bench"


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def timed(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        fn()
        out.append((time.perf_counter_ns() - t0) / 1e3)  # µs
    return out


# -- ingest -----------------------------------------------------------------------------------

def make_stream(n_pods: int, convs_per_pod: int, sys_blocks: int, conv_blocks: int, seed=1):
    """Per event: (pod, engine hashes, parent engine hash, tokens)."""
    rng = random.Random(seed)
    system = [rng.randrange(4096) for _ in range(sys_blocks * BS)]
    # vLLM's default block hash (sha256, fixed seed) is the same on every engine for the
    # same content, and Dynamo's tree relies on that: shared blocks share engine hashes.
    sys_ehs = [rng.getrandbits(64) for _ in range(sys_blocks)]
    events = []
    for p in range(n_pods):
        for c in range(convs_per_pod):
            toks = system + [rng.randrange(4096) for _ in range(conv_blocks * BS)]
            nb = len(toks) // BS
            ehs = sys_ehs + [rng.getrandbits(64) for _ in range(nb - sys_blocks)]
            start = sys_blocks if c > 0 else 0  # the system prompt is cached once per pod
            for lo in range(start, nb, 16):
                hi = min(nb, lo + 16)
                events.append((p, ehs[lo:hi], ehs[lo - 1] if lo else None,
                               toks[lo * BS: hi * BS]))
    return events


def bench_ingest(quick: bool) -> dict:
    from dynamo.llm import RadixTree, compute_block_hash_for_seq

    stream = make_stream(64, 4 if quick else 12, 64, 192)
    n_blocks = sum(len(e[1]) for e in stream)
    payloads = [(PodId(f"pod-{p}"), ev.encode_batch([ev.encode_stored(ehs, par, toks, BS)]))
                for p, ehs, par, toks in stream]
    # Dynamo's events: tokens_hash per block precomputed (its publisher does that)
    dyn = []
    for i, (p, ehs, par, toks) in enumerate(stream):
        th = compute_block_hash_for_seq(toks, BS)
        dyn.append((p, json.dumps({"event_id": i, "data": {"stored": {
            "parent_hash": par,
            "blocks": [{"block_hash": h, "tokens_hash": t} for h, t in zip(ehs, th)]}}}).encode()))
    # kvtier index-only: keys precomputed through a first full pass
    idx0 = MemoryIndex(max_keys=10_000_000, max_blocks_per_pod=10_000_000)
    ap0 = EventApplier(idx0, HasherCache(BS))
    c = PodCounters()
    for seq, (pod, pl) in enumerate(payloads):
        ap0.apply(pod, MODEL, ev.decode_payload(seq, pl), c)
    assert not c.dropped, c.dropped
    pre = [(PodId(f"pod-{p}"), [(EngineBlockHash(h), idx0.resolve(PodId(f"pod-{p}"), h))
                                for h in ehs]) for p, ehs, _, _ in stream]
    res = {"events": len(stream), "blocks": n_blocks, "blocks_per_event": 16, "pods": 64}

    def run_full():
        idx = MemoryIndex(max_keys=10_000_000, max_blocks_per_pod=10_000_000)
        ap, cc = EventApplier(idx, HasherCache(BS)), PodCounters()
        t0 = time.perf_counter()
        for seq, (pod, pl) in enumerate(payloads):
            ap.apply(pod, MODEL, decode_payload(seq, pl), cc)
        return time.perf_counter() - t0

    def run_store():
        idx = MemoryIndex(max_keys=10_000_000, max_blocks_per_pod=10_000_000)
        t0 = time.perf_counter()
        for pod, blocks in pre:
            idx.resolve(pod, blocks[0][0])  # the parent lookup the applier does
            idx.store(pod, Tier.GPU, blocks)
        return time.perf_counter() - t0

    def run_dynamo():
        tree = RadixTree()
        t0 = time.perf_counter()
        for p, js in dyn:
            tree.apply_event(p, js)
        dt = time.perf_counter() - t0
        return dt

    toks_only = [toks for _, _, _, toks in stream]

    def run_dynamo_hash():
        t0 = time.perf_counter()
        for toks in toks_only:
            compute_block_hash_for_seq(toks, BS)
        return time.perf_counter() - t0

    def run_dynamo_full():
        return run_dynamo() + run_dynamo_hash()

    for name, fn in (("kvtier_full", run_full), ("kvtier_index_only", run_store),
                     ("dynamo_apply_event", run_dynamo), ("dynamo_hash_and_apply", run_dynamo_full)):
        best = min(fn() for _ in range(3))
        res[name + "_blocks_per_s"] = n_blocks / best
    return res


# -- lookup -----------------------------------------------------------------------------------

def bench_lookup(n_tokens: int, n_pods: int, reps: int) -> dict:
    from dynamo.llm import RadixTree, compute_block_hash_for_seq

    rng = random.Random(n_tokens * 1000 + n_pods)
    toks = [rng.randrange(4096) for _ in range(n_tokens)]
    nb = n_tokens // BS
    hasher = RequestKeyHasher(ModelName(MODEL), BS)
    keys = hasher.keys(toks)
    th = compute_block_hash_for_seq(toks, BS)
    svc = IndexerService(IndexerConfig(block_size=BS, default_model=ModelName(MODEL),
                                       max_keys=10_000_000, max_blocks_per_pod=10_000_000))
    idx = MemoryIndex(max_keys=10_000_000, max_blocks_per_pod=10_000_000,
                      touch_on_lookup=False)
    lru = MemoryIndex(max_keys=10_000_000, max_blocks_per_pod=10_000_000)
    tree = RadixTree()
    depths = []
    all_ehs = [rng.getrandbits(64) for _ in range(nb)]  # same content, same engine hash
    for p in range(n_pods):
        depth = max(1, nb * ((p * 37) % 100 + 1) // 100)
        depths.append(depth)
        ehs = all_ehs[:depth]
        for ix in (idx, lru, svc.raw_index):
            ix.store(PodId(f"pod-{p}"), Tier.GPU, list(zip(ehs, keys[:depth])))
        for lo in range(0, depth, 256):
            hi = min(depth, lo + 256)
            tree.apply_event(p, json.dumps({"event_id": lo, "data": {"stored": {
                "parent_hash": ehs[lo - 1] if lo else None,
                "blocks": [{"block_hash": h, "tokens_hash": t}
                           for h, t in zip(ehs[lo:hi], th[lo:hi])]}}}).encode())
    # both agree on the answer
    ours = idx.lookup(keys)
    theirs = tree.find_matches(th).scores
    assert sorted(ours.values()) == sorted(theirs.values()) == sorted(depths), "answers differ"

    assert request_keys(hasher, toks) == keys
    r = {"tokens": n_tokens, "pods": n_pods, "reps": reps}
    root = int(hasher.root)

    def lru_lookup() -> None:   # the lookup plus its LRU refresh (deferred to ingest)
        lru.lookup(keys)
        with lru._lock:
            lru._apply_touches()

    for name, fn in (
        ("hash_kvtier", lambda: request_keys(hasher, toks)),
        ("hash_kvtier_python", lambda: python_request_keys(hasher, toks, root)),
        ("hash_kvtier_reference", lambda: hasher.keys(toks)),
        ("hash_dynamo", lambda: compute_block_hash_for_seq(toks, BS)),
        ("match_kvtier", lambda: idx.lookup(keys)),
        ("match_kvtier_lru", lru_lookup),
        ("match_dynamo", lambda: tree.find_matches(th).scores),
        ("total_kvtier", lambda: idx.lookup(request_keys(hasher, toks))),
        ("total_dynamo", lambda: tree.find_matches(compute_block_hash_for_seq(toks, BS)).scores),
        ("route_kvtier", lambda: svc.route(ModelName(MODEL), toks, PodId("pod-0"))),
    ):
        fn()  # warm
        xs = timed(fn, reps)
        r[name + "_p50_us"] = statistics.median(xs)
        r[name + "_p99_us"] = pct(xs, 0.99)
    return r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", type=int, default=None, help="CPU to pin to (default: the last one)")
    ap.add_argument("--quick", action="store_true", help="fewer reps and a smaller ingest stream")
    ap.add_argument("--out", default=None, help="write results as JSON here")
    args = ap.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    cpu = cpus[-1] if args.cpu is None else args.cpu
    os.sched_setaffinity(0, {cpu})  # before RadixTree() starts its worker thread
    meta = {"pinned_cpu": cpu, "python": sys.version.split()[0], "machine": platform.machine(),
            "loadavg_start": os.getloadavg(), "native": NATIVE is not None}
    print(f"pinned to CPU {cpu}; load average {meta['loadavg_start']}; kvtier compiled helper: "
          f"{'yes' if NATIVE is not None else 'no (pure Python)'}", flush=True)

    ing = bench_ingest(args.quick)
    print(f"ingest: {ing['blocks']} blocks in {ing['events']} events of 16 blocks, 64 pods")
    for k in ("kvtier_full", "kvtier_index_only", "dynamo_apply_event", "dynamo_hash_and_apply"):
        print(f"  {k:22s} {ing[k + '_blocks_per_s'] / 1e6:6.2f} M blocks/s", flush=True)

    look = []
    for n_tokens, reps in ((1024, 400), (32768, 60), (131072, 20)):
        for n_pods in (8, 64, 512):
            r = bench_lookup(n_tokens, n_pods, max(5, reps // (4 if args.quick else 1)))
            look.append(r)
            print(f"lookup {n_tokens:>6} tok {n_pods:>3} pods | "
                  f"hash kvtier {r['hash_kvtier_p50_us']:8.1f} dynamo {r['hash_dynamo_p50_us']:8.1f}"
                  f" | match kvtier {r['match_kvtier_p50_us']:8.1f} dynamo "
                  f"{r['match_dynamo_p50_us']:8.1f} | total kvtier {r['total_kvtier_p50_us']:8.1f}"
                  f" dynamo {r['total_dynamo_p50_us']:8.1f} | hash py "
                  f"{r['hash_kvtier_python_p50_us']:8.1f} | match+lru "
                  f"{r['match_kvtier_lru_p50_us']:8.1f} | route {r['route_kvtier_p50_us']:8.1f}"
                  f" µs (p50)", flush=True)
    meta["loadavg_end"] = os.getloadavg()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "ingest": ing, "lookup": look}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
