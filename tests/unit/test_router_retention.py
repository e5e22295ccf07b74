"""The router's decode leases (router/retention.py) against a real lease server.

The decode node is ``FakeEngines`` for HTTP and a real ``LeaseServer`` over an in-process
``LeaseTable`` for leases; a test grants the turn's lease in the table as the decode node's
connector would when the turn finishes (the fake answers every decode leg with the engine
request id ``D-req``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from kvtier.cost.config import resolve_config_path
from kvtier.router.app import create_app
from kvtier.router.config import RouterConfig
from kvtier.router.flow import Router
from kvtier.tier.leases import LeaseServer, LeaseTable
from kvtier.wire.leases import PARAM_KEY, RETAIN_KEY
from tests.fakes.engine import BLOCK_SIZE, D_URL, GEN, IDX_URL, P_URL, FakeEngines

PROMPT = list(range(1, 11))
RID = "D-req"


@pytest.fixture()
def node() -> Iterator[tuple[LeaseTable, LeaseServer]]:
    table = LeaseTable(30.0)
    server = LeaseServer(table, "tcp://127.0.0.1:*")
    yield table, server
    server.close()


def make(endpoint: str, **cfg: Any) -> Iterator[tuple[TestClient, FakeEngines, Router]]:
    fake = FakeEngines()
    config = RouterConfig.model_validate({
        "prefill": [P_URL], "decode": [{"name": "decode-0", "url": D_URL, "lease": endpoint}],
        "log_json": False, "block_size": BLOCK_SIZE, "decode_lease_s": 20.0, **cfg})
    with TestClient(create_app(config, transport=fake, health_checks=False)) as c:
        yield c, fake, c.app.state.router  # type: ignore[attr-defined]


def complete(c: TestClient, prompt: list[int], conv: str = "x",
             headers: dict[str, str] | None = None) -> Any:
    return c.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 3,
                                           "conversation_id": conv}, headers=headers or {})


def grant(table: LeaseTable, lease_s: float = 1.0) -> None:
    """What the decode connector does when the turn finishes."""
    table.grant(RID, 3, ttl_deadline=table.clock() + 480, lease_s=lease_s)


def until(cond: Callable[[], bool], within_s: float = 5.0) -> bool:
    t0 = time.monotonic()
    while time.monotonic() - t0 < within_s:
        if cond():
            return True
        time.sleep(0.02)
    return False


def test_decode_leg_asks_for_the_routers_lease(node) -> None:
    _, server = node
    for c, fake, _ in make(server.endpoint):
        complete(c, PROMPT)
        dec = [x for x in fake.completions(D_URL)][-1]
        assert dec.kvp[PARAM_KEY] == 20.0


def test_a_taken_turn_is_renewed_and_offered_with_its_fresh_deadline(node) -> None:
    table, server = node
    for c, fake, router in make(server.endpoint):
        complete(c, PROMPT)
        assert router.retention.keeper.tracked("decode-0") == [RID]
        grant(table, lease_s=1.0)  # a short first lease: the router's renewal extends it
        r = complete(c, [*PROMPT, *GEN, 7])
        assert r.headers["x-kvtier-reuse"].startswith("dp_read;")
        offered = fake.prefills()[-1].kvp
        assert offered["remote_engine_id"] == "D"
        # renewed to the router's 20 s lease, and that deadline is what the prefill checks
        assert offered["remote_blocks_expiry_time"] > table.clock() + 15
        assert table.snapshot()["renewed"] >= 1
        # read: forgotten as the prefill answered, not released (vLLM frees it after the
        # read); what is tracked now is this turn's own retained KV (the fake answers every
        # decode leg with the same engine request id)
        assert router.retention.keeper.tracked("decode-0") == [RID]
        assert sum(table.released.values()) == 0
    # the router's exit releases what it still held (its in-memory store dies with it)
    assert table.released["dropped"] == 1


def test_a_turn_whose_ttl_ends_before_a_read_could_is_not_offered(node) -> None:
    """vLLM's TTL bounds every lease: with 6 s of it left, a renewal cannot give the prefill
    the 5 s margin it checks at read time. The turn is released and recomputed instead of
    being offered (the prefill would decline the read and fail the request)."""
    table, server = node
    for c, fake, router in make(server.endpoint):
        complete(c, PROMPT)
        table.grant(RID, 3, ttl_deadline=table.clock() + 6, lease_s=30.0)
        r = complete(c, [*PROMPT, *GEN, 7])
        assert r.status_code == 200 and r.headers["x-kvtier-reuse"] == "none; tokens=0"
        assert "remote_engine_id" not in fake.prefills()[-1].kvp
        assert until(lambda: sum(table.released.values()) == 1)
        m = c.get("/metrics").text
        assert 'kvtier_router_lease_calls_total{op="renew",result="too_late"} 1.0' in m


def test_close_releases_now_and_only_for_its_tenant(node) -> None:
    table, server = node
    for c, _, _ in make(server.endpoint, api_keys=["ka", "kb"]):
        complete(c, PROMPT, headers={"authorization": "Bearer ka"})
        grant(table, lease_s=30.0)
        r = c.delete("/v1/conversations/x", headers={"authorization": "Bearer kb"})
        assert r.status_code == 404 and table.released["closed"] == 0
        assert c.delete("/v1/conversations/x").status_code == 401
        r = c.delete("/v1/conversations/x", headers={"authorization": "Bearer ka"})
        assert r.status_code == 200 and r.json() == {
            "id": "x", "object": "conversation.deleted", "deleted": True,
            "device_blocks_released": True, "device_blocks": "released",
            "detail": "the decode node freed the conversation's blocks"}
        assert table.released["closed"] == 1 and table.snapshot()["leases_held"] == 1
        assert table.renew([RID])[RID].held is False  # the node frees it at its next step
        r = c.delete("/v1/conversations/x", headers={"authorization": "Bearer ka"})
        assert r.status_code == 404
        m = c.get("/metrics").text
        assert 'kvtier_router_lease_releases_total{reason="closed"} 1.0' in m


def test_an_unproven_next_turn_releases_the_old_one(node) -> None:
    table, server = node
    for c, fake, _ in make(server.endpoint):
        complete(c, PROMPT)
        grant(table, lease_s=30.0)
        r = complete(c, [99, 98, 97, 96, 95, 94, 93, 92])  # does not continue it
        assert r.headers["x-kvtier-outcome"] == "stale"
        assert "remote_engine_id" not in fake.prefills()[-1].kvp
        assert until(lambda: table.released["dropped"] == 1)


def test_a_turn_that_does_not_read_the_retained_one_releases_it_before_its_decode(node) -> None:
    """The retained turn is released as soon as the prefill has answered without reading it:
    on a decode node short of blocks, this turn's own decode may be waiting for that room."""
    import asyncio

    import httpx

    table, server = node
    at_decode: list[int] = []
    d_host = httpx.URL(D_URL).host
    for c, fake, _ in make(server.endpoint):
        complete(c, PROMPT)
        grant(table, lease_s=30.0)
        plain = fake.handle_async_request

        async def handle(request: httpx.Request) -> httpx.Response:
            if request.url.host == d_host and request.url.path.endswith("completions"):
                for _ in range(100):  # the release is a background call: give it 2 s
                    if table.released["dropped"]:
                        break
                    await asyncio.sleep(0.02)
                at_decode.append(table.released["dropped"])
            return await plain(request)

        fake.handle_async_request = handle  # type: ignore[method-assign]
        r = complete(c, [99, 98, 97, 96, 95, 94, 93, 92])  # does not continue it
        assert r.status_code == 200 and r.headers["x-kvtier-outcome"] == "stale"
        assert at_decode == [1]  # released before the decode leg began


