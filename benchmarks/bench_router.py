"""Router overhead and throughput against a fast fake engine.

Measures, for streamed chat completions of 16 tokens:

- latency (time to first byte, time to last byte) calling the decode engine
  directly vs through `kvtier router` (P/D split: prefill leg + decode leg),
  p50/p99, at 1, 16 and 128 concurrent streams, plus req/s and errors;
- the price of `stream_capture: buffered` (decode run non-streaming so D's
  kv_transfer_params can be kept) against `passthrough`, with a simulated
  per-token decode time so TTFT means something.

Engines are benchmarks/fake_openai_engine.py processes (no model time), so the
difference is the router's own cost plus one extra engine round trip (the
prefill leg, measured separately and reported). Everything runs on this
machine; the load generator shares its cores with the router.

    .venv/bin/python benchmarks/bench_router.py [--duration 10] [--out benchmarks/router.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from kvtier.runtime import free_ports

HERE = Path(__file__).resolve().parent
PY = sys.executable


def free_port() -> int:
    return free_ports(1)[0]


def spawn(argv: list[str], log: Path) -> subprocess.Popen:
    fh = open(log, "wb")
    return subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)


def wait_http(url: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


async def load(url: str, body: dict, concurrency: int, duration: float) -> dict:
    lat, ttft, errors = [], [], 0
    stop = time.perf_counter() + duration
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    async with httpx.AsyncClient(timeout=60, limits=limits) as c:
        async def worker() -> None:
            nonlocal errors
            while time.perf_counter() < stop:
                t0 = time.perf_counter()
                first = None
                try:
                    async with c.stream("POST", url, json=body) as r:
                        if r.status_code != 200:
                            errors += 1
                            await r.aread()
                            continue
                        done = False
                        async for chunk in r.aiter_bytes():
                            if first is None:
                                first = time.perf_counter()
                            done = done or b"[DONE]" in chunk
                        if not done:
                            errors += 1
                            continue
                except httpx.HTTPError:
                    errors += 1
                    continue
                t1 = time.perf_counter()
                lat.append(t1 - t0)
                ttft.append((first or t1) - t0)

        t_start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - t_start
    ms = lambda v: round(v * 1e3, 3)  # noqa: E731
    return {"requests": len(lat), "errors": errors, "rps": round(len(lat) / elapsed, 1),
            "p50_ms": ms(pct(lat, 50)), "p99_ms": ms(pct(lat, 99)),
            "ttft_p50_ms": ms(pct(ttft, 50)), "ttft_p99_ms": ms(pct(ttft, 99))}


def prefill_rtt(p_url: str, n: int = 300) -> dict:
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True}}
    xs = []
    with httpx.Client() as c:
        for _ in range(n):
            t0 = time.perf_counter()
            c.post(p_url + "/v1/chat/completions", json=body).raise_for_status()
            xs.append(time.perf_counter() - t0)
    return {"p50_ms": round(pct(xs, 50) * 1e3, 3), "p99_ms": round(pct(xs, 99) * 1e3, 3)}


def start_router(tmp: Path, p_url: str, d_url: str, mode: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cfg = tmp / f"router-{mode}.json"
    cfg.write_text(json.dumps({"prefill": [p_url], "decode": [d_url], "port": port,
                               "stream_capture": mode}))
    proc = spawn([PY, "-m", "kvtier.cli", "router", "--config", str(cfg)], tmp / f"router-{mode}.log")
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/healthz")
    return proc, url


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--duration", type=float, default=8.0)
    ap.add_argument("--concurrency", default="1,16,128")
    ap.add_argument("--out", default=None)
    ap.add_argument("--tmp", default="/tmp/kvtier-bench-router")
    a = ap.parse_args()
    tmp = Path(a.tmp)
    tmp.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen] = []
    try:
        pp, dp, sp = free_port(), free_port(), free_port()
        fake = [PY, str(HERE / "fake_openai_engine.py"), "--tokens", "16"]
        procs.append(spawn([*fake, "--port", str(pp), "--name", "P"], tmp / "p.log"))
        procs.append(spawn([*fake, "--port", str(dp), "--name", "D"], tmp / "d.log"))
        procs.append(spawn([*fake, "--port", str(sp), "--name", "S", "--token-delay-ms", "5"],
                           tmp / "s.log"))
        p_url, d_url, s_url = (f"http://127.0.0.1:{x}" for x in (pp, dp, sp))
        for u in (p_url, d_url, s_url):
            wait_http(u + "/health")
        rproc, r_url = start_router(tmp, p_url, d_url, "passthrough")
        procs.append(rproc)
        chat = {"model": "fake", "messages": [{"role": "user", "content": "hello"}],
                "max_tokens": 16, "stream": True}
        results: dict = {"cpus": os.cpu_count(), "loadavg_start": os.getloadavg(),
                         "prefill_leg_rtt": prefill_rtt(p_url), "runs": []}
        for c in [int(x) for x in a.concurrency.split(",")]:
            direct = asyncio.run(load(d_url + "/v1/chat/completions", chat, c, a.duration))
            routed = asyncio.run(load(r_url + "/v1/chat/completions", chat, c, a.duration))
            run = {"concurrency": c, "direct": direct, "router": routed,
                   "overhead_p50_ms": round(routed["p50_ms"] - direct["p50_ms"], 3),
                   "overhead_p99_ms": round(routed["p99_ms"] - direct["p99_ms"], 3)}
            results["runs"].append(run)
            print(json.dumps(run), flush=True)
        # Price of capturing D's params for a streaming client (5 ms/token engine).
        cap = {}
        for mode in ("passthrough", "buffered"):
            rp, ru = start_router(tmp, s_url, s_url, mode)
            procs.append(rp)
            body = {**chat, "conversation_id": "bench-conv"}
            cap[mode] = asyncio.run(load(ru + "/v1/chat/completions", body, 1, a.duration / 2))
            rp.send_signal(signal.SIGTERM)
        results["stream_capture_5ms_per_token"] = cap
        print(json.dumps({"stream_capture_5ms_per_token": cap}), flush=True)
        results["loadavg_end"] = os.getloadavg()
        if a.out:
            Path(a.out).write_text(json.dumps(results, indent=2))
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
    return 0


if __name__ == "__main__":
    sys.exit(main())
