"""Faults under load: 128 streaming clients through a real ``kvtier router`` (a subprocess,
as users run it) in front of out-of-process fake engines (two prefills, two decodes with
params feeds, ``tests/fakes/engine.py``) and a real ``redis-server`` as the conversation
store, while, one case after another: a prefill is SIGKILLed, a decode is SIGKILLed, a
prefill and then a decode wedge (no answer to completions, ``/health`` still 200) and
recover, a decode's streams turn to garbage mid-stream, and Redis is SIGKILLed and
restarted. Between cases the fleet is made whole again (killed processes restarted on their
ports) and the router must see every instance healthy.

Per case, every answer is judged (``tests/load.py``): complete and exact, a client-visible
error (HTTP error or an error event), silently cut, wrong (garbage or other text), or hung.
Asserted in every case: none cut, wrong or hung, and every complete answer was served by
one decode leg (or one whole-answer leg) that got the params of a prefill leg of that same
request (the engines' ledgers). Asserted per case: the wedged engine is ejected by what the
router sees (``ejected: legs`` in ``/healthz``) while its ``/health`` answers, and taken back
once it answers again; the garbled streams reach clients as errors; the store is back once
Redis is. The table is printed and written as JSON into the test's tmp dir
(``benchmarks/ROUTER.md`` quotes a run).

Bounded: ~5 s of load per case (longer only while a fault is still waiting to show), about
a minute in all on 2 cores. The checks are on counts,
never on timings.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest

from kvtier.runtime import free_ports
from tests.fakes.engine import Leg, read_ledger
from tests.helpers import RedisServer, wait_until
from tests.load import Load, Tally

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
CLIENTS = 128
TOKENS = 16
TOKEN_DELAY_MS = 10  # a stream lasts ~0.16 s: a killed decode has streams in flight
LOAD_S = 5.0
LEG_TIMEOUT_S = 1.5  # the router's prefill / first-byte / tokenize timeouts here


@dataclass
class Engine:
    name: str
    role: str
    port: int
    ledger: Path
    feed: str | None = None
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, log: Path) -> None:
        argv = [PY, str(ROOT / "tests/fakes/engine.py"), "--port", str(self.port),
                "--tokens", str(TOKENS), "--token-delay-ms", str(TOKEN_DELAY_MS), "--name", self.name,
                "--ledger", str(self.ledger)]
        if self.feed:
            argv += ["--params-feed", self.feed]
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=out, start_new_session=True)

    def up(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)


@dataclass
class Fleet:
    engines: dict[str, Engine]
    redis: RedisServer
    router: subprocess.Popen[bytes]
    url: str
    logs: Path
    seen: list[dict[str, Any]] = field(default_factory=list)  # /healthz polls of a case

    def restart(self, name: str) -> None:
        e = self.engines[name]
        e.kill()
        e.start(self.logs / f"{name}.log")
        assert wait_until(e.up, timeout=20), f"{name} did not come back"

    def healthz(self) -> dict[str, Any]:
        r = httpx.get(self.url + "/healthz", timeout=5)
        out: dict[str, Any] = r.json()
        return out

    def whole(self) -> bool:
        """The router sees every instance and the store answering. Else one request goes
        through it: an instance ejected for its legs is only taken back by a leg (a probe)."""
        try:
            h = self.healthz()
            if (all(i["healthy"] for i in h["instances"].values())
                    and h["dependencies"]["store"]["ok"]):
                return True
            httpx.post(self.url + "/v1/completions", timeout=10, json={
                "model": "fake", "prompt": "probe", "max_tokens": 2,
                "conversation_id": "probe"})
        except httpx.HTTPError:
            pass
        return False

    def ledger(self) -> list[Leg]:
        return read_ledger(*(str(e.ledger) for e in self.engines.values()))


def _poll_healthz(fleet: Fleet, stop: asyncio.Event,
                  ) -> Callable[[], Coroutine[Any, Any, None]]:
    async def poll() -> None:
        async with aiohttp.ClientSession() as s:
            while not stop.is_set():
                try:
                    async with s.get(fleet.url + "/healthz") as r:
                        h = await r.json()
                    fleet.seen.append({"t": time.monotonic(), **h})
                except (aiohttp.ClientError, ValueError):
                    pass
                await asyncio.sleep(0.1)
    return poll


def _state(h: dict[str, Any], name: str) -> tuple[bool, str | None]:
    i = h["instances"][name]
    return i["healthy"], i["ejected"]


async def _until(pred: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        await asyncio.sleep(0.1)
    return False


async def _post_faults(url: str, body: dict[str, Any]) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s, s.post(url + "/fake/faults", json=body) as r:
        assert r.status == 200
        out: dict[str, Any] = await r.json()
        return out


# ---- the cases: each runs its fault while the load runs, and returns what it saw ----------
async def kill_engine(fleet: Fleet, name: str) -> dict[str, Any]:
    await asyncio.sleep(1.5)
    await asyncio.to_thread(fleet.engines[name].kill)
    return {}


async def stall_engine(fleet: Fleet, name: str) -> dict[str, Any]:
    """Wedge ``name`` while its /health answers, until the router ejects it; then let it
    recover and wait until the router takes it back."""
    url = fleet.engines[name].url
    await asyncio.sleep(1.0)
    await _post_faults(url, {"stall": True})
    t0 = time.monotonic()
    ejected = await _until(lambda: bool(fleet.seen) and _state(fleet.seen[-1], name)
                           == (False, "legs"), timeout=20)
    healthy_meanwhile = await asyncio.to_thread(fleet.engines[name].up)
    await asyncio.sleep(0.5)
    await _post_faults(url, {"stall": False})
    t1 = time.monotonic()
    back = await _until(lambda: _state(fleet.seen[-1], name) == (True, None), timeout=20)
    return {"ejected_by_legs": ejected, "health_200_while_wedged": healthy_meanwhile,
            "ejected_after_s": round(time.monotonic() - t0, 2) if ejected else None,
            "readmitted": back, "readmitted_after_s": round(time.monotonic() - t1, 2)}


async def garble_decode(fleet: Fleet, name: str) -> dict[str, Any]:
    """Up to 20 of ``name``'s answers turn to garbage, until a few did (once ejected, it only
    gets a probe leg a second: a count alone could outlast the case)."""
    url = fleet.engines[name].url
    await asyncio.sleep(1.0)
    await _post_faults(url, {"garbage": 20})
    left = 20
    deadline = time.monotonic() + 10
    while left > 16 and time.monotonic() < deadline:  # a few garbled, however slow the load
        await asyncio.sleep(0.2)
        left = (await _post_faults(url, {}))["garbage"]
    await asyncio.sleep(0.5)
    left = (await _post_faults(url, {}))["garbage"]
    await _post_faults(url, {"garbage": 0})
    return {"garbled": 20 - left}


async def redis_down(fleet: Fleet) -> dict[str, Any]:
    await asyncio.sleep(1.0)
    await asyncio.to_thread(fleet.redis.kill)
    down = await _until(lambda: not fleet.seen[-1]["dependencies"]["store"]["ok"], timeout=10)
    await asyncio.sleep(1.0)
    await asyncio.to_thread(fleet.redis.start)
    return {"store_down_seen": down}


Fault = Callable[[Fleet], Awaitable[dict[str, Any]]]
CASES: list[tuple[str, Fault, list[str]]] = [
    ("prefill killed", lambda f: kill_engine(f, "p0"), ["p0"]),
    ("decode killed", lambda f: kill_engine(f, "d0"), ["d0"]),
    ("prefill wedged, /health 200", lambda f: stall_engine(f, "p1"), []),
    ("decode wedged, /health 200", lambda f: stall_engine(f, "d1"), []),
    ("decode stream garbage", lambda f: garble_decode(f, "d0"), []),
    ("redis killed, restarted", redis_down, []),
]


def _legs_check(tally: Tally, legs: list[Leg]) -> dict[str, int]:
    """Per complete answer: one decode leg (or one whole-answer leg) that got this request's
    own prefill's params, and that prefill leg in a ledger."""
    answers: Counter[str] = Counter()
    mismatched: set[str] = set()
    prefilled: set[str] = set()
    for leg in legs:
        if leg.kind in ("D", "X"):
            answers[leg.rid] += 1
            if not leg.ok:
                mismatched.add(leg.rid)
        elif leg.kind == "P":
            prefilled.add(leg.rid)
    decoded = {leg.rid for leg in legs if leg.kind == "D"}
    bad = {"no_answering_leg": 0, "several_answering_legs": 0, "other_requests_prefill": 0,
           "decode_without_prefill": 0}
    bad["served_pd"] = sum(1 for rid in tally.ok_rids if rid in decoded)
    for rid in tally.ok_rids:
        n = answers[rid]
        if n == 0:
            bad["no_answering_leg"] += 1
        elif n > 1:
            bad["several_answering_legs"] += 1
        if rid in mismatched:
            bad["other_requests_prefill"] += 1
        if rid in decoded and rid not in prefilled:
            bad["decode_without_prefill"] += 1
    return bad


