"""Router overhead and throughput, side by side with other P/D proxies, on the same fakes.

One run measures, on benchmarks/fake_openai_engine.py engines (no model time, 16-token
streamed chats), interleaved round by round so drift hits every target alike:

- ``pd-client``: the load generator orchestrates P->D itself (non-streaming prefill leg,
  then the streamed decode leg straight to the engines): the floor a proxy adds to;
- ``kvtier``: ``kvtier router`` (1 worker, memory store), P/D mode;
- every ``--proxy NAME=COMMAND`` (e.g. vLLM's example proxy from a vLLM checkout; never
  copied here). COMMAND placeholders: {port} {prefill} {decode} (URLs) {prefill_port}
  {decode_port};
- ``minimal``: unless ``--no-minimal``, a lean P->D proxy built into this file (aiohttp
  server and client, no validation/metrics/retries; the shape of vLLM's toy proxy) as a
  stand-in when no other proxy is at hand;

at each ``--concurrency``: p50/p99 latency, TTFT, req/s, errors; overhead = target minus
``pd-client``. Then (``--store-bench``) the price of a Redis conversation store per named
turn (non-streaming 2-turn conversations, memory vs ``redis://``, needs redis-server), and
(``--workers-bench``) ``kvtier router --workers 2`` over Redis at the highest concurrency.

Placement: with ``--router-cpus`` / ``--engine-cpus`` (default: core 0 / the rest) every
proxy runs under ``taskset`` on the router cores, the fakes and this load generator on the
engine cores.

    .venv/bin/python benchmarks/bench_router.py --duration 5 --rounds 3 \\
        [--proxy 'vllm=python toy_proxy_server.py --port {port} ...'] --out FILE.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from kvtier.runtime import free_ports

HERE = Path(__file__).resolve().parent
PY = sys.executable
CHAT = {"model": "fake", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 16,
        "stream": True}


def free_port() -> int:
    return free_ports(1)[0]


def spawn(argv: list[str], log: Path, cpus: str | None = None,
          env: dict[str, str] | None = None) -> subprocess.Popen:
    if cpus and shutil.which("taskset"):
        argv = ["taskset", "-c", cpus, *argv]
    fh = open(log, "wb")  # noqa: SIM115 - the child owns it
    return subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, **(env or {})})


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


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU of ``pid`` and every live descendant (workers), seconds."""
    if pid is None:
        return 0.0
    tick = os.sysconf("SC_CLK_TCK")
    stats: dict[int, tuple[int, float]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            f = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        stats[int(d.name)] = (int(f[1]), (int(f[11]) + int(f[12])) / tick)
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        if p in stats:
            total += stats[p][1]
        todo.extend(c for c, (pp, _) in stats.items() if pp == p)
    return total


def measured(url: Any, body: dict, concurrency: int, duration: float,
             pid: int | None) -> dict:
    """``load`` plus the proxy process's CPU milliseconds per answered request."""
    c0 = cpu_seconds(pid)
    out = asyncio.run(load(url, body, concurrency, duration))
    if pid is not None and out["requests"]:
        out["cpu_ms_per_req"] = round((cpu_seconds(pid) - c0) * 1e3 / out["requests"], 3)
    return out


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))]


# ---- load generation (aiohttp when present: cheaper per request than httpx) -------------
async def load(url: str | tuple[str, str], body: dict, concurrency: int,
               duration: float) -> dict:
    """Closed-loop load. ``url`` a tuple (prefill, decode): client-orchestrated P->D."""
    import aiohttp

    lat: list[float] = []
    ttft: list[float] = []
    errors = 0
    stop = time.perf_counter() + duration
    conn = aiohttp.TCPConnector(limit=concurrency + 8)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as s:
        async def one() -> bool:
            nonlocal errors
            t0 = time.perf_counter()
            first = None
            if isinstance(url, tuple):
                pre = {**body, "max_tokens": 1, "stream": False,
                       "kv_transfer_params": {"do_remote_decode": True}}
                async with s.post(url[0], json=pre) as r:
                    if r.status != 200:
                        errors += 1
                        return False
                    kvp = (await r.json()).get("kv_transfer_params")
                target, send = url[1], {**body, "kv_transfer_params": kvp}
            else:
                target, send = url, body
            async with s.post(target, json=send) as r:
                if r.status != 200:
                    errors += 1
                    await r.read()
                    return False
                tail = b""
                async for chunk in r.content.iter_any():
                    if first is None:
                        first = time.perf_counter()
                    tail = (tail + chunk)[-64:]
                if not send.get("stream", True):
                    tail = b"[DONE]"
                if b"[DONE]" not in tail:
                    errors += 1
                    return False
            t1 = time.perf_counter()
            lat.append(t1 - t0)
            ttft.append((first or t1) - t0)
            return True

        async def worker() -> None:
            nonlocal errors
            while time.perf_counter() < stop:
                try:
                    await one()
                except (TimeoutError, aiohttp.ClientError):
                    errors += 1

        t_start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - t_start
    ms = lambda v: round(v * 1e3, 3)
    return {"requests": len(lat), "errors": errors, "rps": round(len(lat) / elapsed, 1),
            "p50_ms": ms(pct(lat, 50)), "p99_ms": ms(pct(lat, 99)),
            "ttft_p50_ms": ms(pct(ttft, 50)), "ttft_p99_ms": ms(pct(ttft, 99))}


