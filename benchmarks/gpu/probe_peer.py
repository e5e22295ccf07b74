"""Client of peer_bench.sh: turn 2 on instance B pulls turn 1 (prompt + generated tokens)
from instance A's host tier over NIXL; TTFT vs context for recompute, host-tier load and
peer fetch; greedy outputs equal.

Per context length L and repetition (a fresh random conversation each time):
1. turn 1 on A: L prompt tokens, ``--gen`` (40) greedy tokens (A's tier stores the whole blocks
   of prompt + the gen - 1 computed generated tokens: ``held``; with L a multiple of the block
   size, 40 generated tokens put 32 of them in whole blocks, so the pull carries generated KV);
2. turn 2 = turn 1's prompt + its generated tokens + 32 new tokens, ``--gen`` greedy tokens,
   three ways:
   - recompute on B: a fresh ``cache_salt`` (misses every cache);
   - host tier on A: ``/reset_prefix_cache`` (device cache only) first, so A loads ``held``
     tokens from its own host tier and computes the rest;
   - peer fetch on B: ``kv_transfer_params.remote_kv_source`` names A's peer port and
     ``held``; B's scheduler pulls the blocks A holds over NIXL into B's host tier, then
     loads them like a host-tier hit (B's caches hold nothing of this conversation).
   TTFT = first streamed chunk (probe_common). Outputs of the three must be equal.
B's ``vllm:external_prefix_cache_hits_total`` must grow by ``held`` per peer request and its
``kvtier_tier_bytes_moved_total{path="peer_in"}`` by held/16 blocks of 2 MiB.
A warm-up conversation (512 tokens) goes first, so UCX's wire-up is not in the figures
(its peer TTFT is reported apart).

usage: probe_peer.py --a URL --b URL --a-p2p PORT --a-metrics PORT --b-metrics PORT
       --out FILE.json [--lengths 2000,8000,16000,32000] [--reps 3] [--deadline EPOCH]
"""

from __future__ import annotations

import argparse
import json
import random
import time
import uuid

from probe_common import Client, log, main_guard, median, metric