@pytest.fixture()
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    ports = free_ports(7)
    engines = {
        "p0": Engine("p0", "prefill", ports[0], tmp_path / "p0.ledger"),
        "p1": Engine("p1", "prefill", ports[1], tmp_path / "p1.ledger"),
        "d0": Engine("d0", "decode", ports[2], tmp_path / "d0.ledger",
                     feed=f"tcp://127.0.0.1:{ports[4]}"),
        "d1": Engine("d1", "decode", ports[3], tmp_path / "d1.ledger",
                     feed=f"tcp://127.0.0.1:{ports[5]}"),
    }
    (tmp_path / "redis").mkdir()
    redis = RedisServer(tmp_path / "redis")
    router: subprocess.Popen[bytes] | None = None
    try:
        for e in engines.values():
            e.start(tmp_path / f"{e.name}.log")
        cfg = {
            "instances": [{"name": e.name, "role": e.role, "url": e.url,
                           **({"params_feed": e.feed} if e.feed else {})}
                          for e in engines.values()],
            "port": ports[6], "store": redis.url, "log_requests": False,
            "health_interval_s": 0.5, "eject_after_failures": 2, "readmit_probe_s": 1.0,
            "timeouts": {"connect_s": 0.5, "prefill_s": LEG_TIMEOUT_S,
                         "decode_idle_s": LEG_TIMEOUT_S, "tokenize_s": LEG_TIMEOUT_S,
                         "health_s": 1.0},
        }
        (tmp_path / "router.json").write_text(json.dumps(cfg))
        with open(tmp_path / "router.log", "ab") as out:
            router = subprocess.Popen(
                [PY, "-m", "kvtier.cli", "router", "--config", str(tmp_path / "router.json")],
                stdout=out, stderr=out, start_new_session=True)
        f = Fleet(engines, redis, router, f"http://127.0.0.1:{ports[6]}", tmp_path)
        for e in engines.values():
            assert wait_until(e.up, timeout=30), f"{e.name} did not start"
        assert wait_until(f.whole, timeout=30, interval=0.2), "the router did not come up"
        yield f
    finally:
        if router is not None and router.poll() is None:
            os.killpg(router.pid, signal.SIGTERM)
            try:
                router.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(router.pid, signal.SIGKILL)
        for e in engines.values():
            e.kill()
        redis.kill()


