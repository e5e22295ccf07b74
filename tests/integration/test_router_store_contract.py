"""One contract suite for every conversation store backend (memory, and Redis on a real
redis-server), then the router over Redis: two routers share a conversation, a restarted
router loses nothing, and a Redis outage serves without reuse (never a 5xx)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
import uuid
from typing import Any

import httpx
import numpy as np
import pytest

from kvtier.ids import ConversationId, PodId
from kvtier.router.config import RouterConfig
from kvtier.router.server import RouterServer
from kvtier.router.store import ConversationBackend, RetainedKV, open_store
from kvtier.runtime import free_ports
from kvtier.transfer_params import NixlParams
from tests.fakes.engine import BLOCK_SIZE, D_URL, GEN, P_URL, FakeEngines
from tests.helpers import RedisServer

pytestmark = pytest.mark.integration

BS = 4
PARAMS = NixlParams(do_remote_decode=True, remote_block_ids=[[1, 2, 3]], remote_engine_id="D",
                    remote_request_id="r", remote_host="10.0.0.1", remote_port=5600,
                    remote_num_tokens=12)


def dead_redis() -> str:
    return f"redis://127.0.0.1:{free_ports(1)[0]}/0"


def make_store(url: str, ns: str, ttl_s: float = 60) -> ConversationBackend:
    return open_store(url, max_entries=1000, max_bytes=1 << 24, block_size=BS, ttl_s=ttl_s,
                      namespace=ns, timeout_s=5.0)


@pytest.fixture(params=["memory", "redis"])
def backend(request: pytest.FixtureRequest) -> str:
    return "memory" if request.param == "memory" else request.getfixturevalue("redis_url")


def entry(conv: str, tokens: list[int], tenant: str = "", pod: str = "decode-0",
          ttl_s: float = 60, prompt_len: int = 0) -> RetainedKV:
    return RetainedKV.build(ConversationId(conv), tenant, PodId(pod), PARAMS, tokens,
                            time.monotonic() + ttl_s, prompt_len)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


# ---- the contract ------------------------------------------------------------------------
def test_take_is_single_use_and_round_trips(backend: str) -> None:
    async def go() -> None:
        s = make_store(backend, uuid.uuid4().hex)
        e = entry("c1", list(range(1, 13)), prompt_len=8)
        assert await s.aput(e)
        got, expired = await s.atake("", ConversationId("c1"))
        assert got is not None and not expired
        assert got.params == e.params and got.decode_pod == e.decode_pod
        assert list(got.covered) == list(e.covered) and got.digest == e.digest
        assert got.prompt_len == 8 and got.expires_at > time.monotonic()
        assert await s.atake("", ConversationId("c1")) == (None, False)
        await s.aclose()
    run(go())


def test_tenants_are_scoped(backend: str) -> None:
    async def go() -> None:
        s = make_store(backend, uuid.uuid4().hex)
        await s.aput(entry("c", list(range(12)), tenant="a"))
        assert await s.atake("b", ConversationId("c")) == (None, False)
        assert await s.afind("b", list(range(16))) is None
        assert (await s.atake("a", ConversationId("c")))[0] is not None
        await s.aclose()
    run(go())


def test_entries_expire_and_a_take_says_so(backend: str) -> None:
    async def go() -> None:
        s = make_store(backend, uuid.uuid4().hex)
        await s.aput(entry("c", list(range(12)), ttl_s=0.2))
        await s.aput(entry("live", list(range(12))))
        await asyncio.sleep(0.5)
        assert await s.atake("", ConversationId("c")) == (None, True)
        assert await s.atake("", ConversationId("c")) == (None, False)  # said once
        assert (await s.astats()).entries == 1
        await s.aclose()
    run(go())


def test_find_names_the_conversation_a_prompt_continues(backend: str) -> None:
    async def go() -> None:
        s = make_store(backend, uuid.uuid4().hex)
        system = [7] * 8
        await s.aput(entry("a", [*system, 1, 1, 1, 1, 50, 51], prompt_len=12))
        await s.aput(entry("b", [*system, 2, 2, 2, 2, 60, 61], prompt_len=12))
        assert await s.afind("", [*system, 2, 2, 2, 2, 60, 61, 9, 9, 9]) == "b"
        assert await s.afind("", [*system, 1, 1, 1, 1, 50, 99, 9, 9]) == "a"
        # Shares only the system prompt with both: continues neither.
        assert await s.afind("", [*system, 3, 3, 3, 3, 9, 9]) is None
        assert await s.afind("", [1, 2]) is None  # not one whole block
        await s.atake("", ConversationId("b"))
        assert await s.afind("", [*system, 2, 2, 2, 2, 60, 61, 9, 9, 9]) is None
        await s.aclose()
    run(go())


def test_discard_pod_forgets_its_entries(backend: str) -> None:
    async def go() -> None:
        s = make_store(backend, uuid.uuid4().hex)
        await s.aput(entry("x", list(range(12)), pod="decode-0"))
        await s.aput(entry("y", list(range(12)), pod="decode-1"))
        assert await s.adiscard_pod(PodId("decode-0")) == 1
        assert await s.atake("", ConversationId("x")) == (None, False)
        assert (await s.atake("", ConversationId("y")))[0] is not None
        await s.aclose()
    run(go())


def test_a_put_replaces_the_older_entry(backend: str) -> None:
    async def go() -> None:
        s = make_store(backend, uuid.uuid4().hex)
        await s.aput(entry("c", list(range(12))))
        await s.aput(entry("c", list(range(20)), pod="decode-1"))
        got, _ = await s.atake("", ConversationId("c"))
        assert got is not None and got.decode_pod == "decode-1" and len(got.covered) == 12
        assert (await s.astats()).entries == 0
        await s.aclose()
    run(go())


def test_concurrent_takes_hand_an_entry_out_once(backend: str) -> None:
    """Replicas (Redis: separate clients) racing for one conversation's KV: one wins."""
    async def go() -> None:
        ns = uuid.uuid4().hex
        first = make_store(backend, ns)
        stores = [first] if backend == "memory" else [make_store(backend, ns) for _ in range(4)]
        for i in range(20):
            await first.aput(entry(f"c{i}", list(range(12))))
        takes = [s.atake("", ConversationId(f"c{i}")) for i in range(20)
                 for s in stores for _ in range(3)]
        got = await asyncio.gather(*takes)
        winners = [e.conversation for e, _ in got if e is not None]
        assert sorted(winners) == sorted(f"c{i}" for i in range(20))
        for s in {id(x): x for x in [first, *stores]}.values():
            await s.aclose()
    run(go())