BS, GEN, NEW = 16, 40, 32
# rough seconds one repetition needs at L tokens (a 32k turn 1 ~1.3 s, its recompute ~1.2 s,
# the peer READ of 4 GiB a few s): the probe skips a length it cannot finish before the deadline
def NEED_S(L):
    return 6 + L / 2500


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--a", required=True)
    ap.add_argument("--b", required=True)
    ap.add_argument("--a-p2p", type=int, required=True)
    ap.add_argument("--a-metrics", type=int, required=True)
    ap.add_argument("--b-metrics", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--lengths", default="2000,8000,16000,32000")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--deadline", type=float, default=time.time() + 480)
    ap.add_argument("--block-size", type=int, default=BS)
    ap.add_argument("--gen", type=int, default=GEN)
    a = ap.parse_args()
    gen = a.gen
    bs = a.block_size
    lengths = [int(x) for x in a.lengths.split(",")]
    cl = Client(a.deadline)
    A, B = a.a, a.b
    km = {"A": f"http://127.0.0.1:{a.a_metrics}", "B": f"http://127.0.0.1:{a.b_metrics}"}
    res: dict = {"lengths": {}, "reps": a.reps, "gen": gen, "new_tokens": NEW,
                 "ttft": "first streamed chunk, HTTP included", "complete": False}

    def save() -> None:
        with open(a.out, "w") as fh:
            json.dump(res, fh, indent=1)

    def conversation(L: int, seed: int) -> dict:
        rng = random.Random(seed)
        p = [rng.randrange(10, 2000) for _ in range(L)]
        t1, j1 = cl.complete(A, p, gen)
        out1 = j1["choices"][0]["token_ids"]
        p2 = p + out1 + [rng.randrange(10, 2000) for _ in range(NEW)]
        held = (L + gen - 1) // bs * bs
        time.sleep(1.0)  # A's store of turn 1 completes (reported at A's next steps)
        rec = cl.stream(B, p2, gen, cache_salt=uuid.uuid4().hex)
        resets = cl.reset_prefix_cache(A)
        time.sleep(0.3)
        a0 = cl.scrape(A)
        host = cl.stream(A, p2, gen)
        a1 = cl.scrape(A)
        b0, kb0, ka0 = cl.scrape(B), cl.scrape(km["B"]), cl.scrape(km["A"])
        src = {"remote_kv_source": {"pod": "gpu-a", "host": "127.0.0.1", "port": a.a_p2p,
                                    "num_tokens": held, "block_size": bs}}
        peer = cl.stream(B, p2, gen, kv_transfer_params=src)
        time.sleep(0.2)
        b1, kb1, ka1 = cl.scrape(B), cl.scrape(km["B"]), cl.scrape(km["A"])
        ext = "vllm:external_prefix_cache_hits_total"
        moved = "kvtier_tier_bytes_moved_total"
        d = {
            "turn1_s": t1, "prompt2_tokens": len(p2), "held_tokens": held, "reset_tries": resets,
            "held_generated_tokens": held - L,
            "recompute_ttft_ms": rec[0] * 1e3, "host_ttft_ms": host[0] * 1e3,
            "peer_ttft_ms": peer[0] * 1e3,
            "equal": {"host_vs_recompute": host[2] == rec[2], "peer_vs_recompute": peer[2] == rec[2],
                      "tokens": len(rec[2])},
            "A_external_hit_tokens": metric(a1, ext) - metric(a0, ext),
            "B_external_hit_tokens": metric(b1, ext) - metric(b0, ext),
            "B_peer_in_bytes": metric(kb1, moved, path="peer_in") - metric(kb0, moved, path="peer_in"),
            "A_peer_out_bytes": metric(ka1, moved, path="peer_out") - metric(ka0, moved, path="peer_out"),
            "B_load_bytes": metric(kb1, moved, path="load") - metric(kb0, moved, path="load"),
            "B_fallbacks": metric(kb1, "kvtier_tier_peer_fallbacks_total")
            - metric(kb0, "kvtier_tier_peer_fallbacks_total"),
        }
        return d

    def run() -> None:
        res["health_s"] = cl.wait_health([A, B])
        for u in (A, B):
            cl.complete(u, [random.Random(0).randrange(10, 2000) for _ in range(64)], 4)
        w = conversation(512, 1)
        res["warmup_512"] = w
        log(f"warm-up 512: rec {w['recompute_ttft_ms']:.1f} host {w['host_ttft_ms']:.1f} "
            f"peer (first fetch, UCX wire-up) {w['peer_ttft_ms']:.1f} ms; equal {w['equal']}; "
            f"B ext +{w['B_external_hit_tokens']:.0f} peer_in {w['B_peer_in_bytes']:.0f} B "
            f"fallbacks {w['B_fallbacks']:.0f}")
        save()
        for L in lengths:
            if cl.left() < NEED_S(L) * a.reps + 5:
                log(f"skip {L}: {cl.left():.0f} s left")
                res["lengths"][str(L)] = {"skipped": f"{cl.left():.0f} s left before the deadline"}
                continue
            reps = []
            for r in range(a.reps):
                d = conversation(L, L * 100 + r)
                reps.append(d)
                log(f"L={L} rep {r}: rec {d['recompute_ttft_ms']:.1f} host {d['host_ttft_ms']:.1f} "
                    f"peer {d['peer_ttft_ms']:.1f} ms; equal {d['equal']}; held {d['held_tokens']} "
                    f"({d['held_generated_tokens']} generated); "
                    f"A ext +{d['A_external_hit_tokens']:.0f}, B ext +{d['B_external_hit_tokens']:.0f}, "
                    f"peer_in {d['B_peer_in_bytes'] / 2**20:.0f} MiB, peer_out "
                    f"{d['A_peer_out_bytes'] / 2**20:.0f} MiB, fallbacks {d['B_fallbacks']:.0f}")
            s = {k: median([x[k] for x in reps])
                 for k in ("recompute_ttft_ms", "host_ttft_ms", "peer_ttft_ms")}
            s["host_speedup"] = s["recompute_ttft_ms"] / s["host_ttft_ms"]
            s["peer_speedup"] = s["recompute_ttft_ms"] / s["peer_ttft_ms"]
            extra_s = (s["peer_ttft_ms"] - s["host_ttft_ms"]) / 1e3
            nbytes = reps[0]["B_peer_in_bytes"]
            s["peer_minus_host_ms"] = extra_s * 1e3
            s["implied_peer_link_GBps"] = nbytes / extra_s / 1e9 if extra_s > 0 else None
            s["all_equal"] = all(x["equal"]["host_vs_recompute"] and x["equal"]["peer_vs_recompute"]
                                 for x in reps)
            res["lengths"][str(L)] = {"median": s, "reps": reps}
            log(f"L={L} median: recompute {s['recompute_ttft_ms']:.1f}, host {s['host_ttft_ms']:.1f} "
                f"(x{s['host_speedup']:.2f}), peer {s['peer_ttft_ms']:.1f} ms (x{s['peer_speedup']:.2f}); "
                f"all equal {s['all_equal']}")
            save()
        for name, u in (("A", km["A"]), ("B", km["B"])):
            res[f"kvtier_metrics_{name}"] = [ln for ln in cl.scrape(u).splitlines()
                                             if ln.startswith("kvtier_tier_") and "_bucket" not in ln]
        res["complete"] = True
        save()

    try:
        main_guard(run)
    finally:
        save()


if __name__ == "__main__":
    main()
