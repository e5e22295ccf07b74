"""Decode inter-token latency with and without host-tier stores (GPU target: stores add <= 5%).

Two vLLM servers on the one GPU, same model and flags: BASE (no connector) and TIER
(KVTierConnector, every finished request stored to the host tier). On each, in turn
(BASE, TIER, BASE, TIER, ...), one long greedy generation is streamed and the gaps between its
token events are recorded, in two conditions:

- quiet: nothing else runs (the connector's per-step cost alone);
- stores: meanwhile a second client sends a fresh PROMPT-token request (max_tokens 1, a new
  cache_salt each, so every one is a miss that is prefilled and, on TIER, then stored:
  PROMPT x KV bytes/token to the host tier) every INTERVAL seconds. Both servers get the same
  background prefills, so TIER/BASE isolates what the stores add.

Only the interleaved medians are compared (pooled gaps of every round, p50 and p90), as ratios
TIER/BASE per condition. The GPU is shared by the two servers; only one is measured at a time.

usage: probe_itl.py BASE_URL TIER_URL DEADLINE_EPOCH OUT.json [ROUNDS 3] [GEN 512] [PROMPT 2048]
       [INTERVAL 0.25]
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

base, tier, deadline, out = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
rounds = int(sys.argv[5]) if len(sys.argv) > 5 else 3
gen = int(sys.argv[6]) if len(sys.argv) > 6 else 512
prompt_len = int(sys.argv[7]) if len(sys.argv) > 7 else 2048
interval = float(sys.argv[8]) if len(sys.argv) > 8 else 0.25
MODEL = sys.argv[9] if len(sys.argv) > 9 else "m8b"


def log(*a: object) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


def wait_health(url: str) -> bool:
    with httpx.Client(timeout=2) as c:
        while time.time() < deadline:
            try:
                if c.get(f"{url}/health").status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            time.sleep(1)
    return False


def stream_gaps(url: str, prompt: list[int]) -> list[float]:
    """Seconds between consecutive token events of one streamed greedy generation."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": gen, "temperature": 0,
            "ignore_eos": True, "stream": True}
    stamps: list[float] = []
    with httpx.Client(timeout=300) as c, c.stream("POST", f"{url}/v1/completions",
                                                  json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                stamps.append(time.perf_counter())
    return [b - a for a, b in zip(stamps[1:], stamps[2:])]  # from the 2nd token: decode only


def background(url: str, stop: threading.Event, sent: list[int]) -> None:
    rng = random.Random(7)
    with httpx.Client(timeout=120) as c:
        while not stop.is_set():
            t = time.perf_counter()
            p = [rng.randrange(10, 30000) for _ in range(prompt_len)]
            try:
                c.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": p, "max_tokens": 1,
                                                       "cache_salt": uuid.uuid4().hex}).raise_for_status()
                sent[0] += 1
            except httpx.HTTPError as e:
                log(f"background request failed: {e!r}")
            stop.wait(max(0.0, interval - (time.perf_counter() - t)))


def one(url: str, prompt: list[int], loaded: bool) -> tuple[list[float], int]:
    stop, sent = threading.Event(), [0]
    th = None
    if loaded:
        th = threading.Thread(target=background, args=(url, stop, sent), daemon=True)
        th.start()
        time.sleep(interval)  # the first background prefill is under way
    try:
        return stream_gaps(url, prompt), sent[0]
    finally:
        stop.set()
        if th is not None:
            th.join()


def q(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(p * len(s)))]


def main() -> int:
    for u in (base, tier):
        if not wait_health(u):
            log(f"{u} not healthy before the deadline")
            return 2
    log("both healthy")
    prompt = [random.Random(1).randrange(10, 30000) for _ in range(512)]
    for u in (base, tier):  # warm-up: graphs, allocator
        stream_gaps(u, prompt[:64])
    res: dict = {"rounds": rounds, "gen_tokens": gen, "bg_prompt_tokens": prompt_len,
                 "bg_interval_s": interval, "conditions": {}}
    for cond in ("quiet", "stores"):
        gaps: dict[str, list[float]] = {"base": [], "tier": []}
        sent = {"base": 0, "tier": 0}
        for i in range(rounds):
            for name, u in (("base", base), ("tier", tier)):
                g, n = one(u, prompt, cond == "stores")
                gaps[name] += g
                sent[name] += n
                log(f"{cond} round {i} {name}: {len(g)} gaps, p50 {statistics.median(g) * 1e3:.2f}"
                    f" ms, p90 {q(g, 0.9) * 1e3:.2f} ms, background requests {n}")
        c = {name: {"p50_ms": statistics.median(g) * 1e3, "p90_ms": q(g, 0.9) * 1e3,
                    "mean_ms": statistics.fmean(g) * 1e3, "gaps": len(g),
                    "background_requests": sent[name]} for name, g in gaps.items()}
        c["ratio_p50"] = c["tier"]["p50_ms"] / c["base"]["p50_ms"]
        c["ratio_p90"] = c["tier"]["p90_ms"] / c["base"]["p90_ms"]
        c["ratio_mean"] = c["tier"]["mean_ms"] / c["base"]["mean_ms"]
        res["conditions"][cond] = c
        log(f"{cond}: TIER/BASE p50 x{c['ratio_p50']:.3f}, p90 x{c['ratio_p90']:.3f}, "
            f"mean x{c['ratio_mean']:.3f}")
    with open(out, "w") as fh:
        json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
