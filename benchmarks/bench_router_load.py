"""The load generators of ``benchmarks/bench_router.py`` (not run on their own).

Closed-loop chat load (``load``; client-orchestrated P->D when given a (prefill, decode)
pair), one client's named conversations (``conversations``), streamed multi-turn
conversations (``stream_conversations``), many concurrent conversations
(``many_conversations``), and what they measure a process by (``cpu_seconds``,
``rss_kib``). aiohttp on the client side: cheaper per request than httpx.

Threading model: each generator runs in its own ``asyncio.run``; nothing is shared.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

CHAT = {"model": "fake", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 16,
        "stream": True}
CONTENT = b"tok "  # every content chunk of the fakes carries it (role-only chunks do not)
GEN = list(range(100, 116))  # the ids the fakes generate (16 tokens)


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


def ms(v: float) -> float:
    """Seconds to milliseconds, to the microsecond."""
    return round(v * 1e3, 3)


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
