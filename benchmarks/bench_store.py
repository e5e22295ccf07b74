"""What the Redis conversation store adds to a named turn, beside the memory store, in one run.

    .venv/bin/python benchmarks/bench_store.py --out benchmarks/router-store-DATE.json
    .venv/bin/python benchmarks/bench_store.py --report benchmarks/router-store-DATE.json \
        --md benchmarks/ROUTER.md       # the table of benchmarks/ROUTER.md's Redis section

One fake P/D pair (``tests/fakes/engine.py``, the decode fake publishing kvtier's params feed),
one ``redis-server``, and ``kvtier router`` at its defaults twice, ``store: memory`` and
``store: redis://...``; ``--before REV`` adds the same two routers running the code of git
revision REV (``memory@REV``, ``redis@REV``, over the same Redis; its tree unpacked under
``--tmp``, nothing in the checkout changes). One client, named 2-turn ``/v1/completions`` conversations (every turn names its
``conversation_id``; the second turn's prompt is the first's plus its answer and one token),
non-streamed and streamed; per turn the time from send to the whole answer. The targets take
turns conversation by conversation (each sees the same machine; the order rotates by round),
rounds of ``--duration`` seconds per target. "Added" is a Redis
router's figure minus the memory router's of the same code, per round; the summary is the
median over rounds.
Every later turn must report reuse (``x-kvtier-reuse: dp_read``): a store that answered fast
by losing turns would show here. Router and Redis on ``--router-cpus``, the fakes and the
client on the others (``taskset``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_router import store_call_means  # noqa: E402
from bench_router_fleet import Fleet, free_port, spawn  # noqa: E402

TARGET_ADDED_P50_MS = 0.5  # issue 31: Redis store <= +0.5 ms per named turn at p50
MARK = "<!-- {}: begin -->", "<!-- {}: end -->"  # the block --md replaces, by --section


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))] if xs else float("nan")


async def conversations(urls: dict[str, str], stream: bool, duration: float,
                        tag: str) -> dict[str, dict[str, Any]]:
    """One client, named 2-turn conversations, the targets taking turns conversation by
    conversation (so each sees the same machine): per target, per-turn latency and the reuse
    of its later turns."""
    import aiohttp

    names = list(urls)
    first: dict[str, list[float]] = {k: [] for k in names}
    later: dict[str, list[float]] = {k: [] for k in names}
    reused = dict.fromkeys(names, 0)
    errors = dict.fromkeys(names, 0)
    stop = time.perf_counter() + duration * len(names)
    n = 0
    async with aiohttp.ClientSession() as s:
        while time.perf_counter() < stop:
            n += 1
            name = names[n % len(names)]
            prompt = [1000 + n % 30000, *range(39)]  # its own: no conversation continues another
            for turn in range(2):
                body: dict[str, Any] = {"model": "fake", "prompt": prompt, "max_tokens": 16,
                                        "conversation_id": f"{tag}-{n}", "stream": stream}
                t0 = time.perf_counter()
                async with s.post(urls[name], json=body) as r:
                    out = await r.read()
                    reuse = r.headers.get("x-kvtier-reuse", "")
                if r.status != 200 or (stream and b"[DONE]" not in out):
                    errors[name] += 1
                    break
                (first if turn == 0 else later)[name].append(time.perf_counter() - t0)
                if turn == 1:
                    reused[name] += reuse.startswith("dp_read")
                prompt = [*prompt, *range(100, 116), 7]  # the fakes' 16 answer ids
    res: dict[str, dict[str, Any]] = {}
    for k in names:
        both = first[k] + later[k]
        res[k] = {"turns": len(both), "errors": errors[k], "later_turns": len(later[k]),
                  "later_reused": reused[k],
                  **{f"{w}_p{q}_ms": round(pct(v, q) * 1e3, 3)
                     for w, v in (("all", both), ("first", first[k]), ("later", later[k]))
                     for q in (50, 99)}}
    return res


STORE_TURN = """
import asyncio, json, sys, time
from kvtier.ids import ConversationId, PodId
from kvtier.router.store import RetainedKV, open_store
from kvtier.transfer_params import NixlParams

url, n = sys.argv[1], int(sys.argv[2])
P = NixlParams(do_remote_decode=True, remote_block_ids=[[1, 2, 3]], remote_engine_id="D",
               remote_request_id="r", remote_host="10.0.0.1", remote_port=5600)

