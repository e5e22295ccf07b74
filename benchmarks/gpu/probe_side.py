"""Client probe of the side-by-side (side_bench.sh): three vLLM servers on one GPU, same model.

- BASE (no connector): (c) recompute (a fresh ``cache_salt`` per request) and (d) the HBM
  prefix-cache hit (the same prompt again, nothing reset: the upper bound);
- KVT (KVTierConnector): (a) the history from kvtier's host tier;
- OFF (vLLM's OffloadingConnector, CPU, ``offload_prompt_only: false``): (b) from vLLM's tier.

For (a) and (b) the prompt is served once (16 tokens, stored at finish), then before every
timed request ``/reset_prefix_cache`` empties device memory, so the history can come only from
host memory (the issue's "prefix caching off except in the last column", done on one engine per
tier). TTFT = wall time of a non-streaming completion with ``max_tokens`` 1 (HTTP included).
The four columns of one length run back to back, the servers in rotation each repeat; (d) is
timed first in each repeat, after an untimed request that puts the whole prompt back in HBM.
After each tier's timed repeats one greedy 16-token output is compared with BASE's.

ITL under stores: on each server in turn, one streamed greedy generation of GEN tokens while a
second client sends a fresh PROMPT-token request every INTERVAL s (each a miss that is
prefilled and, on KVT/OFF, stored to host memory); pooled gaps, p50/p90, ROUNDS rounds.

usage: probe_side.py BASE_URL KVT_URL OFF_URL DEADLINE_EPOCH OUT.json LENGTHS REPS
       [ROUNDS 3] [GEN 256] [PROMPT 2048] [INTERVAL 0.25]
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import threading
import time
import uuid

import httpx

urls = {"base": sys.argv[1], "kvtier": sys.argv[2], "vllm_offload": sys.argv[3]}
deadline, out = float(sys.argv[4]), sys.argv[5]
lengths = [int(x) for x in sys.argv[6].split(",")]
reps = int(sys.argv[7])
rounds = int(sys.argv[8]) if len(sys.argv) > 8 else 3
gen = int(sys.argv[9]) if len(sys.argv) > 9 else 256
bg_prompt = int(sys.argv[10]) if len(sys.argv) > 10 else 2048
interval = float(sys.argv[11]) if len(sys.argv) > 11 else 0.25
MODEL = "m8b"
c = httpx.Client(timeout=300)


def log(*a: object) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


def healthy(url: str, wait_s: float) -> bool:
    end = min(deadline, time.time() + wait_s)
    while time.time() < end:
        try:
            if c.get(f"{url}/health", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(1)
    return False


def complete(url: str, prompt: list[int], n: int, **extra: object) -> tuple[float, list[int]]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0,
            "return_token_ids": True, **extra}
    t = time.perf_counter()
    r = c.post(f"{url}/v1/completions", json=body)
    dt = time.perf_counter() - t
    r.raise_for_status()
    return dt, r.json()["choices"][0].get("token_ids")


def reset(url: str) -> None:
    c.post(f"{url}/reset_prefix_cache").raise_for_status()
    time.sleep(0.2)


def spread(xs: list[float]) -> dict:
    return {"median_ms": statistics.median(xs) * 1e3, "min_ms": min(xs) * 1e3,
            "max_ms": max(xs) * 1e3, "ms": [x * 1e3 for x in xs]}


def ttft(res: dict) -> None:
    for u in urls.values():
        complete(u, [random.Random(0).randrange(10, 2000) for _ in range(64)], 4)  # warm-up
    for n in lengths:
        if time.time() > deadline - 60:
            log(f"{n}: skipped, deadline near")
            break
        p = [random.Random(n).randrange(10, 30000) for _ in range(n)]
        _, ref = complete(urls["base"], p, 16)  # BASE computes it; also the HBM-hit source
        tiers = [k for k in ("kvtier", "vllm_offload") if k in urls]
        for name in tiers:  # turn 1: computed, stored to host at finish
            complete(urls[name], p, 16)
        time.sleep(1.0)
        t: dict[str, list[float]] = {k: [] for k in ["recompute", "hbm", *tiers]}
        for _ in range(reps):
            # (d) first: the prompt made whole in HBM again (the last repeat's recompute may
            # have evicted part of it: at 32k two prompts do not fit BASE's KV cache), then timed
            complete(urls["base"], p, 1)
            time.sleep(0.2)
            t["hbm"].append(complete(urls["base"], p, 1)[0])
            time.sleep(0.2)
            t["recompute"].append(complete(urls["base"], p, 1, cache_salt=uuid.uuid4().hex)[0])
            for name in tiers:
                reset(urls[name])
                t[name].append(complete(urls[name], p, 1)[0])
                time.sleep(0.3)  # nothing of this request's bookkeeping left in the next one
        equal = {}
        for name in tiers:
            reset(urls[name])
            equal[name] = complete(urls[name], p, 16)[1] == ref
        d = {k: spread(v) for k, v in t.items()}
        d["outputs_equal"] = equal
        res["ttft"][str(n)] = d
        log(f"{n} tokens: " + ", ".join(f"{k} {d[k]['median_ms']:.1f} ms "
                                       f"({d[k]['min_ms']:.1f}-{d[k]['max_ms']:.1f})" for k in t)
            + f"; equal {equal}")


def stream_gaps(url: str, prompt: list[int]) -> list[float]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": gen, "temperature": 0,
            "ignore_eos": True, "stream": True}
    stamps: list[float] = []
    with httpx.Client(timeout=300) as s, s.stream("POST", f"{url}/v1/completions",
                                                  json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                stamps.append(time.perf_counter())
    return [b - a for a, b in zip(stamps[1:], stamps[2:])]  # from the 2nd token: decode only


def background(url: str, stop: threading.Event, sent: list[int]) -> None:
    rng = random.Random(7)
    with httpx.Client(timeout=120) as s:
        while not stop.is_set():
            t = time.perf_counter()
            p = [rng.randrange(10, 30000) for _ in range(bg_prompt)]
            try:
                s.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": p, "max_tokens": 1,
                                                      "cache_salt": uuid.uuid4().hex}
                       ).raise_for_status()
                sent[0] += 1
            except httpx.HTTPError as e:
                log(f"background request failed: {e!r}")
            stop.wait(max(0.0, interval - (time.perf_counter() - t)))


def q(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(p * len(s)))]


def itl(res: dict) -> None:
    prompt = [random.Random(1).randrange(10, 30000) for _ in range(512)]
    gaps: dict[str, list[float]] = {k: [] for k in urls}
    sent = dict.fromkeys(urls, 0)
    for i in range(rounds):
        if time.time() > deadline - 20:
            log(f"ITL: stopped after {i} rounds, deadline near")
            break
        for name, u in urls.items():  # rotated: each server measured in turn, same load
            stop, n = threading.Event(), [0]
            th = threading.Thread(target=background, args=(u, stop, n), daemon=True)
            th.start()
            time.sleep(interval)
            try:
                g = stream_gaps(u, prompt)
            finally:
                stop.set()
                th.join()
            gaps[name] += g
            sent[name] += n[0]
            log(f"ITL round {i} {name}: p50 {statistics.median(g) * 1e3:.2f} ms, "
                f"p90 {q(g, 0.9) * 1e3:.2f} ms, background requests {n[0]}")
    r = {k: {"p50_ms": statistics.median(g) * 1e3, "p90_ms": q(g, 0.9) * 1e3, "gaps": len(g),
             "background_requests": sent[k]} for k, g in gaps.items() if g}
    res["itl"] = {"rounds": rounds, "gen_tokens": gen, "bg_prompt_tokens": bg_prompt,
                  "bg_interval_s": interval, "servers": r}


def main() -> int:
    for name, u in list(urls.items()):
        # side_bench.sh started each one once the previous served: a tier not up by now died
        if not healthy(u, 600 if name == "base" else 20):  # the others are still measured
            log(f"{name} ({u}) not healthy before the deadline")
            del urls[name]
    if "base" not in urls:
        return 2
    log(f"healthy: {sorted(urls)}")
    res: dict = {"lengths": lengths, "reps": reps, "ttft": {}}
    try:
        ttft(res)
        itl(res)
    finally:
        with open(out, "w") as fh:
            json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
