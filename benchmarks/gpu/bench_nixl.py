"""The peer-fetch link inside one machine: NIXL (UCX backend) READ of host-pool slots
between two processes, the path kvtier's peer fetch takes (``kvtier.tier.nixl.NixlPool``,
DRAM -> DRAM, no progress thread: the source polls its agent as ``PeerServer`` does).

Slots of 2 MiB (one block of the Llama-3.1-8B shape: 16 tokens x 128 KiB). Pools are
``/dev/shm`` files (``HostPool.shared``), as the engine's are; ``--pin`` also registers
both pools with cudaHostRegister (the engine pins the worker's mapping of the same file).
For each size: READ of N consecutive slots into N consecutive slots, median of ``--reps``
(the first READ of a size also wires up UCX and is reported apart).

usage: python benchmarks/gpu/bench_nixl.py [--out FILE.json] [--blocks 125,500,1000,2000]
       [--reps 3] [--modes shm,shm+pinned] [--budget-s 60]
A size whose READs would not fit the time left (at the speed of the size before) is skipped;
the JSON is rewritten after every size.
No GPU needed without ``shm+pinned`` (a CPU dry run: ``--blocks 4,8 --modes shm``).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time
import uuid

SLOT = 2 << 20


def _pin(pool) -> None:
    import torch

    rc = int(torch.cuda.cudart().cudaHostRegister(pool.base_address, pool.nbytes, 0))
    if rc != 0:
        raise RuntimeError(f"cudaHostRegister failed: {rc}")


def _source(tag: str, slots: int, pin: bool, conn) -> None:
    from kvtier.tier.nixl import NixlPool
    from kvtier.tier.pool import HostPool

    pool = HostPool.shared(tag, slots, SLOT)
    pool.array[:] = 7  # touch every page: no page faults inside the timed READs
    if pin:
        _pin(pool)
    nixl = NixlPool(pool, f"bench-src-{tag}")
    conn.send((nixl.metadata(), pool.base_address))
    while not conn.poll(0):
        nixl.progress()
    conn.recv()
    nixl.close()
    pool.close()


def run_mode(mode: str, blocks: list[int], reps: int, deadline: float, save) -> dict:
    from kvtier.tier.nixl import NixlPool
    from kvtier.tier.pool import HostPool

    pin = mode.endswith("+pinned")
    slots = max(blocks)
    tag = uuid.uuid4().hex[:8]
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    proc = ctx.Process(target=_source, args=(f"src{tag}", slots, pin, b), daemon=True)
    proc.start()
    try:
        t0 = time.time()
        while not a.poll(0.5):  # a source that died (e.g. NIXL_ERR_BACKEND) ends the mode
            if not proc.is_alive() or time.time() - t0 > 120:
                raise RuntimeError(f"source did not start (exit code {proc.exitcode})")
        meta, base = a.recv()
        pool = HostPool.shared(f"dst{tag}", slots, SLOT)
        pool.array[:] = 0
        if pin:
            _pin(pool)
        nixl = NixlPool(pool, f"bench-dst-{tag}")
        peer = nixl.add_peer(meta)
        out: dict = {"mode": mode, "slot_bytes": SLOT, "sizes": {}}
        save(out)
        speed = None  # bytes/s of the size before
        for n in blocks:
            if speed and time.time() + (reps + 1) * n * SLOT / speed > deadline:
                out["sizes"][str(n)] = {"skipped": "would pass the time budget"}
                continue
            ids = list(range(n))
            t = time.perf_counter()
            nixl.read(peer, base, ids, ids, 120.0)
            first = time.perf_counter() - t
            ts = []
            for _ in range(reps):
                t = time.perf_counter()
                nixl.read(peer, base, ids, ids, 120.0)
                ts.append(time.perf_counter() - t)
            ok = bool((pool.array[:n, :: 4096] == 7).all())
            med = statistics.median(ts)
            speed = n * SLOT / med
            out["sizes"][str(n)] = {"blocks": n, "tokens": n * 16, "bytes": n * SLOT,
                                    "first_ms": first * 1e3, "ms": [x * 1e3 for x in ts],
                                    "median_ms": med * 1e3, "GBps": n * SLOT / med / 1e9,
                                    "bytes_ok": ok}
            print(json.dumps({"mode": mode, **out["sizes"][str(n)], "ms": None}), flush=True)
            save(out)
        nixl.close()
        pool.close()
        return out
    finally:
        a.send("stop")
        proc.join(20)
        if proc.is_alive():
            proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    ap.add_argument("--blocks", default="125,500,1000,2000")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--modes", default="shm,shm+pinned")
    ap.add_argument("--budget-s", type=float, default=60.0)
    a = ap.parse_args()
    blocks = [int(x) for x in a.blocks.split(",")]
    modes = a.modes.split(",")
    t0 = time.time()
    res: dict = {"env": {k: v for k, v in os.environ.items() if k.startswith("UCX_")},
                 "modes": []}

    def save(mode_out: dict) -> None:
        if not any(x is mode_out for x in res["modes"]):
            res["modes"].append(mode_out)
        if a.out:
            with open(a.out, "w") as fh:
                json.dump(res, fh, indent=1)

    for i, m in enumerate(modes):
        # each mode gets an equal share of what is left
        deadline = time.time() + (t0 + a.budget_s - time.time()) / (len(modes) - i)
        run_mode(m, blocks, a.reps, deadline, save)


if __name__ == "__main__":
    main()
