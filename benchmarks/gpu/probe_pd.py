"""Client of pd_bench.sh: P/D and D->P through MultiConnector(NixlConnector, KVTierConnector)
on one GPU, outputs equal to references, the in-machine NIXL link speed next to each figure.

Per context length L and repetition (a fresh random conversation each time):
1. reference: turn 1 on P with a fresh ``cache_salt``, 16 greedy tokens (streamed);
2. P->D: the prefill leg on P (``do_remote_decode``, 1 token), then the decode leg on D with
   P's params (D READs the prompt's KV from P over NIXL): D's 16 tokens must equal (1);
3. turn 2 = turn 1's prompt + D's 16 tokens + 32 new, on P three ways:
   - recompute: a fresh ``cache_salt`` (16 tokens streamed: the reference of turn 2; and a
     1-token prefill leg, timed like the D->P leg);
   - host tier: ``/reset_prefix_cache`` first (device cache only); P's KVTierConnector holds
     turn 1's prompt (stored when P's turn-1 leg finished) and loads it;
   - D->P: ``/reset_prefix_cache`` first, then the prefill leg with D's retained params
     (``KVTransferParams.prefill_request(reuse=...)``): NixlConnector, MultiConnector's first
     child, READs turn 1's prompt + generated KV from D; then the decode leg on D, whose 16
     tokens must equal the turn-2 reference.
The NIXL link: ``vllm:nixl_bytes_transferred`` / ``vllm:nixl_xfer_time_seconds`` deltas of the
reading side (D for P->D, P for D->P).

usage: probe_pd.py --p URL --d URL --p-metrics PORT --d-metrics PORT --out FILE.json
       [--lengths 2000,8000,16000] [--reps 2] [--deadline EPOCH] [--block-size 16]
"""

from __future__ import annotations

import argparse
import json
import random
import time
import uuid

from probe_common import Client, log, main_guard, median, metric

from kvtier.transfer_params import KVTransferParams

GEN, NEW = 16, 32
EXT = "vllm:external_prefix_cache_hits_total"
NB, NT = "vllm:nixl_bytes_transferred_sum", "vllm:nixl_xfer_time_seconds_sum"
NC = "vllm:nixl_xfer_time_seconds_count"
# seconds one repetition needs at L tokens, at ~0.4 GB/s of NIXL and 128 KiB per token:
# two transfers of ~L tokens each, plus compute and requests
def NEED_S(L):
    return 8 + 2 * L * 131072 / 0.35e9


