"""Router overhead and throughput, side by side with other P/D proxies, on the same fakes.

One run measures, on benchmarks/fake_openai_engine.py engines (no model time, 16-token
streamed chats; the decode fake publishes kvtier's params feed, as ``KVTierNixlConnector``
does), interleaved round by round so drift hits every target alike:

- ``pd-client``: the load generator orchestrates P->D itself (non-streaming prefill leg,
  then the streamed decode leg straight to the engines): the floor a proxy adds to;
- ``kvtier``: ``kvtier router`` (1 worker, memory store) at its defaults (``stream_capture:
  stream`` with the decode node's params feed, implicit sessions), P/D mode;
- ``kvtier-pass``: the same with ``stream_capture: passthrough`` (keeps nothing: the work
  an example proxy does; the previous runs' ``kvtier``);
- ``vllm-toy``: the anchor, vLLM's own P/D example proxy
  (``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py``, FastAPI + httpx), run
  from ``--anchor`` (default ``benchmarks/anchors/toy_proxy_server.py``; see
  ``benchmarks/anchors/README.md`` for where it comes from);
- every ``--proxy NAME=COMMAND``. COMMAND placeholders: {port} {prefill} {decode} (URLs)
  {prefill_port} {decode_port};
- ``minimal``: unless ``--no-minimal``, a lean P->D proxy built into this file (aiohttp
  server and client, no validation/metrics/retries);

at each ``--concurrency``: p50/p99 latency, TTFT, req/s, errors; overhead = target minus
``pd-client``. Then:

- ``--conv-bench``: one client, streamed multi-turn ``/v1/completions`` conversations
  (``--turns``, each turn's prompt the last one plus its answer plus new tokens), named
  (``conversation_id``) and unnamed (kvtier finds them by prefix), on two engine pairs:
  ``instant`` (the fakes above) for the turn overhead, ``stream`` (``--token-delay-ms`` per
  token) for the time to the first content chunk, against the decode leg's own (pd-client:
  from the turn's start, and from the decode leg's send);
- ``--store-bench``: the price of a Redis conversation store per named turn (non-streaming
  2-turn conversations, memory vs ``redis://`` with redis-py's default parser (hiredis when
  installed) vs ``redis://`` with hiredis hidden from the router; needs redis-server);
- ``--workers-bench``: ``kvtier router --workers 2`` over Redis at the highest concurrency;
- ``--rss-bench N``: RSS of N 5-turn conversations.

Placement: with ``--router-cpus`` / ``--engine-cpus`` (default: core 0 / the rest) every
proxy runs under ``taskset`` on the router cores, the fakes and this load generator on the
engine cores.

    .venv/bin/python benchmarks/bench_router.py --duration 5 --rounds 3 --conv-bench \\
        --store-bench [--proxy 'NAME=COMMAND'] --out FILE.json
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
CONTENT = b"tok "  # every content chunk of the fakes carries it (role-only chunks do not)
GEN = list(range(100, 116))  # the ids the fakes generate (16 tokens)


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
                    if first is None and CONTENT in chunk:
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


async def stream_conversations(url: str | tuple[str, str], named: bool, turns: int,
                               duration: float, base: int) -> dict:
    """One client, streamed multi-turn ``/v1/completions`` conversations: per turn the time to
    the first content chunk (``ttfc``) and to ``[DONE]`` (``turn``); a ``url`` tuple
    (prefill, decode) is client-orchestrated P->D, which also gives the decode leg's own
    time to first content (``leg_ttfc``, from the decode request's send). Each turn's prompt
    is the last one plus the answer's ids plus 8 new tokens; ``base`` makes every
    conversation's first token unique across the run (unnamed ones are found by prefix)."""
    import aiohttp

    ttfc: list[float] = []
    turn_lat: list[float] = []
    leg: list[float] = []
    later_ttfc: list[float] = []
    later_turn: list[float] = []
    reuse: dict[str, int] = {}
    errors = 0
    stop = time.perf_counter() + duration
    n = 0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        while time.perf_counter() < stop:
            n += 1
            prompt = [base + n, *range(1, 40)]
            for k in range(turns):
                body: dict[str, Any] = {"model": "fake", "prompt": prompt, "max_tokens": 16,
                                        "stream": True}
                if named:
                    body["conversation_id"] = f"c{base}-{n}"
                t0 = time.perf_counter()
                first = None
                try:
                    target = url
                    if isinstance(url, tuple):
                        pre = {**body, "max_tokens": 1, "stream": False,
                               "kv_transfer_params": {"do_remote_decode": True}}
                        async with s.post(url[0], json=pre) as r:
                            kvp = (await r.json()).get("kv_transfer_params")
                        target, body = url[1], {**body, "kv_transfer_params": kvp}
                    t_leg = time.perf_counter()
                    async with s.post(target, json=body) as r:
                        if r.status != 200:
                            errors += 1
                            await r.read()
                            break
                        h = r.headers.get("x-kvtier-reuse")
                        if h and k:
                            key = h.split(";")[0].strip()
                            reuse[key] = reuse.get(key, 0) + 1
                        tail = b""
                        async for chunk in r.content.iter_any():
                            if first is None and CONTENT in chunk:
                                first = time.perf_counter()
                            tail = (tail + chunk)[-64:]
                except (TimeoutError, aiohttp.ClientError):
                    errors += 1
                    break
                t1 = time.perf_counter()
                if b"[DONE]" not in tail or first is None:
                    errors += 1
                    break
                ttfc.append(first - t0)
                turn_lat.append(t1 - t0)
                leg.append(first - t_leg)
                if k:
                    later_ttfc.append(first - t0)
                    later_turn.append(t1 - t0)
                prompt = [*prompt, *GEN, *range(200 + k, 208 + k)]
    ms = lambda v: round(v * 1e3, 3)
    out = {"turns": len(turn_lat), "conversations": n, "errors": errors,
           "ttfc_p50_ms": ms(pct(ttfc, 50)), "ttfc_p99_ms": ms(pct(ttfc, 99)),
           "turn_p50_ms": ms(pct(turn_lat, 50)), "turn_p99_ms": ms(pct(turn_lat, 99)),
           "later_ttfc_p50_ms": ms(pct(later_ttfc, 50)),
           "later_turn_p50_ms": ms(pct(later_turn, 50))}
    if isinstance(url, tuple):
        out["leg_ttfc_p50_ms"] = ms(pct(leg, 50))
    if reuse:
        out["reuse_later_turns"] = reuse
    return out


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

    def pair(self, tag: str, delay_ms: float = 0.0) -> tuple[str, dict[str, str]]:
        """A prefill fake and a decode fake that publishes kvtier's params feed: (prefill
        URL, the decode instance as a router config entry)."""
        extra = ("--token-delay-ms", str(delay_ms)) if delay_ms else ()
        p = self.engine(f"P{tag}", *extra)
        feed = f"tcp://127.0.0.1:{free_port()}"
        d = self.engine(f"D{tag}", "--params-feed", feed, *extra)
        return p, {"name": "decode-0", "url": d, "params_feed": feed}

    def proxy(self, name: str, argv: list[str], port: int, cpus: str | None = None,
              env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
        p = spawn(argv, self.tmp / f"{name}.log", cpus or self.router_cpus, env)
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

    def kvtier(self, name: str, p: str, d: str | dict[str, str], cpus: str | None = None,
               env: dict[str, str] | None = None, **cfg: Any) -> tuple[subprocess.Popen, str]:
        """``d``: a URL (no params feed) or a decode instance entry (``pair``)."""
        port = free_port()
        f = self.tmp / f"{name}.json"
        f.write_text(json.dumps({"prefill": [p], "decode": [d], "port": port, **cfg}))
        return self.proxy(name, [PY, "-m", "kvtier.cli", "router", "--config", str(f)], port,
                          cpus, env)

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


def median_conv(runs: list[dict]) -> dict:
    keys = [k for k in runs[0] if k.endswith("_ms")]
    out: dict[str, Any] = {k: round(statistics.median(r[k] for r in runs), 3) for k in keys}
    out["errors"] = sum(r["errors"] for r in runs)
    out["turns"] = sum(r["turns"] for r in runs)
    reuse: dict[str, int] = {}
    for r in runs:
        for k, v in (r.get("reuse_later_turns") or {}).items():
            reuse[k] = reuse.get(k, 0) + v
    if reuse:
        out["reuse_later_turns"] = reuse
    return out


DEFAULT_ANCHOR = HERE / "anchors" / "toy_proxy_server.py"


def anchor_argv(path: str) -> list[str]:
    """vLLM's toy proxy, pointed at the fakes through its own CLI."""
    return [PY, path, "--host", "127.0.0.1", "--port", "{port}",
            "--prefiller-host", "127.0.0.1", "--prefiller-port", "{prefill_port}",
            "--decoder-host", "127.0.0.1", "--decoder-port", "{decode_port}"]


def proxies(fleet: Fleet, a: argparse.Namespace, p_url: str, d: dict[str, str],
            tag: str, passthrough: bool) -> dict[str, tuple[str, int]]:
    """Every proxy target on one engine pair: name -> (base URL, pid)."""
    d_url = d["url"]
    out: dict[str, tuple[str, int]] = {}
    kp, u = fleet.kvtier(f"kvtier{tag}", p_url, d)
    out["kvtier"] = (u, kp.pid)
    if passthrough:
        kp, u = fleet.kvtier(f"kvtier-pass{tag}", p_url, d_url, stream_capture="passthrough")
        out["kvtier-pass"] = (u, kp.pid)
    specs = list(a.proxy)
    if a.anchor != "none" and Path(a.anchor).is_file():
        specs.insert(0, "vllm-toy=" + shlex.join(anchor_argv(a.anchor)))
    for spec in specs:
        name, _, cmd = spec.partition("=")
        port = free_port()
        argv = [x.format(port=port, prefill=p_url, decode=d_url,
                         prefill_port=p_url.rsplit(":", 1)[1],
                         decode_port=d_url.rsplit(":", 1)[1]) for x in shlex.split(cmd)]
        pp, u = fleet.proxy(f"{name}{tag}", argv, port)
        out[name] = (u, pp.pid)
    if not a.no_minimal:
        port = free_port()
        mp, u = fleet.proxy(f"minimal{tag}", [PY, str(Path(__file__).resolve()),
                                              "--serve-minimal-proxy", str(port), p_url,
                                              d_url], port)
        out["minimal"] = (u, mp.pid)
    return out


def hiredis_state(env: dict[str, str] | None) -> bool:
    out = subprocess.run([PY, "-c", "import redis.utils as u; print(u.HIREDIS_AVAILABLE)"],
                         check=False, capture_output=True, text=True,
                         env={**os.environ, **(env or {})})
    return out.stdout.strip() == "True"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--duration", type=float, default=5.0, help="seconds per target and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", default="1,16,128")
    ap.add_argument("--proxy", action="append", default=[], metavar="NAME=COMMAND")
    ap.add_argument("--anchor", default=str(DEFAULT_ANCHOR),
                    help="vLLM's toy_proxy_server.py to run as target 'vllm-toy' ('none': "
                         "skip; a missing file is skipped)")
    ap.add_argument("--no-minimal", action="store_true")
    ap.add_argument("--router-cpus", default="0")
    ap.add_argument("--engine-cpus", default=None, help="default: every core but the router's")
    ap.add_argument("--conv-bench", action="store_true",
                    help="streamed multi-turn conversations, named and unnamed: turn overhead "
                         "and time to first content chunk")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--token-delay-ms", type=float, default=2.0,
                    help="per-token delay of the 'stream' engine pair (--conv-bench)")
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
                               "anchor": a.anchor, "started": time.strftime(
                                   "%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                               "loadavg_start": os.getloadavg()}
    try:
        p_url, d_inst = fleet.pair("")
        d_url = d_inst["url"]
        px = proxies(fleet, a, p_url, d_inst, "", passthrough=True)
        targets: dict[str, str | tuple[str, str]] = {
            "pd-client": (p_url + "/v1/chat/completions", d_url + "/v1/chat/completions")}
        pids: dict[str, int | None] = {"pd-client": None}
        for name, (u, pid) in px.items():
            targets[name], pids[name] = u + "/v1/chat/completions", pid
        results["runs"] = []
        levels = [int(x) for x in a.concurrency.split(",") if x]
        for c in levels:
            per: dict[str, list[dict]] = {k: [] for k in targets}
            loads = []
            for _ in range(a.rounds):
                for name, url in targets.items():
                    per[name].append(measured(url, CHAT, c, a.duration, pids[name]))
                loads.append(os.getloadavg()[0])
            run = {"concurrency": c, **{k: median_of(v) for k, v in per.items()},
                   "loadavg_1m": loads, "rounds": per}
            base = run["pd-client"]
            for k in targets:
                if k != "pd-client":
                    run[k]["overhead_p50_ms"] = round(run[k]["p50_ms"] - base["p50_ms"], 3)
                    run[k]["overhead_p99_ms"] = round(run[k]["p99_ms"] - base["p99_ms"], 3)
            results["runs"].append(run)
            print(json.dumps({k: v for k, v in run.items() if k != "rounds"}), flush=True)
        if a.conv_bench:
            results["conversations"] = conv_bench(a, fleet, p_url, d_inst, px)
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
            results["store"] = store_bench(a, fleet, p_url, d_url, redis_url)
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
            results["rss"] = rss_bench(a, fleet, p_url, d_url)
        results["loadavg_end"] = os.getloadavg()
        if a.out:
            Path(a.out).write_text(json.dumps(results, indent=2))
    finally:
        fleet.close()
    return 0


def conv_bench(a: argparse.Namespace, fleet: Fleet, p_url: str, d_inst: dict[str, str],
               px: dict[str, tuple[str, int]]) -> dict:
    """Streamed conversations on the instant pair (``px``) and on a pair with per-token
    delay: every target one client, named and (kvtier) unnamed, interleaved by round."""
    out: dict[str, Any] = {"turns_per_conversation": a.turns,
                           "token_delay_ms": a.token_delay_ms}
    p2, d2 = fleet.pair("s", a.token_delay_ms)
    px2 = proxies(fleet, a, p2, d2, "-s", passthrough=False)
    base = int(time.time()) % 100_000 * 1000
    for label, p, d, ps in (("instant", p_url, d_inst["url"], px),
                            ("stream", p2, d2["url"], px2)):
        # (target, url, named)
        cases: list[tuple[str, str | tuple[str, str], bool]] = [
            ("pd-client", (p + "/v1/completions", d + "/v1/completions"), True)]
        for name, (u, _) in ps.items():
            if name == "kvtier-pass":
                continue
            cases.append((name, u + "/v1/completions", True))
            if name == "kvtier":
                cases.append(("kvtier-unnamed", u + "/v1/completions", False))
        per: dict[str, list[dict]] = {c[0]: [] for c in cases}
        for _ in range(a.rounds):
            for name, u, named in cases:
                base += 100_000
                per[name].append(asyncio.run(stream_conversations(u, named, a.turns,
                                                                  a.duration, base)))
        med = {k: median_conv(v) for k, v in per.items()}
        floor = med["pd-client"]
        for k, v in med.items():
            if k != "pd-client":
                v["turn_overhead_p50_ms"] = round(v["turn_p50_ms"] - floor["turn_p50_ms"], 3)
                v["ttfc_over_pd_p50_ms"] = round(v["ttfc_p50_ms"] - floor["ttfc_p50_ms"], 3)
        out[label] = {"median": med, "rounds": per, "loadavg_1m": os.getloadavg()[0]}
        print(json.dumps({"conversations": label, **med}), flush=True)
    return out


def store_bench(a: argparse.Namespace, fleet: Fleet, p_url: str, d_url: str,
                redis_url: str) -> dict:
    """Named 2-turn non-streaming conversations, one client: memory vs Redis (redis-py's
    default parser: hiredis when installed) vs Redis with hiredis hidden."""
    shim = fleet.tmp / "no-hiredis"
    shim.mkdir(exist_ok=True)
    (shim / "hiredis.py").write_text("raise ImportError('hidden by bench_router.py')\n")
    no_hi = {"PYTHONPATH": str(shim)}
    routers = {"memory": fleet.kvtier("kv-mem", p_url, d_url)[1],
               "redis": fleet.kvtier("kv-redis", p_url, d_url, store=redis_url)[1]}
    parser = {"redis": "hiredis" if hiredis_state(None) else "python"}
    if parser["redis"] == "hiredis":
        routers["redis-nohiredis"] = fleet.kvtier("kv-redis-nohi", p_url, d_url,
                                                  env=no_hi, store=redis_url)[1]
        parser["redis-nohiredis"] = "hiredis" if hiredis_state(no_hi) else "python"
    st: dict[str, list[dict]] = {k: [] for k in routers}
    for _ in range(a.rounds):
        for name, u in routers.items():
            st[name].append(asyncio.run(conversations(u + "/v1/completions", 2, a.duration)))
    med: dict[str, Any] = {
        k: {m: statistics.median(r[m] for r in v) for m in ("p50_ms", "p99_ms")}
        | {"errors": sum(r["errors"] for r in v), "turns": sum(r["turns"] for r in v)}
        for k, v in st.items()}
    for k, u in routers.items():
        if k != "memory":
            med[f"{k}_adds_p50_ms"] = round(med[k]["p50_ms"] - med["memory"]["p50_ms"], 3)
            # The router's own account of its Redis calls (mean per call, by operation).
            med[k]["store_call_mean_us"] = store_call_means(u)
    print(json.dumps({"store": med, "parser": parser}), flush=True)
    return {"median": med, "parser": parser, "rounds": st}


def store_call_means(base_url: str) -> dict[str, float]:
    """``kvtier_router_store_latency_seconds`` sum / count per op, microseconds."""
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for line in httpx.get(base_url + "/metrics", timeout=10).text.splitlines():
        if not line.startswith("kvtier_router_store_latency_seconds_"):
            continue
        name, _, value = line.rpartition(" ")
        op = name.split('op="', 1)[1].split('"', 1)[0] if 'op="' in name else "?"
        if name.startswith("kvtier_router_store_latency_seconds_sum"):
            sums[op] = float(value)
        elif name.startswith("kvtier_router_store_latency_seconds_count"):
            counts[op] = float(value)
    return {op: round(sums[op] / counts[op] * 1e6, 1) for op in sums if counts.get(op)}


def rss_bench(a: argparse.Namespace, fleet: Fleet, p_url: str, d_url: str) -> dict:
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
    print(json.dumps({"rss": rss}), flush=True)
    fleet.stop(rp)
    return rss


if __name__ == "__main__":
    sys.exit(main())