async def conversations(url: str, turns: int, duration: float) -> dict:
    """One client, named 2-turn conversations (non-streaming): per-turn latency."""
    import aiohttp

    lat: list[float] = []
    errors = 0
    stop = time.perf_counter() + duration
    n = 0
    run_id = time.monotonic_ns()
    async with aiohttp.ClientSession() as s:
        while time.perf_counter() < stop:
            n += 1
            # A prompt of its own: no conversation continues another (implicit sessions).
            prompt = [1000 + n % 30000, *range(39)]
            for _ in range(turns):
                body = {"model": "fake", "prompt": prompt, "max_tokens": 16,
                        "conversation_id": f"bench-{run_id}-{n}"}
                t0 = time.perf_counter()
                async with s.post(url, json=body) as r:
                    out = await r.read()
                    if r.status != 200:
                        errors += 1
                        continue
                lat.append(time.perf_counter() - t0)
                toks = json.loads(out)["choices"][0].get("token_ids") or list(range(16))
                prompt = [*prompt, *toks, 7]
    return {"turns": len(lat), "errors": errors, "p50_ms": round(pct(lat, 50) * 1e3, 3),
            "p99_ms": round(pct(lat, 99) * 1e3, 3)}


async def many_conversations(url: str, n: int, turns: int, concurrency: int) -> dict:
    """``n`` named conversations of ``turns`` non-streaming turns each, ``concurrency`` at a
    time, each turn's prompt the last one plus its answer plus 24 new tokens."""
    import aiohttp

    errors = 0
    done = 0
    sem = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as s:
        async def conv(i: int) -> None:
            nonlocal errors, done
            async with sem:
                prompt = [i % 5000 + 1] * 8 + list(range(100, 132))
                for t in range(turns):
                    body = {"model": "fake", "prompt": prompt, "max_tokens": 16,
                            "conversation_id": f"rss-{i}"}
                    async with s.post(url, json=body) as r:
                        raw = await r.read()
                        if r.status != 200:
                            errors += 1
                            return
                    toks = json.loads(raw)["choices"][0].get("token_ids") or []
                    prompt = [*prompt, *toks, *range(200 + t, 224 + t)]
                    done += 1
        await asyncio.gather(*(conv(i) for i in range(n)))
    return {"turns": done, "errors": errors}


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