def link(t0: str, t1: str) -> dict:
    b = metric(t1, NB) - metric(t0, NB)
    s = metric(t1, NT) - metric(t0, NT)
    n = metric(t1, NC) - metric(t0, NC)
    return {"bytes": b, "xfer_s": s, "xfers": n, "GBps": (b / s / 1e9) if s > 0 else None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--p", required=True)
    ap.add_argument("--d", required=True)
    ap.add_argument("--p-metrics", type=int, required=True)
    ap.add_argument("--d-metrics", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--lengths", default="2000,8000,16000")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--deadline", type=float, default=time.time() + 480)
    ap.add_argument("--block-size", type=int, default=16)
    a = ap.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]
    cl = Client(a.deadline)
    P, D = a.p, a.d
    km = {"P": f"http://127.0.0.1:{a.p_metrics}", "D": f"http://127.0.0.1:{a.d_metrics}"}
    res: dict = {"lengths": {}, "reps": a.reps, "gen": GEN, "new_tokens": NEW,
                 "ttft": "streamed: first chunk; legs: wall time of the 1-token prefill request",
                 "complete": False}

    def save() -> None:
        with open(a.out, "w") as fh:
            json.dump(res, fh, indent=1)

    def conversation(L: int, seed: int) -> dict:
        rng = random.Random(seed)
        p = [rng.randrange(10, 2000) for _ in range(L)]
        rec1 = cl.stream(P, p, GEN, cache_salt=uuid.uuid4().hex)
        # P -> D
        tp, pre = cl.complete(P, p, 1, kv_transfer_params=KVTransferParams.prefill_request().to_wire())
        d0 = cl.scrape(D)
        td, dec = cl.complete(D, p, GEN, kv_transfer_params=pre.get("kv_transfer_params"))
        d1 = cl.scrape(D)
        out1 = dec["choices"][0]["token_ids"]
        retained = KVTransferParams.from_wire(dec.get("kv_transfer_params"))
        turn2 = p + out1 + [rng.randrange(10, 2000) for _ in range(NEW)]
        d = {"prompt1": L, "prompt2": len(turn2),
             "recompute1_ttft_ms": rec1[0] * 1e3,
             "p_leg1_ms": tp * 1e3, "d_leg1_ms": td * 1e3,
             "pd_equal": out1 == rec1[2],
             "D_external_hit_tokens_turn1": metric(d1, EXT) - metric(d0, EXT),
             "link_p_to_d": link(d0, d1),
             "retained_tokens": (retained.nixl.remote_num_tokens
                                 if retained is not None and retained.nixl is not None else None)}
        # turn 2 on P: recompute (reference), host tier, D -> P
        rec2 = cl.stream(P, turn2, GEN, cache_salt=uuid.uuid4().hex)
        trl, _ = cl.complete(P, turn2, 1, cache_salt=uuid.uuid4().hex)
        resets_host = cl.reset_prefix_cache(P)
        time.sleep(0.3)
        p0 = cl.scrape(P)
        host = cl.stream(P, turn2, GEN)
        p1 = cl.scrape(P)
        d.update(recompute2_ttft_ms=rec2[0] * 1e3, recompute2_leg_ms=trl * 1e3,
                 host2_ttft_ms=host[0] * 1e3, host_equal=host[2] == rec2[2], reset_tries_host=resets_host,
                 P_external_hit_tokens_host=metric(p1, EXT) - metric(p0, EXT))
        if retained is None or retained.nixl is None or not retained.nixl.has_remote_blocks:
            d["dp"] = "D returned no retained-KV params"
            return d
        resets_dp = cl.reset_prefix_cache(P)
        time.sleep(0.3)
        p2, d2 = cl.scrape(P), cl.scrape(D)
        tp2, pre2 = cl.complete(P, turn2, 1, kv_transfer_params=KVTransferParams.prefill_request(
            reuse=retained.nixl).to_wire())
        p3 = cl.scrape(P)
        td2, dec2 = cl.complete(D, turn2, GEN, kv_transfer_params=pre2.get("kv_transfer_params"))
        d3 = cl.scrape(D)
        d.update(dp_leg_ms=tp2 * 1e3, d_leg2_ms=td2 * 1e3, reset_tries_dp=resets_dp,
                 dp_equal=dec2["choices"][0]["token_ids"] == rec2[2],
                 P_external_hit_tokens_dp=metric(p3, EXT) - metric(p2, EXT),
                 link_d_to_p=link(p2, p3), link_p_to_d_turn2=link(d2, d3))
        return d

    def run() -> None:
        res["health_s"] = cl.wait_health([P, D])
        for u in (P, D):
            cl.complete(u, [random.Random(0).randrange(10, 2000) for _ in range(64)], 4)
        w = conversation(256, 1)  # NIXL handshakes and UCX wire-up happen here
        res["warmup_256"] = w
        log(f"warm-up 256: {json.dumps(w)}")
        save()
        for L in lengths:
            if cl.left() < NEED_S(L) * a.reps + 5:
                log(f"skip {L}: {cl.left():.0f} s left")
                res["lengths"][str(L)] = {"skipped": f"{cl.left():.0f} s left before the deadline"}
                continue
            reps = []
            for r in range(a.reps):
                x = conversation(L, L * 100 + r)
                reps.append(x)
                lp, ld = x["link_p_to_d"], x.get("link_d_to_p") or {}
                log(f"L={L} rep {r}: P->D leg P {x['p_leg1_ms']:.0f} + D {x['d_leg1_ms']:.0f} ms "
                    f"(equal {x['pd_equal']}, D ext +{x['D_external_hit_tokens_turn1']:.0f}, "
                    f"link {lp['GBps'] or 0:.2f} GB/s); turn 2 on P: recompute "
                    f"{x['recompute2_ttft_ms']:.0f} ms (leg {x['recompute2_leg_ms']:.0f}), host "
                    f"{x['host2_ttft_ms']:.0f} ms (equal {x['host_equal']}, +{x['P_external_hit_tokens_host']:.0f}), "
                    f"D->P leg {x.get('dp_leg_ms', float('nan')):.0f} ms (equal {x.get('dp_equal')}, "
                    f"P ext +{x.get('P_external_hit_tokens_dp', 0):.0f}, link {ld.get('GBps') or 0:.2f} GB/s)")
            keys = ("recompute1_ttft_ms", "p_leg1_ms", "d_leg1_ms", "recompute2_ttft_ms",
                    "recompute2_leg_ms", "host2_ttft_ms", "dp_leg_ms")
            s = {k: median([x[k] for x in reps if k in x]) for k in keys}
            s["link_p_to_d_GBps"] = median([x["link_p_to_d"]["GBps"] for x in reps
                                            if x["link_p_to_d"]["GBps"]])
            s["link_d_to_p_GBps"] = median([x["link_d_to_p"]["GBps"] for x in reps
                                            if x.get("link_d_to_p", {}).get("GBps")])
            s["all_equal"] = all(x["pd_equal"] and x["host_equal"] and x.get("dp_equal", False)
                                 for x in reps)
            res["lengths"][str(L)] = {"median": s, "reps": reps}
            log(f"L={L} median: {json.dumps(s)}")
            save()
        for name, u in (("P", P), ("D", D)):
            res[f"nixl_metrics_{name}"] = [ln for ln in cl.scrape(u).splitlines()
                                           if ln.startswith("vllm:nixl") and "_bucket" not in ln]
        for name, u in (("P", km["P"]), ("D", km["D"])):
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