def test_a_lost_lease_is_not_offered(node) -> None:
    table, server = node
    for c, fake, _ in make(server.endpoint):
        complete(c, PROMPT)
        # never granted (the node restarted, or the lease ran out): the confirm finds it gone
        r = complete(c, [*PROMPT, *GEN, 7])
        assert r.headers["x-kvtier-outcome"] == "expired"
        assert r.headers["x-kvtier-reuse"] == "none; tokens=0"
        assert "remote_engine_id" not in fake.prefills()[-1].kvp
        assert 'reason="released"' in c.get("/metrics").text


def test_a_memory_store_router_releases_what_it_holds_on_shutdown(node) -> None:
    table, server = node
    for c, _, _ in make(server.endpoint):
        complete(c, PROMPT)
        grant(table, lease_s=30.0)
    assert table.released["dropped"] == 1


def test_adaptive_releases_a_conversation_whose_waits_are_long(node) -> None:
    table, server = node
    cost = str(resolve_config_path("cost-tiny.json"))
    # no host tier: a released turn is recomputed, so short waits are worth holding
    for c, fake, router in make(server.endpoint, retention="adaptive", cost_model=cost,
                                host_copy=False):
        policy = router.retention.policy
        assert policy is not None
        for _ in range(5):  # this conversation's tools answer after ten minutes
            policy.observe("slow", 600.0, 2000)
        for _ in range(5):  # this one's after a second
            policy.observe("fast", 1.0, 2000)
        complete(c, PROMPT, conv="fast")
        assert router.retention.keeper.tracked("decode-0") == [RID]
        grant(table, lease_s=30.0)
        c.delete("/v1/conversations/fast")
        complete(c, PROMPT, conv="slow")
        # released at once: so the decode leg asked the node to keep nothing at all, and it
        # named no blocks; nothing is held, and no release needs sending
        dec = fake.completions(D_URL)[-1]
        assert dec.kvp[RETAIN_KEY] is False
        assert RETAIN_KEY not in fake.completions(D_URL)[-2].kvp  # "fast" was retained
        assert router.retention.keeper.tracked("decode-0") == []
        time.sleep(0.2)
        assert table.released["moved"] == 0
        m = c.get("/metrics").text
        assert 'kvtier_router_hold_choices_total{action="release",basis="conversation"} 1.0' in m
        assert 'kvtier_router_hold_choices_total{action="hold",basis="conversation"} 1.0' in m


