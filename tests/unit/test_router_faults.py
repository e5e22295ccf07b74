"""Engines that answer garbage, die mid-stream or hang while their /health says 200: the
client gets a 502 with a message while its status is unsent, a clean error event after that
(never a silently cut 200), and a hanging instance is ejected until one of its legs works."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from kvtier.router.app import create_app
from kvtier.router.config import RouterConfig
from kvtier.router.flow import Router
from kvtier.router.pool import Ejected
from tests.fakes.engine import BLOCK_SIZE, D_URL, P2_URL, P_URL, FakeEngines

BODY = {"model": "tiny", "prompt": list(range(1, 11)), "max_tokens": 3}


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make(fake: FakeEngines, **cfg: Any) -> Iterator[tuple[TestClient, Router]]:
    config = RouterConfig.model_validate({
        "prefill": cfg.pop("prefill", [P_URL]), "decode": cfg.pop("decode", [D_URL]),
        "log_json": False, "block_size": BLOCK_SIZE, **cfg})
    with TestClient(create_app(config, transport=fake, health_checks=False)) as c:
        yield c, c.app.state.router  # type: ignore[attr-defined]


@pytest.fixture()
def fake() -> FakeEngines:
    return FakeEngines()


@pytest.fixture()
def one(fake: FakeEngines) -> Iterator[tuple[TestClient, Router]]:
    # max_retries 0: the decode leg has one attempt, then direct mode on the same decode
    # instance is skipped (it failed): the client sees what a single broken engine does.
    yield from make(fake, max_retries=0)


def metric(router: Router, name: str, **labels: str) -> float:
    return router.metrics.registry.get_sample_value(name, labels) or 0.0


def events(raw: bytes) -> list[bytes]:
    return [e for e in raw.split(b"\n\n") if e]


@pytest.mark.parametrize("fault", ["garbage", "error_event"])
@pytest.mark.parametrize("stream", [False, True])
def test_engines_answering_garbage_is_a_502_with_a_message(
        fake: FakeEngines, one: tuple[TestClient, Router], fault: str, stream: bool) -> None:
    """Every engine answers garbage (streamed: a first event that is not an answer): the
    status is not sent yet, so the client gets a 502 that says what happened."""
    c, router = one
    fake.fail(P_URL, *["garbage"] * 4)
    fake.fail(D_URL, *[fault] * 4)
    r = c.post("/v1/completions", json={**BODY, "stream": stream})
    assert r.status_code == 502, r.text
    err = r.json()["error"]
    assert err["type"] == "upstream_error" and "no engine could serve" in err["message"]
    if stream:
        kind = "status" if fault == "error_event" else "protocol"
        assert metric(router, "kvtier_router_upstream_errors_total", leg="direct",
                      kind=kind) == 1
    assert b"<html>" not in r.content


@pytest.mark.parametrize("fault", ["garbage", "error_event"])
def test_decode_answering_garbage_is_recomputed_elsewhere(
        fake: FakeEngines, one: tuple[TestClient, Router], fault: str) -> None:
    c, router = one
    fake.fail(D_URL, fault)
    r = c.post("/v1/completions", json={**BODY, "stream": True})
    assert r.status_code == 200
    assert b"error" not in r.content and b"<html>" not in r.content
    assert events(r.content)[-1] == b"data: [DONE]"
    assert metric(router, "kvtier_router_retries_total", leg="decode", action="recompute") == 1


def test_garbage_on_one_decode_is_retried_on_another(fake: FakeEngines) -> None:
    d2 = "http://d1.test:8004"
    for c, router in make(fake, decode=[D_URL, d2]):
        fake.fail(D_URL, "garbage")
        fake.fail(d2, "garbage")
        fake.faults[D_URL].clear()
        fake.fail(D_URL, "garbage")
        r = c.post("/v1/completions", json={**BODY, "stream": True})
        assert r.status_code == 200
        assert events(r.content)[-1] == b"data: [DONE]"
        assert b"error" not in r.content


@pytest.mark.parametrize("fault", ["midstream", "bad_event"])
def test_decode_dying_mid_stream_ends_with_an_error_event(
        fake: FakeEngines, one: tuple[TestClient, Router], fault: str) -> None:
    c, router = one
    fake.fail(D_URL, fault)
    r = c.post("/v1/completions", json={**BODY, "stream": True})
    assert r.status_code == 200  # the first event was sane: the status went out with it
    ev = events(r.content)
    assert ev[0].startswith(b'data: {"id":"x"')
    assert b'"error"' in ev[-2] and b"upstream_error" in ev[-2]
    assert ev[-1] == b"data: [DONE]"
    assert b"junk" not in r.content
    assert metric(router, "kvtier_router_upstream_errors_total", leg="decode",
                  kind="midstream") == 1


def test_decode_stream_without_done_is_not_a_silent_200(
        fake: FakeEngines, one: tuple[TestClient, Router]) -> None:
    """A stream that delivered an event and then stopped without [DONE]: the client is told."""
    c, router = one
    fake.fail(D_URL, "cut")
    r = c.post("/v1/completions", json={**BODY, "stream": True})
    ev = events(r.content)
    assert r.status_code == 200 and len(ev) == 3
    assert b"ended the stream early" in ev[1] and ev[2] == b"data: [DONE]"
    assert metric(router, "kvtier_router_upstream_errors_total", leg="decode",
                  kind="midstream") == 1


def test_direct_stream_garbage_is_a_502(fake: FakeEngines,
                                        one: tuple[TestClient, Router]) -> None:
    c, _ = one
    fake.fail(D_URL, "garbage")
    r = c.post("/v1/completions", json={**BODY, "n": 2, "stream": True})
    assert r.status_code == 502 and "no engine could serve" in r.json()["error"]["message"]


def test_hanging_prefill_is_ejected_though_its_health_answers(fake: FakeEngines) -> None:
    """Legs that time out eject the instance; /health 200 does not readmit it; after the
    probe interval one leg is tried on it and its success readmits it."""
    clock = Clock()
    for c, router in make(fake, prefill=[P_URL, P2_URL], eject_after_failures=2,
                          readmit_probe_s=30):
        router.pool.clock = clock
        p0 = router.pool.by_name["prefill-0"]
        fake.fail(P_URL, "timeout", "timeout")
        for _ in range(20):  # round robin: until both timeouts were P's answers
            assert c.post("/v1/completions", json=BODY).status_code == 200
            if not fake.faults[P_URL]:
                break
        assert not p0.healthy and p0.ejected == Ejected.LEGS
        assert metric(router, "kvtier_router_instance_ejections_total",
                      instance="prefill-0", reason="legs") == 1
        # The health loop's check answers 200 (the fake's /health): still out.
        asyncio.run(router.pool.check_all(httpx.AsyncClient(transport=fake), 1.0))
        assert not p0.healthy
        before = len(fake.completions(P_URL))
        for _ in range(4):
            assert c.post("/v1/completions", json=BODY).status_code == 200
        assert len(fake.completions(P_URL)) == before  # no leg went to it
        # Probe due: the next request tries it once; it answers; it is back.
        clock.t += 31
        assert c.post("/v1/completions", json=BODY).status_code == 200
        assert len(fake.completions(P_URL)) == before + 1
        assert p0.healthy and p0.ejected is None and p0.leg_failures == 0


def test_a_failed_probe_keeps_it_out_and_the_request_is_served(fake: FakeEngines) -> None:
    clock = Clock()
    for c, router in make(fake, prefill=[P_URL, P2_URL], eject_after_failures=1,
                          readmit_probe_s=30):
        router.pool.clock = clock
        p0 = router.pool.by_name["prefill-0"]
        fake.fail(P_URL, "timeout")
        for _ in range(20):
            assert c.post("/v1/completions", json=BODY).status_code == 200
            if not fake.faults[P_URL]:
                break
        assert p0.ejected == Ejected.LEGS
        calls = len(fake.completions(P_URL))
        clock.t += 31
        fake.fail(P_URL, "timeout")
        assert c.post("/v1/completions", json=BODY).status_code == 200  # retried on P2
        assert not p0.healthy
        assert c.post("/v1/completions", json=BODY).status_code == 200
        assert len(fake.completions(P_URL)) == calls + 1  # no second probe before the interval


def test_health_ejection_is_lifted_by_a_health_check(fake: FakeEngines) -> None:
    for _c, router in make(fake, eject_after_failures=1):
        p0 = router.pool.by_name["prefill-0"]
        router.pool.mark_failed(p0)
        assert p0.ejected == Ejected.HEALTH
        asyncio.run(router.pool.check_all(httpx.AsyncClient(transport=fake), 1.0))
        assert p0.healthy


def test_leg_timeouts_are_configurable() -> None:
    cfg = RouterConfig.model_validate({"decode": [D_URL], "timeouts": {
        "prefill_s": 900, "decode_idle_s": 600, "store_s": 0.1}})
    assert cfg.timeouts.prefill_s == 900 and cfg.timeouts.decode_idle_s == 600


@pytest.mark.parametrize("fault", ["garbage", "midstream", "timeout", "connect", 503])
def test_a_prefill_failing_mid_request_is_retried_on_another(fake: FakeEngines,
                                                             fault: Any) -> None:
    for c, router in make(fake, prefill=[P_URL, P2_URL]):
        fake.fail(P_URL, fault)
        fake.fail(P2_URL, fault)
        fake.faults[P2_URL].clear()  # only P fails; whichever is tried first
        for _ in range(2):
            r = c.post("/v1/completions", json=BODY)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == "abc"
        assert not fake.faults[P_URL]  # P was tried (and failed) once
        assert metric(router, "kvtier_router_retries_total", leg="prefill",
                      action="elsewhere") == 1