async def _run_case(fleet: Fleet, fault: Fault) -> tuple[Tally, dict[str, Any]]:
    fleet.seen.clear()
    stop = asyncio.Event()
    poller = asyncio.create_task(_poll_healthz(fleet, stop)())
    # A request that takes a minute is a hang: the router's own worst case (every leg's
    # attempts timing out, then the params wait) is ~20 s, on a machine loaded many times over.
    load = Load(fleet.url, CLIENTS, TOKENS, timeout_s=60)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as s:
        while not fleet.seen:
            await asyncio.sleep(0.05)
        done = asyncio.ensure_future(fault(fleet))
        tally = await load.run(s, LOAD_S, also=done.done)
        seen = await done
    stop.set()
    await poller
    # What the load put on each engine: the most legs in flight the router reported.
    seen["in_flight_max"] = {n: max((h["instances"][n]["in_flight"] for h in fleet.seen),
                                    default=0) for n in fleet.engines}
    return tally, seen


def test_faults_under_load(fleet: Fleet, tmp_path: Path) -> None:
    rows: list[dict[str, Any]] = []
    for name, fault, restart in CASES:
        tally, seen = asyncio.run(_run_case(fleet, fault))
        assert fleet.router.poll() is None, "the router died"
        for engine in restart:
            fleet.restart(engine)
        back = wait_until(fleet.whole, timeout=20, interval=0.2)
        rows.append({"case": name, **tally.row(), **_legs_check(tally, fleet.ledger()),
                     "fleet_whole_after": back, **seen, "examples": tally.examples})
        assert back, f"{name}: the router did not see the fleet whole again: {fleet.healthz()}"
    (tmp_path / "faults_under_load.json").write_text(json.dumps(rows, indent=1))
    print(f"\nfaults under load: {CLIENTS} streams, {LOAD_S:.0f} s per case "
          f"(JSON: {tmp_path / 'faults_under_load.json'})")
    print(f"{'case':32} {'ok':>6} {'P/D':>6} {'error':>6} {'cut':>4} {'wrong':>5} {'hung':>4}"
          "  legs")
    for r in rows:
        legs = sum(r[k] for k in ("no_answering_leg", "several_answering_legs",
                                  "other_requests_prefill", "decode_without_prefill"))
        print(f"{r['case']:32} {r['ok']:>6} {r['served_pd']:>6} {r['error']:>6} {r['cut']:>4} "
              f"{r['wrong']:>5} {r['hung']:>4}  {'ok' if legs == 0 else legs}")
    for r in rows:
        case = r["case"]
        assert r["ok"] > 0, f"{case}: nothing answered: {r}"
        assert (r["cut"], r["wrong"], r["hung"]) == (0, 0, 0), f"{case}: {r}"
        assert (r["no_answering_leg"], r["several_answering_legs"], r["other_requests_prefill"],
                r["decode_without_prefill"]) == (0, 0, 0, 0), f"{case}: {r}"
        if "wedged" in case:
            assert r["health_200_while_wedged"], r
            assert r["ejected_by_legs"], f"{case}: not ejected while wedged: {r}"
            assert r["readmitted"], f"{case}: not taken back after it recovered: {r}"
        if "garbage" in case:
            assert r["garbled"] > 0 and r["error"] > 0, \
                f"{case}: no garbled stream reached a client as an error: {r}"
        if "redis" in case:
            assert r["store_down_seen"], r