def test_a_turn_not_retained_still_teaches_its_wait_and_its_host_copy(node) -> None:
    """A turn released at once is not kept by the decode node (nothing in the store), yet its
    conversation's next turn still reports the wait, and the host copy's survival is still
    judged against what the turn left."""
    _, server = node
    cost = str(resolve_config_path("cost-tiny.json"))
    for c, fake, router in make(server.endpoint, retention="adaptive", cost_model=cost,
                                host_copy=True, indexer=IDX_URL, implicit_sessions=False):
        policy = router.retention.policy
        assert policy is not None
        fake.lookup = []  # no host tier holds anything: every copy is gone
        for turn in range(3):
            assert complete(c, [*PROMPT, *range(turn)], conv="gone").status_code == 200
            dec = fake.completions(D_URL)[-1]
            if turn == 0:  # no waits yet, host copies taken to survive: never device-faster
                assert dec.kvp[RETAIN_KEY] is False
        assert router.retention.keeper.tracked("decode-0") == []
        assert policy.host_odds("gone") == 0.0  # two continuation turns, both gone
        seen = policy.choose("another")
        assert (seen.basis, seen.samples) == ("fleet", 2), seen


def test_a_node_that_keeps_a_turn_asked_not_to_is_released_at_once(node) -> None:
    """A decode node whose connector ignores ``kvtier_decode_retain`` (an older kvtier) names
    blocks anyway: the router releases them at once, as it did before asking."""
    table, server = node
    cost = str(resolve_config_path("cost-tiny.json"))
    for c, fake, router in make(server.endpoint, retention="adaptive", cost_model=cost,
                                host_copy=False):
        fake.ignore_retain = True
        policy = router.retention.policy
        assert policy is not None
        for _ in range(5):
            policy.observe("slow", 600.0, 2000)
        grant(table, lease_s=30.0)
        complete(c, PROMPT, conv="slow")
        assert fake.completions(D_URL)[-1].kvp[RETAIN_KEY] is False
        assert router.retention.keeper.tracked("decode-0") == []
        assert until(lambda: table.released["moved"] == 1)


