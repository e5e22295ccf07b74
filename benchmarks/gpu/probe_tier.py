"""Client probe for vLLM + KVTierConnector on a GPU: host-tier hit after /reset_prefix_cache
(greedy output equal), TTFT from the host tier vs recompute at several prompt lengths.

TTFT = wall time of a non-streaming completion with max_tokens=1 (HTTP included).
Recompute: a fresh cache_salt per request (misses the device cache and the host tier).
Host tier: the prompt was served once (stored at finish), then /reset_prefix_cache before
every request, so the prefix can only come from the host tier.

usage: probe_tier.py URL DEADLINE_EPOCH METRICS_PORT OUT.json [LENGTHS (3000,16000)] [REPS 5]
"""

from __future__ import annotations

import json
import os
import random
import re
import statistics
import sys
import time
import uuid

import httpx

url, deadline, mport, out = sys.argv[1], float(sys.argv[2]), sys.argv[3], sys.argv[4]
lengths = [int(x) for x in (sys.argv[5] if len(sys.argv) > 5 else "3000,16000").split(",")]
reps = int(sys.argv[6]) if len(sys.argv) > 6 else 5
MODEL = "m8b"
c = httpx.Client(timeout=300)


def log(*a: object) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


def wait_health() -> bool:
    t0, pid = time.time(), int(os.environ.get("SERVER_PID", "0"))
    while time.time() < deadline:
        if pid:
            try:
                os.kill(pid, 0)
            except OSError:
                log("server process exited before /health")
                return False
        try:
            if c.get(f"{url}/health", timeout=2).status_code == 200:
                log(f"health OK after {time.time() - t0:.1f}s")
                return True
        except Exception:
            pass
        time.sleep(1)
    log("health NOT reached before deadline")
    return False


def complete(prompt: list[int], n: int, **extra: object) -> tuple[float, list[int]]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0,
            "return_token_ids": True, **extra}
    t = time.perf_counter()
    r = c.post(f"{url}/v1/completions", json=body)
    dt = time.perf_counter() - t
    r.raise_for_status()
    return dt, r.json()["choices"][0].get("token_ids")


def metric(text: str, name: str, label: str = "") -> float:
    tot = 0.0
    for line in text.splitlines():
        m = re.match(r"^(\S+?)(\{.*\})?\s+(\S+)$", line)
        if m and m.group(1) == name and label in (m.group(2) or ""):
            tot += float(m.group(3))
    return tot


def scrape() -> tuple[str, str]:
    try:
        k = c.get(f"http://127.0.0.1:{mport}/metrics", timeout=5).text
    except Exception as e:
        k = f"#ERR {e!r}"
    return c.get(f"{url}/metrics").text, k


if not wait_health():
    sys.exit(2)
res: dict = {"lengths": {}, "reps": reps}
complete([random.Random(0).randrange(10, 2000) for _ in range(64)], 4)  # warm-up
for n in lengths:
    p = [random.Random(n).randrange(10, 2000) for _ in range(n)]
    _, ref = complete(p, 16, cache_salt=uuid.uuid4().hex)
    time.sleep(0.5)
    rec = []
    for _ in range(reps):
        dt, _ = complete(p, 1, cache_salt=uuid.uuid4().hex)
        rec.append(dt)
        time.sleep(0.5)  # let the finished request's store leave the next measurement
    _, turn1 = complete(p, 16)  # computed, stored into the host tier at finish
    time.sleep(1.0)
    m0, k0 = scrape()
    tier = []
    for _ in range(reps):
        c.post(f"{url}/reset_prefix_cache").raise_for_status()
        time.sleep(0.3)
        dt, _ = complete(p, 1)
        tier.append(dt)
        time.sleep(0.3)
    c.post(f"{url}/reset_prefix_cache").raise_for_status()
    time.sleep(0.3)
    dt16, again = complete(p, 16)
    m1, k1 = scrape()
    d = {
        "recompute_ttft_ms": [x * 1e3 for x in rec],
        "tier_ttft_ms": [x * 1e3 for x in tier],
        "recompute_median_ms": statistics.median(rec) * 1e3,
        "tier_median_ms": statistics.median(tier) * 1e3,
        "greedy_equal": {"ref_vs_turn1": ref == turn1, "ref_vs_after_reset": ref == again},
        "external_hit_tokens": metric(m1, "vllm:external_prefix_cache_hits_total")
        - metric(m0, "vllm:external_prefix_cache_hits_total"),
        "tier_hit_blocks": metric(k1, "kvtier_tier_hit_blocks_total")
        - metric(k0, "kvtier_tier_hit_blocks_total"),
        "tier_load_bytes": metric(k1, "kvtier_tier_bytes_moved_total", 'path="load"')
        - metric(k0, "kvtier_tier_bytes_moved_total", 'path="load"'),
    }
    d["speedup"] = d["recompute_median_ms"] / d["tier_median_ms"]
    res["lengths"][str(n)] = d
    log(f"{n} tokens: recompute {d['recompute_median_ms']:.1f} ms, host tier "
        f"{d['tier_median_ms']:.1f} ms (x{d['speedup']:.2f}); equal={d['greedy_equal']}; "
        f"ext hits {d['external_hit_tokens']:.0f}, tier blocks {d['tier_hit_blocks']:.0f}")
with open(out, "w") as fh:
    json.dump(res, fh, indent=1)
print(json.dumps(res, indent=1))