async def main():
    s = open_store(url, max_entries=100_000, max_bytes=1 << 28, block_size=32, ttl_s=60,
                   namespace="micro-" + str(time.time_ns()), timeout_s=2.0)
    put_soon = getattr(s, "put_soon", None)  # absent before the write after the answer
    first, later = [], []
    for i in range(n):
        conv, ids = ConversationId(f"c{i}"), [1000 + i, *range(39)]
        for turn, out in enumerate((first, later)):
            t0 = time.perf_counter()
            e, _ = await s.atake("", conv)
            if e is None:
                await s.afind("", ids)
            # the answer's retained turn: awaited by the old router, handed over by the new
            kept = RetainedKV.build(conv, "", PodId("d"), P, [*ids, *range(100, 116)],
                                    time.monotonic() + 60, len(ids))
            if put_soon is not None:
                put_soon(kept)
            else:
                await s.aput(kept)
            out.append(time.perf_counter() - t0)
            ids = [*ids, *range(100, 116), 7]
            await asyncio.sleep(0)  # the client's next request comes in on a later turn
    await s.aclose()
    print(json.dumps({"first": first, "later": later}))

asyncio.run(main())
"""


def store_turns(url: str, n: int, env: dict[str, str] | None, cpus: str | None) -> dict:
    """The store's own work on a named turn's critical path, in a process of its own (the code
    ``env`` selects): take; on a miss, find; then the retained turn handed to the store."""
    argv = [sys.executable, "-c", STORE_TURN, url, str(n)]
    if cpus and shutil.which("taskset"):
        argv = ["taskset", "-c", cpus, *argv]
    out = subprocess.run(argv, capture_output=True, text=True, check=True,
                         env={**os.environ, **(env or {})})
    got = json.loads(out.stdout.strip().splitlines()[-1])
    both = got["first"] + got["later"]
    return {f"{w}_p{q}_us": round(pct(v, q) * 1e6, 1)
            for w, v in (("all", both), ("first", got["first"]), ("later", got["later"]))
            for q in (50, 99)}


def before_tree(rev: str, tmp: Path) -> dict[str, str]:
    """The router code of ``rev`` as an importable ``kvtier`` package under ``tmp`` (git
    archive: the checkout is not touched); the env that makes a router process import it."""
    root = Path(__file__).resolve().parent.parent
    dest = tmp / f"before-{rev}"
    if not dest.exists():
        src = tmp / f"src-{rev}"
        src.mkdir(parents=True, exist_ok=True)
        tar = subprocess.run(["git", "-C", str(root), "archive", rev], check=True,
                             capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(src)], input=tar, check=True)
        shutil.copytree(src / "kvtier", dest / "kvtier")
        for sub in ("router", "indexer", "connectors"):
            shutil.copytree(src / sub, dest / "kvtier" / sub)
    # PYTHONSAFEPATH: `python -m` / `-c` would put the working directory (this checkout, whose
    # kvtier/ would win) first on sys.path.
    return {"PYTHONPATH": str(dest), "PYTHONSAFEPATH": "1"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--duration", type=float, default=5.0,
                    help="seconds per target and round (the targets interleaved)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--before", default=None, metavar="REV",
                    help="also run the router of git revision REV over Redis ('redis-REV')")
    ap.add_argument("--store-turns", type=int, default=2000, metavar="N",
                    help="also time the stores alone, in-process: N named 2-turn "
                         "conversations per store and round (0: skip)")
    ap.add_argument("--router-cpus", default="0")
    ap.add_argument("--out", default=None)
    ap.add_argument("--tmp", default="/tmp/kvtier-bench-store")
    ap.add_argument("--report", default=None, metavar="JSON", help="print the table of a run")
    ap.add_argument("--md", default=None, metavar="FILE",
                    help="with --report: replace the table between FILE's SECTION markers")
    ap.add_argument("--section", default="bench_store",
                    help="with --md: the marker name (<!-- SECTION: begin/end -->)")
    a = ap.parse_args()
    if a.report:
        return report(json.loads(Path(a.report).read_text()), a.report, a.md, a.section)
    ncpu = os.cpu_count() or 1
    rc = {int(x) for x in a.router_cpus.split(",")}
    others = ",".join(str(i) for i in range(ncpu) if i not in rc) or None
    if others:
        os.sched_setaffinity(0, {int(x) for x in others.split(",")})
    tmp = Path(a.tmp)
    tmp.mkdir(parents=True, exist_ok=True)
    fleet = Fleet(tmp, a.router_cpus, others)
    res: dict[str, Any] = {"argv": sys.argv, "cpus": ncpu, "router_cpus": a.router_cpus,
                           "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                                    capture_output=True, text=True,
                                                    check=False).stdout.strip(),
                           "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                           "loadavg_start": os.getloadavg()}
    try:
        p_url, d_inst = fleet.pair("")
        rport = free_port()
        fleet.procs.append(spawn([shutil.which("redis-server") or "redis-server", "--port",
                                  str(rport), "--bind", "127.0.0.1", "--save", "",
                                  "--appendonly", "no"], tmp / "redis.log", a.router_cpus))
        redis_url = f"redis://127.0.0.1:{rport}/0"
        time.sleep(0.5)
        routers = {"memory": fleet.kvtier("store-memory", p_url, d_inst)[1],
                   "redis": fleet.kvtier("store-redis", p_url, d_inst, store=redis_url,
                                         store_namespace="now")[1]}
        if a.before:  # named by its commit: HEAD moves on
            a.before = subprocess.run(["git", "rev-parse", "--short", a.before], check=True,
                                      capture_output=True, text=True).stdout.strip()
        env = before_tree(a.before, tmp) if a.before else None
        if a.before:
            routers[f"memory@{a.before}"] = fleet.kvtier("store-memory-before", p_url, d_inst,
                                                         env=env)[1]
            routers[f"redis@{a.before}"] = fleet.kvtier("store-redis-before", p_url, d_inst,
                                                        env=env, store=redis_url,
                                                        store_namespace="before")[1]
        names = list(routers)
        modes = {"non-streamed": False, "streamed": True}
        rounds: dict[str, dict[str, list[dict[str, Any]]]] = {
            m: {k: [] for k in names} for m in modes}
        for i in range(a.rounds):
            for mode, stream in modes.items():
                order = names[i % len(names):] + names[:i % len(names)]
                load0 = os.getloadavg()[0]
                got = asyncio.run(conversations(
                    {k: routers[k] + "/v1/completions" for k in order}, stream, a.duration,
                    f"{mode}-{i}"))
                for name, r in got.items():
                    r["loadavg_1m"] = [load0, os.getloadavg()[0]]
                    rounds[mode][name].append(r)
                    print(json.dumps({"round": i, "mode": mode, "target": name, **r}),
                          flush=True)
        res["store_call_mean_us"] = {k: store_call_means(u) for k, u in routers.items()
                                     if k.startswith("redis")}
        if a.store_turns:
            stores = {"memory": ("memory", None), "redis": (redis_url, None)}
            if a.before:
                stores |= {f"memory@{a.before}": ("memory", env),
                           f"redis@{a.before}": (redis_url, env)}
            micro: dict[str, list[dict[str, float]]] = {k: [] for k in stores}
            for i in range(a.rounds):
                order = list(stores)[i % len(stores):] + list(stores)[:i % len(stores)]
                for k in order:
                    micro[k].append(store_turns(stores[k][0], a.store_turns, stores[k][1],
                                                a.router_cpus))
            res["store_turns"] = {"rounds": micro, "median": {
                k: {m: round(statistics.median(r[m] for r in v), 1) for m in v[0]}
                for k, v in micro.items()}}
            print(json.dumps(res["store_turns"]["median"]), flush=True)
        res["rounds"] = rounds
        res["summary"] = summarize(rounds)
        res["loadavg_end"] = os.getloadavg()
    finally:
        fleet.close()
    text = json.dumps(res, indent=1)
    if a.out:
        Path(a.out).write_text(text + "\n")
    print(json.dumps(res["summary"], indent=1))
    return 0


def summarize(rounds: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    """Per mode and target: medians over rounds; for each Redis target its per-round added
    latency over the memory router (p50 and p99 of all named turns), and their medians."""
    out: dict[str, Any] = {}
    for mode, per in rounds.items():
        m: dict[str, Any] = {}
        for name, rs in per.items():
            row: dict[str, Any] = {
                k: round(statistics.median(r[k] for r in rs), 3)
                for k in rs[0] if k.endswith("_ms")}
            row.update(turns=sum(r["turns"] for r in rs), errors=sum(r["errors"] for r in rs),
                       later_turns=sum(r["later_turns"] for r in rs),
                       later_reused=sum(r["later_reused"] for r in rs))
            if name.startswith("redis"):
                mem = per[name.replace("redis", "memory", 1)]  # the same code's memory router
                for q in (50, 99):
                    diffs = [round(r[f"all_p{q}_ms"] - b[f"all_p{q}_ms"], 3)
                             for r, b in zip(rs, mem, strict=True)]
                    row[f"added_p{q}_ms_rounds"] = diffs
                    row[f"added_p{q}_ms"] = round(statistics.median(diffs), 3)
                for w in ("first", "later"):
                    row[f"added_{w}_p50_ms"] = round(statistics.median(
                        r[f"{w}_p50_ms"] - b[f"{w}_p50_ms"] for r, b in zip(rs, mem, strict=True)), 3)
                row["target_added_p50_ms"] = TARGET_ADDED_P50_MS
                row["met"] = row["added_p50_ms"] <= TARGET_ADDED_P50_MS
            m[name] = row
        out[mode] = m
    return out


def report(res: dict[str, Any], path: str, md: str | None, section: str = "bench_store") -> int:
    s = summarize(res["rounds"])  # from the raw rounds: the summary's figures and any added
    revs = sorted({n.split("@", 1)[1] for per in s.values() for n in per if "@" in n})
    # A run's ``--before HEAD`` (older runs kept the name) is the commit it started from.
    before = "".join(f"; `@{r}`: the router code of "
                     f"{res.get('commit', '?') if r == 'HEAD' else r}, same run" for r in revs)
    lines = [f"`{path}` (commit {res.get('commit', '?')}, started {res.get('started', '?')}, "
             f"load average {res['loadavg_start'][0]:.1f} at the start, "
             f"{res['loadavg_end'][0]:.1f} at the end{before}):", "",
             "| turns | store | p50 ms | p99 ms | added p50 ms | added p99 ms | "
             "added p50 per round | added p50, first / later turns | later turns reused | "
             "errors | target +0.5 ms p50 |",
             "|---|---|--:|--:|--:|--:|---|--:|--:|--:|---|"]
    for mode, per in s.items():
        for name, row in per.items():
            added = (f"**{row['added_p50_ms']:+.3f}**", f"{row['added_p99_ms']:+.3f}",
                     " / ".join(f"{d:+.2f}" for d in row["added_p50_ms_rounds"]),
                     f"{row['added_first_p50_ms']:+.3f} / {row['added_later_p50_ms']:+.3f}",
                     "met" if row["met"] else "missed") if name.startswith("redis") else \
                ("-", "-", "-", "-", "-")
            lines.append(f"| {mode} | {name} | {row['all_p50_ms']:.3f} | "
                         f"{row['all_p99_ms']:.3f} | {added[0]} | {added[1]} | {added[2]} | "
                         f"{added[3]} | {row['later_reused']} / {row['later_turns']} | "
                         f"{row['errors']} | {added[4]} |")
    micro = res.get("store_turns", {}).get("median", {})
    if micro:
        lines += ["", "The stores alone (in-process, one named 2-turn conversation after another: "
                  "take, on a miss find, then the retained turn handed over; medians of rounds), "
                  "us per turn:", "",
                  "| store | p50 | p99 | first turn p50 | later turn p50 |", "|---|--:|--:|--:|--:|"]
        lines += [f"| {k} | {v['all_p50_us']} | {v['all_p99_us']} | {v['first_p50_us']} | "
                  f"{v['later_p50_us']} |" for k, v in micro.items()]
    calls = res.get("store_call_mean_us", {})
    if calls:
        lines += ["", "The routers' own mean store call, us (`kvtier_router_store_latency_"
                  "seconds`; a put is timed from its send to its reply, after the answer): " +
                  "; ".join(f"{k}: " + ", ".join(f"{op} {v}" for op, v in sorted(c.items()))
                            for k, c in calls.items()) + "."]
    table = "\n".join(lines)
    print(table)
    if md:
        f = Path(md)
        text = f.read_text()
        BEGIN, END = (m.format(section) for m in MARK)
        if BEGIN not in text or END not in text:
            print(f"{md} has no {BEGIN} ... {END} block", file=sys.stderr)
            return 1
        head, rest = text.split(BEGIN, 1)
        f.write_text(head + BEGIN + "\n" + table + "\n" + END + rest.split(END, 1)[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