def test_adaptive_holds_the_conversations_whose_host_copies_are_evicted(node) -> None:
    """Host reads cost what device reads do (cost-tiny), so a turn whose host copy survives is
    released to it; the indexer says one conversation's host copies are gone at every next
    turn (a host tier too small for the working set): that one is held on the device."""
    _, server = node
    cost = str(resolve_config_path("cost-tiny.json"))
    host_has_it = [{"pod": "prefill-0", "tier": "CPU", "matched_tokens": 4096}]
    for c, fake, router in make(server.endpoint, retention="adaptive", cost_model=cost,
                                host_copy=True, indexer=IDX_URL, implicit_sessions=False):
        policy = router.retention.policy
        assert policy is not None
        for conv in ("evicted", "kept"):
            for _ in range(5):
                policy.observe(conv, 1.0, 2000)
        for turn in range(3):
            for conv, lookup, first in (("evicted", [], 100), ("kept", host_has_it, 200)):
                fake.lookup = lookup
                prompt = [first, *PROMPT, turn]
                assert complete(c, prompt, conv=conv).status_code == 200
        assert (policy.host_odds("evicted"), policy.host_odds("kept")) == (0.0, 1.0)
        m = c.get("/metrics").text
        assert 'kvtier_router_host_copy_checks_total{result="gone"} 2.0' in m
        assert 'kvtier_router_host_copy_checks_total{result="held"} 2.0' in m
        evicted, kept = policy.choose("evicted"), policy.choose("kept")
        assert evicted.hold_s > 0 and kept.hold_s == 0.0


def test_adaptive_learns_a_wait_that_outlived_the_stored_turn(node) -> None:
    """A conversation that comes back after its stored turn expired still reports its wait:
    the hold policy must see the waits longer than what it held, or it never holds longer."""
    _, server = node
    cost = str(resolve_config_path("cost-tiny.json"))
    for c, _, router in make(server.endpoint, retention="adaptive", cost_model=cost,
                             host_copy=False, decode_kv_ttl_s=1.5, ttl_margin_s=0.5):
        policy = router.retention.policy
        assert policy is not None
        assert complete(c, PROMPT, conv="late").status_code == 200
        time.sleep(1.3)  # > the entry's 1 s: the store has let the turn go
        assert complete(c, [*PROMPT, 11], conv="late").status_code == 200
        assert 'kvtier_router_params_dropped_total{reason="expired"} 1.0' in \
            c.get("/metrics").text
        seen = policy.choose("another")
        assert (seen.basis, seen.samples) == ("fleet", 1), seen


def test_adaptive_needs_a_cost_model_with_a_dp_read_link() -> None:
    with pytest.raises(ValueError, match="retention: adaptive needs a cost_model"):
        RouterConfig.model_validate({"decode": [D_URL], "retention": "adaptive"})


def test_a_lease_endpoint_must_be_zmq() -> None:
    with pytest.raises(ValueError, match="ZMQ endpoint"):
        RouterConfig.model_validate({"decode": [{"name": "d", "url": D_URL,
                                                 "lease": "http://d:1"}]})


def test_close_says_when_no_blocks_were_released() -> None:
    """A decode node without a lease endpoint: the conversation is forgotten, and the answer
    says its blocks were not released (vLLM's TTL holds them), not a bare 200."""
    fake = FakeEngines()
    config = RouterConfig.model_validate({
        "prefill": [P_URL], "decode": [D_URL], "log_json": False, "block_size": BLOCK_SIZE})
    with TestClient(create_app(config, transport=fake, health_checks=False)) as c:
        complete(c, PROMPT)
        r = c.delete("/v1/conversations/x")
        assert r.status_code == 200
        body = r.json()
        assert body["deleted"] is True and body["device_blocks_released"] is False
        assert body["device_blocks"] == "no_lease_endpoint" and "ttl" in body["detail"]


def test_close_says_when_the_lease_server_did_not_answer() -> None:
    """A lease endpoint nobody serves: not released, and the answer says why."""
    from kvtier.runtime import free_ports

    for c, _, _ in make(f"tcp://127.0.0.1:{free_ports(1)[0]}"):
        complete(c, PROMPT)
        body = c.delete("/v1/conversations/x").json()
        assert body["device_blocks_released"] is False
        assert body["device_blocks"] == "lease_server_unavailable"
