"""One contract suite for every conversation store backend (memory, and Redis on a real
redis-server), then the router over Redis: two routers share a conversation, a restarted
router loses nothing, and a Redis outage serves without reuse (never a 5xx)."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from typing import Any

import httpx
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
