"""An entry the store lets go untaken releases its decode lease (router/store.py ``on_evict``,
router/retention.py ``evicted``).

First the store alone: which departures it reports (cap, bytes, expiry, a newer turn stored
over it) and which it does not (a take, a dead pod's discard, the same turn stored again).
Then the router against a real lease server, as in test_router_retention.py: the decode node
is ``FakeEngines`` (each decode answer given an engine request id of its own here) and a
``LeaseServer`` over an in-process ``LeaseTable``.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from kvtier.ids import ConversationId, PodId
from kvtier.router.app import create_app
from kvtier.router.config import RouterConfig
from kvtier.router.flow import Router
from kvtier.router.store import ConversationStore, RetainedKV
from kvtier.tier.leases import LeaseServer, LeaseTable
from kvtier.transfer_params import NixlParams
from tests.fakes.engine import BLOCK_SIZE, D_URL, GEN, P_URL, FakeEngines
from tests.helpers import wait_until

BS = 4
IDS = list(range(1, 18))


def entry(conv: str, rid: str, ids: list[int] = IDS, expires: float = 1e18,
          pod: str = "decode-0") -> RetainedKV:
    nblocks = -(-len(ids) // BS)
    params = NixlParams(do_remote_decode=True, remote_block_ids=[list(range(nblocks))],
                        remote_engine_id="d0", remote_request_id=rid,
                        remote_host="127.0.0.1", remote_port=5600, remote_num_tokens=len(ids))
    return RetainedKV.build(ConversationId(conv), "", PodId(pod), params, ids, expires)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def store(max_entries: int = 10, max_bytes: int = 1 << 20,
          clock: Clock | None = None) -> tuple[ConversationStore, list[str]]:
    gone: list[str] = []
    s = ConversationStore(max_entries, max_bytes, clock=clock or Clock(), block_size=BS,
                          on_evict=lambda e: gone.append(str(e.params.remote_request_id)))
    return s, gone


def test_the_entry_cap_reports_what_it_pushes_out() -> None:
    s, gone = store(max_entries=2)
    for i in range(4):
        assert s.put(entry(f"c{i}", f"r{i}"))
    assert gone == ["r0", "r1"] and s.evicted == 2


def test_the_byte_cap_reports_what_it_pushes_out() -> None:
    one = entry("c0", "r0").nbytes
    s, gone = store(max_bytes=2 * one)
    for i in range(3):
        assert s.put(entry(f"c{i}", f"r{i}"))
    assert gone == ["r0"]


def test_expiry_reports_the_entry_whichever_call_purges_it() -> None:
    clock = Clock()
    s, gone = store(clock=clock)
    s.put(entry("c0", "r0", expires=5.0))
    s.put(entry("c1", "r1", expires=50.0))
    clock.t = 10.0
    assert len(s) == 1  # the gauges' read purges it
    assert gone == ["r0"]
    assert s.take("", ConversationId("c0")) == (None, True)  # and the client still hears it


def test_a_newer_turn_stored_over_an_untaken_one_reports_the_old_one() -> None:
    s, gone = store()
    s.put(entry("c0", "r0"))
    s.put(entry("c0", "r0"))  # the same turn stored again: nothing left untaken
    assert gone == []
    s.put(entry("c0", "r1"))
    assert gone == ["r0"]


def test_a_take_or_a_dead_pods_discard_is_not_an_eviction() -> None:
    s, gone = store()
    s.put(entry("c0", "r0"))
    s.put(entry("c1", "r1", pod="decode-1"))
    assert s.take("", ConversationId("c0"))[0] is not None
    assert s.discard_pod(PodId("decode-1")) == 1
    assert gone == []


# ---- the router, with a real lease server ----------------------------------------------
PROMPT = list(range(1, 11))


@pytest.fixture()
def node() -> Iterator[tuple[LeaseTable, LeaseServer]]:
    table = LeaseTable(30.0)
    server = LeaseServer(table, "tcp://127.0.0.1:*")
    yield table, server
    server.close()


def make(endpoint: str, **cfg: Any) -> Iterator[tuple[TestClient, list[str], Router]]:
    """A router whose decode node names each turn's blocks with a fresh request id (the ids
    it answered, in order, are the list)."""
    fake = FakeEngines()
    rids: list[str] = []
    numbers = itertools.count(1)
    plain = fake.handle_async_request
    d_host = httpx.URL(D_URL).host

    async def handle(request: httpx.Request) -> httpx.Response:
        resp = await plain(request)
        if request.url.host != d_host or not request.url.path.endswith("completions"):
            return resp
        body = json.loads(await resp.aread())
        kvp = body.get("kv_transfer_params")
        if kvp and kvp.get("remote_request_id"):
            kvp["remote_request_id"] = f"D-{next(numbers)}"
            rids.append(kvp["remote_request_id"])
        return httpx.Response(resp.status_code, json=body)

    fake.handle_async_request = handle  # type: ignore[method-assign]
    config = RouterConfig.model_validate({
        "prefill": [P_URL], "decode": [{"name": "decode-0", "url": D_URL, "lease": endpoint}],
        "log_json": False, "block_size": BLOCK_SIZE, "decode_lease_s": 20.0, **cfg})
    with TestClient(create_app(config, transport=fake, health_checks=False)) as c:
        yield c, rids, c.app.state.router  # type: ignore[attr-defined]


def complete(c: TestClient, prompt: list[int], conv: str) -> Any:
    r = c.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 3,
                                        "conversation_id": conv})
    assert r.status_code == 200, r.text
    return r


def grant(table: LeaseTable, rid: str) -> None:
    """What the decode connector does when the turn finishes."""
    table.grant(rid, 3, ttl_deadline=table.clock() + 480, lease_s=30.0)


def test_a_turn_pushed_out_by_the_entry_cap_is_released_at_once(node) -> None:
    table, server = node
    for c, rids, router in make(server.endpoint, store_max_entries=1):
        complete(c, PROMPT, "a")
        grant(table, rids[0])
        complete(c, [50, *PROMPT], "b")  # the store keeps one: a's entry goes
        grant(table, rids[1])
        assert wait_until(lambda: table.released["dropped"] == 1, 5.0)
        assert table.renew([rids[0]])[rids[0]].held is False
        assert table.renew([rids[1]])[rids[1]].held is True
        assert router.retention.keeper.tracked("decode-0") == [rids[1]]
        m = c.get("/metrics").text
        assert 'kvtier_router_lease_releases_total{reason="dropped"} 1.0' in m
        # a's next turn: nothing retained, answered without reuse; its own turn pushes b's out
        r = complete(c, [*PROMPT, *GEN, 7], "a")
        assert r.headers["x-kvtier-reuse"].startswith("none")
        assert wait_until(lambda: table.released["dropped"] == 2, 5.0)
        assert table.renew([rids[1]])[rids[1]].held is False


def test_an_expired_turn_is_released_before_its_hold_would_end(node) -> None:
    """The store's TTL ends the entry; the release comes at the next store access (here the
    gauges of GET /metrics), not at the keeper's next renewal round (20 s / 3)."""
    table, server = node
    for c, rids, router in make(server.endpoint, decode_kv_ttl_s=2.0, ttl_margin_s=1.0):
        complete(c, PROMPT, "a")
        grant(table, rids[0])
        time.sleep(1.2)
        c.get("/metrics")
        assert wait_until(lambda: table.released["dropped"] == 1, 3.0)
        assert router.retention.keeper.tracked("decode-0") == []
        assert table.released["moved"] == 0  # the keeper did not get there first


def test_a_turn_no_longer_renewed_is_not_released_again(node) -> None:
    """A turn the keeper already let go (read, released, lost, its hold over): its entry
    pushed out later sends no second release."""
    table, server = node
    for c, rids, router in make(server.endpoint, store_max_entries=1):
        complete(c, PROMPT, "a")
        grant(table, rids[0])
        router.retention.keeper.forget(PodId("decode-0"), rids[0])
        complete(c, [50, *PROMPT], "b")  # pushes a's entry out
        time.sleep(0.3)
        assert sum(table.released.values()) == 0
        assert 'reason="dropped"' not in c.get("/metrics").text