# ---- a lean P->D proxy (the stand-in for vLLM's toy proxy) --------------------------------
def serve_minimal_proxy(port: int, prefill: str, decode: str) -> None:
    """Prefill leg (max_tokens=1, do_remote_decode), then relay decode's stream. No
    validation, metrics, retries or reuse: what the example proxies do."""
    import itertools

    import aiohttp
    from aiohttp import web

    ids = itertools.count()

    async def handle(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        s: aiohttp.ClientSession = request.app["s"]
        rid = f"min-{next(ids)}"
        pre = {**body, "max_tokens": 1, "stream": False,
               "kv_transfer_params": {"do_remote_decode": True}}
        pre.pop("stream_options", None)
        async with s.post(prefill + request.path, json=pre,
                          headers={"x-request-id": rid}) as r:
            kvp = (await r.json()).get("kv_transfer_params")
        out = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await out.prepare(request)
        async with s.post(decode + request.path, json={**body, "kv_transfer_params": kvp},
                          headers={"x-request-id": rid}) as r:
            async for chunk in r.content.iter_any():
                await out.write(chunk)
        await out.write_eof()
        return out

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def start(app: web.Application) -> None:
        app["s"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    async def stop(app: web.Application) -> None:
        await app["s"].close()

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handle)
    app.router.add_post("/v1/completions", handle)
    app.router.add_get("/healthz", health)
    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


# ---- the run ------------------------------------------------------------------------------
class Fleet:
    def __init__(self, tmp: Path, router_cpus: str | None, engine_cpus: str | None) -> None:
        self.tmp, self.router_cpus, self.engine_cpus = tmp, router_cpus, engine_cpus
        self.procs: list[subprocess.Popen] = []

    def engine(self, name: str, *extra: str) -> str:
        port = free_port()
        self.procs.append(spawn([PY, str(HERE / "fake_openai_engine.py"), "--tokens", "16",
                                 "--port", str(port), "--name", name, *extra],
                                self.tmp / f"{name}.log", self.engine_cpus))
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/health")
        return url

    def proxy(self, name: str, argv: list[str], port: int,
              cpus: str | None = None) -> tuple[subprocess.Popen, str]:
        p = spawn(argv, self.tmp / f"{name}.log", cpus or self.router_cpus)
        self.procs.append(p)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(url + "/healthz", timeout=1)
                return p, url
            except httpx.HTTPError:
                if p.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{name} did not start (see {self.tmp}/{name}.log)")
                time.sleep(0.1)

    def kvtier(self, name: str, p: str, d: str, cpus: str | None = None,
               **cfg: Any) -> tuple[subprocess.Popen, str]:
        port = free_port()
        f = self.tmp / f"{name}.json"
        f.write_text(json.dumps({"prefill": [p], "decode": [d], "port": port, **cfg}))
        return self.proxy(name, [PY, "-m", "kvtier.cli", "router", "--config", str(f)], port,
                          cpus)

    def stop(self, p: subprocess.Popen) -> None:
        try:
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(timeout=10)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                self.stop(p)


def median_of(runs: list[dict]) -> dict:
    keys = ("rps", "p50_ms", "p99_ms", "ttft_p50_ms", "ttft_p99_ms", "cpu_ms_per_req")
    out = {k: round(statistics.median(r[k] for r in runs), 3) for k in keys
           if all(k in r for r in runs)}
    out["errors"] = sum(r["errors"] for r in runs)
    out["requests"] = sum(r["requests"] for r in runs)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--duration", type=float, default=5.0, help="seconds per target and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", default="1,16,128")
    ap.add_argument("--proxy", action="append", default=[], metavar="NAME=COMMAND")
    ap.add_argument("--no-minimal", action="store_true")
    ap.add_argument("--router-cpus", default="0")
    ap.add_argument("--engine-cpus", default=None, help="default: every core but the router's")
    ap.add_argument("--store-bench", action="store_true")
    ap.add_argument("--workers-bench", action="store_true")
    ap.add_argument("--rss-bench", type=int, default=0, metavar="CONVERSATIONS",
                    help="that many 5-turn conversations through a memory-store router: "
                         "RSS growth against the store's own byte accounting")
    ap.add_argument("--out", default=None)
    ap.add_argument("--tmp", default="/tmp/kvtier-bench-router")
    ap.add_argument("--serve-minimal-proxy", nargs=3, metavar=("PORT", "PREFILL", "DECODE"),
                    help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve_minimal_proxy:
        port, p, d = a.serve_minimal_proxy
        serve_minimal_proxy(int(port), p, d)
        return 0
    ncpu = os.cpu_count() or 1
    rc = {int(x) for x in a.router_cpus.split(",")} if a.router_cpus else set()
    engine_cpus = a.engine_cpus or ",".join(str(i) for i in range(ncpu) if i not in rc) or None
    if engine_cpus:
        os.sched_setaffinity(0, {int(x) for x in engine_cpus.split(",")})
    tmp = Path(a.tmp)
    tmp.mkdir(parents=True, exist_ok=True)
    fleet = Fleet(tmp, a.router_cpus or None, engine_cpus)
    results: dict[str, Any] = {"cpus": ncpu, "router_cpus": a.router_cpus,
                               "engine_cpus": engine_cpus, "argv": sys.argv,
                               "loadavg_start": os.getloadavg()}
    try:
        p_url, d_url = fleet.engine("P"), fleet.engine("D")
        targets: dict[str, str | tuple[str, str]] = {
            "pd-client": (p_url + "/v1/chat/completions", d_url + "/v1/chat/completions")}
        pids: dict[str, int | None] = {"pd-client": None}
        kp, k_url = fleet.kvtier("kvtier", p_url, d_url, stream_capture="passthrough")
        targets["kvtier"], pids["kvtier"] = k_url + "/v1/chat/completions", kp.pid
        if not a.no_minimal:
            port = free_port()
            mp, m_url = fleet.proxy("minimal", [PY, str(Path(__file__).resolve()),
                                                "--serve-minimal-proxy", str(port), p_url,
                                                d_url], port)
            targets["minimal"], pids["minimal"] = m_url + "/v1/chat/completions", mp.pid
        for spec in a.proxy:
            name, _, cmd = spec.partition("=")
            port = free_port()
            argv = shlex.split(cmd.format(port=port, prefill=p_url, decode=d_url,
                                          prefill_port=p_url.rsplit(":", 1)[1],
                                          decode_port=d_url.rsplit(":", 1)[1]))
            pp, u = fleet.proxy(name, argv, port)
            targets[name], pids[name] = u + "/v1/chat/completions", pp.pid
        results["runs"] = []
        levels = [int(x) for x in a.concurrency.split(",") if x]
        for c in levels:
            per: dict[str, list[dict]] = {k: [] for k in targets}
            for _ in range(a.rounds):
                for name, url in targets.items():
                    per[name].append(measured(url, CHAT, c, a.duration, pids[name]))
            run = {"concurrency": c, **{k: median_of(v) for k, v in per.items()},
                   "rounds": per}
            base = run["pd-client"]
            for k in targets:
                if k != "pd-client":
                    run[k]["overhead_p50_ms"] = round(run[k]["p50_ms"] - base["p50_ms"], 3)
                    run[k]["overhead_p99_ms"] = round(run[k]["p99_ms"] - base["p99_ms"], 3)
            results["runs"].append(run)
            print(json.dumps({k: v for k, v in run.items() if k != "rounds"}), flush=True)
        top = max(levels, default=128)
        redis_url = None
        if a.store_bench or a.workers_bench:
            rport = free_port()
            # On the router's core: the store is the router's infrastructure, and the engine
            # core is saturated by the fakes and the load generator.
            fleet.procs.append(spawn([shutil.which("redis-server") or "redis-server", "--port",
                                      str(rport), "--save", "", "--appendonly", "no"],
                                     tmp / "redis.log", a.router_cpus or None))
            redis_url = f"redis://127.0.0.1:{rport}/0"
            time.sleep(0.5)
        if a.store_bench and redis_url:
            _, mem = fleet.kvtier("kv-mem", p_url, d_url)
            _, red = fleet.kvtier("kv-redis", p_url, d_url, store=redis_url)
            st: dict[str, list[dict]] = {"memory": [], "redis": []}
            for _ in range(a.rounds):
                for name, u in (("memory", mem), ("redis", red)):
                    st[name].append(asyncio.run(conversations(u + "/v1/completions", 2,
                                                              a.duration)))
            med = {k: {m: statistics.median(r[m] for r in v) for m in ("p50_ms", "p99_ms")}
                   | {"errors": sum(r["errors"] for r in v), "turns": sum(r["turns"] for r in v)}
                   for k, v in st.items()}
            med["redis_adds_p50_ms"] = round(med["redis"]["p50_ms"] - med["memory"]["p50_ms"], 3)
            results["store"] = {"median": med, "rounds": st}
            print(json.dumps({"store": med}), flush=True)
        if a.workers_bench and redis_url:
            cpus = ",".join(str(i) for i in range(ncpu))
            out: dict[str, Any] = {}
            for workers in (1, 2):
                pr, u = fleet.kvtier(f"kv-w{workers}", p_url, d_url, cpus=cpus,
                                     stream_capture="passthrough", store=redis_url,
                                     workers=workers)
                out[f"workers_{workers}"] = median_of([
                    measured(u + "/v1/chat/completions", CHAT, top, a.duration, pr.pid)
                    for _ in range(a.rounds)])
                fleet.stop(pr)
            results["workers"] = {"concurrency": top, "cpus": cpus, **out}
            print(json.dumps({"workers": results["workers"]}), flush=True)
        if a.rss_bench:
            rp, ru = fleet.kvtier("kv-rss", p_url, d_url)
            asyncio.run(many_conversations(ru + "/v1/completions", 50, 2, 16))  # warm up
            time.sleep(0.5)
            before = rss_kib(rp.pid)
            out = asyncio.run(many_conversations(ru + "/v1/completions", a.rss_bench, 5, 32))
            time.sleep(0.5)
            after = rss_kib(rp.pid)
            text = httpx.get(ru + "/metrics").text

            def sample(name: str) -> float:
                for line in text.splitlines():
                    if line.startswith(name + " "):
                        return float(line.split()[1])
                return float("nan")
            entries = sample("kvtier_router_conversations")
            accounted = sample("kvtier_router_conversation_store_bytes")
            rss = {"conversations": a.rss_bench, "turns": 5, **out, "entries": entries,
                   "rss_before_kib": before, "rss_after_kib": after,
                   "rss_growth_per_entry_b": round((after - before) * 1024 / max(entries, 1)),
                   "accounted_per_entry_b": round(accounted / max(entries, 1))}
            results["rss"] = rss
            print(json.dumps({"rss": rss}), flush=True)
            fleet.stop(rp)
        results["loadavg_end"] = os.getloadavg()
        if a.out:
            Path(a.out).write_text(json.dumps(results, indent=2))
    finally:
        fleet.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