def test_a_closed_store_leaves_no_sockets_open(backend: str) -> None:
    """Closing a store closes every connection it made (a Redis pool handed to the client is
    not closed with it by default: 60 concurrent takes left 60 sockets open per store)."""
    def sockets() -> int:
        fds = os.listdir("/proc/self/fd")
        return sum(1 for fd in fds if _readlink(f"/proc/self/fd/{fd}").startswith("socket:"))

    async def go() -> None:
        before = sockets()
        s = make_store(backend, uuid.uuid4().hex)
        await s.aput(entry("c", list(range(12))))
        await asyncio.gather(*(s.atake("", ConversationId("c")) for _ in range(30)))
        await s.aclose()
        assert sockets() <= before, f"{sockets() - before} sockets left open"
    run(go())


def _readlink(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:  # closed between listing and reading
        return ""


def test_a_long_conversation_round_trips(backend: str) -> None:
    """100k tokens (400 KB of ids: many socket reads per reply), by take and by find."""
    async def go() -> None:
        s = make_store(backend, uuid.uuid4().hex)
        ids = [i % 50_000 for i in range(100_000)]
        long = PARAMS.model_copy(update={"remote_num_tokens": len(ids)})

        def big(conv: str) -> RetainedKV:
            return RetainedKV.build(ConversationId(conv), "", PodId("decode-0"), long, ids,
                                    time.monotonic() + 60, len(ids) - 16)
        assert await s.aput(big("a"))
        assert s.put_soon(big("b"))
        assert await s.afind("", [*ids, 1, 2, 3]) in ("a", "b")
        for conv in ("a", "b"):
            got, _ = await s.atake("", ConversationId(conv))
            assert got is not None and np.array_equal(got.covered, np.asarray(ids))
        await s.aclose()
    run(go())


# ---- the write after the answer ------------------------------------------------------------
def test_a_write_not_awaited_is_read_by_the_next_lookup(backend: str) -> None:
    """``put_soon`` returns before the write is done; the same store's next take and find
    still see it (the connection keeps the order)."""
    async def go() -> None:
        s = make_store(backend, uuid.uuid4().hex)
        await s.astats()  # connected: a write goes on the socket at once
        for i in range(20):
            assert s.put_soon(entry(f"c{i}", list(range(i, i + 12)), prompt_len=8))
        for i in range(0, 20, 2):
            got, _ = await s.atake("", ConversationId(f"c{i}"))
            assert got is not None and list(got.covered) == list(range(i, i + 12))
        assert await s.afind("", [*range(1, 13), 9, 9, 9, 9]) == "c1"
        # Not connected yet (a fresh store): the write waits for the connection, the take
        # for the write.
        s2 = make_store(backend, uuid.uuid4().hex)
        assert s2.put_soon(entry("x", list(range(12))))
        assert (await s2.atake("", ConversationId("x")))[0] is not None
        await s.aclose()
        await s2.aclose()
    run(go())


def test_close_waits_for_the_writes_under_way(redis_url: str) -> None:
    """(Redis only: the memory store dies with its process.)"""
    async def go() -> None:
        ns = uuid.uuid4().hex
        s = make_store(redis_url, ns)
        for i in range(50):
            assert s.put_soon(entry(f"c{i}", list(range(12))))
        await s.aclose()
        again = make_store(redis_url, ns)
        assert all([(await again.atake("", ConversationId(f"c{i}")))[0] is not None
                    for i in range(50)])
        await again.aclose()
    run(go())


def test_a_write_that_fails_after_the_answer_is_counted_logged_and_evicted(
        tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    """Redis stops answering (SIGSTOP) after the router handed a write over: ``put_soon`` has
    returned at once; the write fails at the store's timeout, counted as a failed put, logged,
    and its entry handed to ``on_evict`` (which releases the decode lease)."""
    srv = RedisServer(tmp_path)
    calls: list[tuple[str, float | None]] = []
    evicted: list[RetainedKV] = []
    assert srv.proc is not None

    async def go() -> None:
        s = open_store(srv.url, max_entries=10, max_bytes=1 << 20, block_size=BS, ttl_s=60,
                       namespace="t", timeout_s=0.3,
                       on_call=lambda op, sec: calls.append((op, sec)),
                       on_evict=evicted.append)
        assert s.put_soon(entry("ok", list(range(12))))
        assert (await s.atake("", ConversationId("ok")))[0] is not None
        os.kill(srv.proc.pid, signal.SIGSTOP)
        try:
            e = entry("lost", list(range(12)))
            t0 = time.monotonic()
            assert s.put_soon(e)
            assert time.monotonic() - t0 < 0.05  # nothing waited for Redis
            await asyncio.sleep(0.6)
            assert [x.conversation for x in evicted] == ["lost"]
            assert ("put", None) in calls and not s.ok
            assert not s.put_soon(entry("later", list(range(12))))  # known down: refused
        finally:
            os.kill(srv.proc.pid, signal.SIGCONT)
        await s.aclose()
    try:
        with caplog.at_level(logging.WARNING, logger="kvtier.router"):
            run(go())
    finally:
        srv.kill()
    assert any("write of lost lost" in r.getMessage() for r in caplog.records)


# ---- the local copies: another replica's newer write always wins --------------------------
def test_a_newer_write_by_another_replica_wins_over_the_local_copy(redis_url: str) -> None:
    async def go() -> None:
        ns = uuid.uuid4().hex
        a, b = make_store(redis_url, ns), make_store(redis_url, ns)
        # A wrote (and keeps a copy); B wrote the conversation's next turn since.
        assert await a.aput(entry("c", list(range(12)), pod="decode-0"))
        assert await b.aput(entry("c", list(range(100, 116)), pod="decode-1"))
        got, _ = await a.atake("", ConversationId("c"))
        assert got is not None and got.decode_pod == "decode-1"
        assert list(got.covered) == list(range(100, 112))
        # Taken by B: A's copy is never handed out.
        assert a.put_soon(entry("d", list(range(12))))
        assert (await b.atake("", ConversationId("d")))[0] is not None
        assert await a.atake("", ConversationId("d")) == (None, False)
        # A's find proves against B's entry, not its copy: the copy's prompt would match.
        await a.aput(entry("f", [*range(8), 1, 1, 1, 1, 50], prompt_len=12))
        await b.aput(entry("f", [*range(8), 2, 2, 2, 2, 60], prompt_len=12))
        assert await a.afind("", [*range(8), 1, 1, 1, 1, 50, 9, 9, 9]) is None
        assert await a.afind("", [*range(8), 2, 2, 2, 2, 60, 9, 9, 9]) == "f"
        got, _ = await a.atake("", ConversationId("f"))
        assert got is not None and list(got.covered)[8:12] == [2, 2, 2, 2]
        await a.aclose()
        await b.aclose()
    run(go())


def test_the_local_copy_is_the_entry_when_redis_confirms_it(redis_url: str) -> None:
    """A take answered "same version" (no value sent) hands out the copy: equal to what was
    stored, with Redis's remaining TTL; a copy from another replica's find serves the take."""
    async def go() -> None:
        ns = uuid.uuid4().hex
        a, b = make_store(redis_url, ns), make_store(redis_url, ns)
        e = entry("c", list(range(1, 13)), prompt_len=8, ttl_s=30)
        assert a.put_soon(e)
        got, expired = await a.atake("", ConversationId("c"))
        assert got is not None and not expired
        assert (got.params, got.decode_pod, got.digest, got.prompt_len) == \
            (e.params, e.decode_pod, e.digest, e.prompt_len)
        assert list(got.covered) == list(e.covered)
        assert 25 < got.expires_at - time.monotonic() <= 30
        await a.aput(entry("g", [*range(8), 3, 3, 3, 3, 70], prompt_len=12))
        assert await b.afind("", [*range(8), 3, 3, 3, 3, 70, 9]) == "g"
        got, _ = await b.atake("", ConversationId("g"))
        assert got is not None and list(got.covered)[8:12] == [3, 3, 3, 3]
        assert await a.atake("", ConversationId("g")) == (None, False)
        await a.aclose()
        await b.aclose()
    run(go())


# ---- Redis outage ------------------------------------------------------------------------
def test_an_unreachable_redis_answers_nothing_and_never_raises() -> None:
    calls: list[tuple[str, float | None]] = []

    async def go() -> None:
        s = open_store(dead_redis(), max_entries=10, max_bytes=1 << 20, block_size=BS,
                       ttl_s=60, namespace="t", timeout_s=0.2,
                       on_call=lambda op, sec: calls.append((op, sec)))
        assert s.ok
        assert await s.aput(entry("c", list(range(12)))) is False
        assert not s.ok and s.error
        assert await s.atake("", ConversationId("c")) == (None, False)
        assert await s.afind("", list(range(16))) is None
        assert await s.adiscard_pod(PodId("d")) == 0
        assert (await s.astats()).entries == 0
        await s.aclose()
    run(go())
    assert calls and all(sec is None for _, sec in calls)


# ---- routers over Redis ------------------------------------------------------------------
def router_cfg(store: str, **kw: Any) -> RouterConfig:
    return RouterConfig.model_validate({
        "prefill": [P_URL], "decode": [D_URL], "port": 0, "log_json": False,
        "block_size": BLOCK_SIZE, "store": store, "store_namespace": kw.pop("ns", "r"),
        **kw})


PROMPT = list(range(1, 11))


def turn(url: str, prompt: list[int], conv: str | None = "c") -> httpx.Response:
    body: dict[str, Any] = {"model": "tiny", "prompt": prompt, "max_tokens": 3}
    if conv:
        body["conversation_id"] = conv
    return httpx.post(url + "/v1/completions", json=body, timeout=30)


@pytest.mark.parametrize("named", [True, False])
def test_two_routers_share_a_conversation(redis_url: str, named: bool) -> None:
    ns = uuid.uuid4().hex
    fake = FakeEngines()
    conv = "shared" if named else None
    with RouterServer(router_cfg(redis_url, ns=ns), transport=fake,
                      health_checks=False) as a, \
            RouterServer(router_cfg(redis_url, ns=ns), transport=fake,
                         health_checks=False) as b:
        assert turn(a.url, PROMPT, conv).headers["x-kvtier-reuse"] == "none; tokens=0"
        r2 = turn(b.url, [*PROMPT, *GEN, 7], conv)
        assert r2.status_code == 200
        assert r2.headers["x-kvtier-reuse"] == f"dp_read; tokens={len(PROMPT) + 2}"
        # Turn 3 back on A reads what B's turn 2 left on the decode node.
        p2 = [*PROMPT, *GEN, 7]
        r3 = turn(a.url, [*p2, *GEN, 8], conv)
        assert r3.headers["x-kvtier-reuse"] == f"dp_read; tokens={len(p2) + 2}"
        text = httpx.get(b.url + "/metrics").text
    assert 'kvtier_router_store_backend{backend="redis"} 1.0' in text
    assert 'kvtier_router_store_lookups_total{result="hit"' in text
    assert 'kvtier_router_store_latency_seconds_count{op="take"}' in text


def test_a_restarted_router_loses_nothing(redis_url: str) -> None:
    ns = uuid.uuid4().hex
    fake = FakeEngines()
    with RouterServer(router_cfg(redis_url, ns=ns), transport=fake,
                      health_checks=False) as a:
        assert turn(a.url, PROMPT).status_code == 200
    with RouterServer(router_cfg(redis_url, ns=ns), transport=fake,
                      health_checks=False) as again:
        r = turn(again.url, [*PROMPT, *GEN, 7])
        assert r.headers["x-kvtier-reuse"] == f"dp_read; tokens={len(PROMPT) + 2}"


def test_redis_down_serves_without_reuse_and_healthz_says_so() -> None:
    fake = FakeEngines()
    with RouterServer(router_cfg(dead_redis(), timeouts={"store_s": 0.2}), transport=fake,
                      health_checks=False) as srv:
        for prompt in (PROMPT, [*PROMPT, *GEN, 7]):
            r = turn(srv.url, prompt)
            assert r.status_code == 200 and r.headers["x-kvtier-reuse"] == "none; tokens=0"
        for prompt in (PROMPT, [*PROMPT, *GEN, 7]):  # unnamed: implicit sessions too
            assert turn(srv.url, prompt, conv=None).status_code == 200
        h = httpx.get(srv.url + "/healthz")
        text = httpx.get(srv.url + "/metrics").text
    assert h.status_code == 200  # serving: decode is up
    assert h.json()["down"] == ["store"] and h.json()["dependencies"]["store"]["ok"] is False
    assert "kvtier_router_store_errors_total" in text
    assert "kvtier_router_store_up 0.0" in text
    assert 'kvtier_router_store_lookups_total{result="unavailable",session="named"}' in text


def test_workers_need_a_shared_store() -> None:
    with pytest.raises(ValueError, match="shared store"):
        RouterConfig.model_validate({"decode": [D_URL], "workers": 2})
    assert RouterConfig.model_validate({"decode": [D_URL], "workers": 2,
                                        "store": "redis://127.0.0.1:1/0"}).workers == 2


def test_redis_dying_between_turns_degrades_then_recovers(tmp_path: Any) -> None:
    """Redis killed under a running router: turns are served without reuse (never a 5xx),
    /healthz names the store; Redis back: reuse resumes without a router restart."""
    redis_srv = RedisServer(tmp_path)
    fake = FakeEngines()
    try:
        with RouterServer(router_cfg(redis_srv.url, timeouts={"store_s": 0.3}),
                          transport=fake, health_checks=False) as srv:
            assert turn(srv.url, PROMPT).status_code == 200
            redis_srv.kill()
            r = turn(srv.url, [*PROMPT, *GEN, 7])
            assert r.status_code == 200 and r.headers["x-kvtier-reuse"] == "none; tokens=0"
            assert httpx.get(srv.url + "/healthz").json()["down"] == ["store"]
            redis_srv.start()
            # Back after the store's retry window: a fresh conversation keeps its KV again.
            reuse = ""
            for i in range(100):
                first = turn(srv.url, PROMPT, conv=f"again-{i}")
                assert first.status_code == 200
                r = turn(srv.url, [*PROMPT, *GEN, 7], conv=f"again-{i}")
                reuse = r.headers["x-kvtier-reuse"]
                if reuse.startswith("dp_read"):
                    break
                time.sleep(0.1)
            assert reuse == f"dp_read; tokens={len(PROMPT) + 2}"
            h = httpx.get(srv.url + "/healthz").json()
            assert h["down"] == [] and h["dependencies"]["store"]["ok"] is True
    finally:
        redis_srv.kill()
