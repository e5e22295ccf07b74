"""Router overhead and throughput, side by side with other P/D proxies, on the same fakes.

One run measures, on the fake vLLM P/D engines of tests/fakes/engine.py (no model time,
16-token streamed chats; the decode fake publishes kvtier's params feed, as
``KVTierNixlConnector`` does), interleaved round by round so drift hits every target alike:

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
- ``vllm-router``: vLLM's Rust router (``vllm-router`` from PyPI, at its defaults,
  ``--vllm-pd-disaggregation``), from ``--vllm-router`` (default ``auto``: a venv of the
  benchmark's own under ``.kvtier/``, installed on first use; ``none``: skip);
- ``minimal``: unless ``--no-minimal``, a lean P->D proxy built into this file (aiohttp
  server and client, no validation/metrics/retries);

at each ``--concurrency``: p50/p99 latency, TTFT, req/s, errors, the proxy process's CPU per
request, and the legs the fakes' ledgers saw (``legs_ok``: one prefill and one decode leg per
answer, each decode given its own request's prefill params); overhead = target minus
``pd-client``. The order of the targets rotates from round to round. Then:

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
    .venv/bin/python benchmarks/bench_router.py --report FILE.json [...] \\
        [--md benchmarks/ROUTER.md]   # the tables and the targets, from the raw JSON

The load generators are in ``bench_router_load.py``, the processes (fake engines, proxies, the
lean proxy) in ``bench_router_fleet.py``; this file is the run and its report.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from bench_router_fleet import (
    DEFAULT_ANCHOR,
    Fleet,
    free_port,
    hiredis_state,
    legs_ok,
    proxies,
    serve_minimal_proxy,
    spawn,
    vllm_router_bin,
)
from bench_router_load import (
    CHAT,
    conversations,
    many_conversations,
    measured,
    rss_kib,
    stream_conversations,
)


def median_of(runs: list[dict]) -> dict:
    keys = ("rps", "p50_ms", "p99_ms", "ttft_p50_ms", "ttft_p99_ms", "cpu_ms_per_req")
    out = {k: round(statistics.median(r[k] for r in runs), 3) for k in keys
           if all(k in r for r in runs)}
    out["errors"] = sum(r["errors"] for r in runs)
    out["requests"] = sum(r["requests"] for r in runs)
    if all("legs_ok" in r for r in runs):
        out["legs_ok"] = all(r["legs_ok"] for r in runs)
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


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--duration", type=float, default=5.0, help="seconds per target and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", default="1,16,128")
    ap.add_argument("--proxy", action="append", default=[], metavar="NAME=COMMAND")
    ap.add_argument("--anchor", default=str(DEFAULT_ANCHOR),
                    help="vLLM's toy_proxy_server.py to run as target 'vllm-toy' ('none': "
                         "skip; a missing file is skipped)")
    ap.add_argument("--vllm-router", default="auto", metavar="PATH|auto|none",
                    help="vLLM's Rust router executable (auto: the benchmark's own venv under "
                         ".kvtier/, installed from PyPI when missing)")
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
    ap.add_argument("--report", nargs="+", metavar="JSON",
                    help="print the tables and targets of these runs (no measuring)")
    ap.add_argument("--md", default=None, metavar="FILE",
                    help="with --report: replace the generated block of FILE with them")
    a = ap.parse_args()
    if a.report:
        from bench_router_report import write_report
        return write_report(a.report, a.md)
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
                               "commit": _git_head(),
                               "engine_cpus": engine_cpus, "argv": sys.argv,
                               "anchor": a.anchor, "started": time.strftime(
                                   "%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                               "loadavg_start": os.getloadavg()}
    a.vllm_router_exe, results["vllm_router"] = vllm_router_bin(a.vllm_router,
                                                               tmp / "vllm-router-install.log")
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
        names = list(targets)
        for c in levels:
            per: dict[str, list[dict]] = {k: [] for k in targets}
            loads = []
            fleet.ledger.take()
            for i in range(a.rounds):
                # Rotated each round: no target always runs first (or right after another).
                for name in names[i % len(names):] + names[:i % len(names)]:
                    load0 = os.getloadavg()[0]
                    m = measured(targets[name], CHAT, c, a.duration, pids[name])
                    m["legs"] = fleet.ledger.take()
                    m["legs_ok"] = legs_ok(m["legs"], m["requests"], m["errors"])
                    m["loadavg_1m"] = [load0, os.getloadavg()[0]]
                    per[name].append(m)
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
            if a.out:  # a level at a time: a run cut short keeps what it measured
                Path(a.out).write_text(json.dumps(results, indent=2))
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


def _git_head() -> str:
    """The commit the run measured, ``+dirty`` when the router's files differ from it."""
    import subprocess
    root = Path(__file__).resolve().parent.parent
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, check=False,
                          capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "router"], cwd=root,
                           check=False).returncode
    if not dirty:
        return head
    # Which working tree: a digest of the router's sources as measured.
    import hashlib
    h = hashlib.sha256()
    for f in sorted((root / "router").glob("*.py")):
        h.update(f.name.encode() + f.read_bytes())
    return f"{head}+router-{h.hexdigest()[:10]}"


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