# ---- the two router fixes this test found, one request at a time (in process) -------------
def _app(fake: Any, **cfg: Any) -> Any:
    from fastapi.testclient import TestClient

    from kvtier.router.app import create_app
    from kvtier.router.config import RouterConfig
    from tests.fakes.engine import BLOCK_SIZE, D_URL, P2_URL, P_URL

    config = RouterConfig.model_validate({
        "prefill": [P_URL, P2_URL], "decode": [D_URL], "log_json": False,
        "block_size": BLOCK_SIZE, "max_retries": 0, **cfg})
    return TestClient(create_app(config, transport=fake, health_checks=False))


def test_a_stream_whose_data_turns_to_cut_json_ends_with_an_error_event() -> None:
    """Not only bytes that are not SSE: a ``data:`` line that is not JSON is garbage too,
    and is not relayed."""
    from tests.fakes.engine import D_URL, FakeEngines

    fake = FakeEngines()
    fake.fail(D_URL, "bad_data")
    with _app(fake) as c:
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": list(range(1, 11)),
                                            "max_tokens": 3, "stream": True})
    ev = [e for e in r.content.split(b"\n\n") if e]
    assert r.status_code == 200 and ev[0].startswith(b'data: {"id":"x"')
    assert b"malformed" in ev[-2] and ev[-1] == b"data: [DONE]"
    assert b"choi\n" not in r.content


def test_a_refused_connection_lets_health_checks_take_back_a_legs_ejection() -> None:
    """Ejected for its legs (wedged), then refusing connections (killed): what answers on
    its address next is a new process, and a health check readmits it without a probe leg."""
    from kvtier.router.pool import Ejected
    from tests.fakes.engine import FakeEngines

    fake = FakeEngines()
    with _app(fake, eject_after_failures=1, readmit_probe_s=3600) as c:
        pool = c.app.state.router.pool
        p0 = pool.by_name["prefill-0"]
        pool.leg_failed(p0)
        assert p0.ejected == Ejected.LEGS
        asyncio.run(pool.check_all(httpx.AsyncClient(transport=fake), 1.0))
        assert not p0.healthy  # /health 200 does not take back a legs ejection
        pool.mark_failed(p0, hard=True)  # refused: the process is gone
        assert p0.ejected == Ejected.HEALTH
        asyncio.run(pool.check_all(httpx.AsyncClient(transport=fake), 1.0))
        assert p0.healthy and p0.ejected is None
