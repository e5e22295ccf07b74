"""The indexer at fleet scale over real ZMQ: pods with several streams, health, /v1/route.

Publishers speak vLLM's PUB + replay protocol (``test_indexer_subscriber.Publisher``).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from kvtier.indexer.config import IndexerConfig
from kvtier.indexer.http import build_app
from tests.helpers import wait_until

from .test_indexer_subscriber import BS, Prompt, Publisher, make, matched, ready

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture()
def pubs():
    made: list[Publisher] = []

    def new(topic: str) -> Publisher:
        made.append(Publisher(topic=topic))
        return made[-1]

    yield new
    for p in made:
        p.close()


def test_two_streams_of_one_pod_merge_with_their_own_sequences(pubs):
    eng, host, other = pubs("kv@d"), pubs("kv@d-host"), pubs("kv@p")
    a = Prompt(0, 8)
    specs = [eng.spec("d"), host.spec("d", p2p="10.0.0.4:7100"),
             other.spec("p", p2p="10.0.0.5:7100")]
    with make(specs) as svc:
        assert ready(svc, eng, host, other)
        assert set(svc.subscriber.streams) == {"d", "d#1", "p"}
        eng.publish([a.stored(0, 2)])
        eng.publish([a.stored(2, 3)], drop=True)          # a gap on the engine stream only
        eng.publish([a.stored(3, 4)])
        # the host tier saves blocks 0..5; its stream counts its own seqs from 0
        host.publish([a.stored(0, 3, "CPU")])
        host.publish([a.stored(3, 6, "CPU")])
        assert wait_until(lambda: matched(svc, a, "d") == 4 and
                          matched(svc, a, "d", "CPU") == 6)
        st = svc.pod_status()["d"]
        assert st["streams"]["d"]["last_seq"] == 2 and st["streams"]["d"]["gaps"] == 1
        assert st["streams"]["d#1"]["last_seq"] == 1 and st["streams"]["d#1"]["gaps"] == 0
        assert st["gaps"] == 1 and st["connected"] and not st["stale"]
        # one pod in the answer, both tiers; never "d#1"
        pods = {(m.pod, m.tier) for m in svc.lookup("m", a.toks).matches}
        assert pods == {("d", "GPU"), ("d", "CPU")}
        # the host tier stores a block whose parent only the engine stream announced
        b = Prompt(5000, 3)
        eng.publish([b.stored(0, 2)])
        assert wait_until(lambda: matched(svc, b, "d") == 2)
        host.publish([b.stored(2, 3, "CPU")])
        assert wait_until(lambda: svc.pod_details()["d"]["streams"]["d#1"]["blocks_stored"] == 7)
        assert svc.pod_details()["d"]["dropped"] == {}
        # details: counters summed over streams, each stream's own under "streams"
        d = svc.pod_details()["d"]
        assert d["blocks_stored"] == 4 + 2 + 7 and set(d["streams"]) == {"d", "d#1"}
        # a publisher restart of one stream clears only that stream
        port, rport = host.port, host.replay_port
        host.close()
        assert wait_until(lambda: not svc.pod_status()["d"]["streams"]["d#1"]["connected"])
        host2 = Publisher(topic="kv@d-host", port=port, replay_port=rport)
        try:
            assert wait_until(lambda: svc.pod_status()["d"]["streams"]["d#1"]["connected"],
                              timeout=15)
            host2.publish([a.stored(0, 1, "CPU")])
            time.sleep(0.2)
            host2.publish([a.stored(1, 2, "CPU")])
            assert wait_until(lambda: matched(svc, a, "d", "CPU") == 2, timeout=15)
            assert matched(svc, a, "d") == 4                  # engine stream untouched
        finally:
            host2.close()


def test_target_is_never_its_own_source_and_delta_counts_every_tier(pubs):
    d_eng, d_host, p_host = pubs("kv@d"), pubs("kv@dh"), pubs("kv@ph")
    a = Prompt(0, 10)
    specs = [d_eng.spec("d"), d_host.spec("d", p2p="10.0.0.4:7100"),
             p_host.spec("p", p2p="10.0.0.5:7100")]
    with make(specs) as svc:
        assert ready(svc, d_eng, d_host, p_host)
        d_eng.publish([a.stored(0, 2)])
        d_host.publish([a.stored(0, 9, "CPU")])               # the target's own host tier
        p_host.publish([a.stored(0, 6, "CPU")])
        assert wait_until(lambda: matched(svc, a, "d", "CPU") == 9 and
                          matched(svc, a, "p", "CPU") == 6 and matched(svc, a, "d") == 2)
        r = svc.source("m", a.toks, "d", 1)
        # before: "d-host" was a pod of its own and was offered to "d" with delta 7 blocks
        assert r.source is None and r.target_matched_tokens == 9 * BS
        r = svc.source("m", a.toks, "p", 1)
        assert r.source.pod == "d" and (r.source.p2p_host, r.source.p2p_port) == \
            ("10.0.0.4", 7100) and r.delta == 3 * BS


def test_a_silent_pod_is_not_offered_and_comes_back_after_replay(pubs):
    x, y = pubs("kv@x"), pubs("kv@y")
    a = Prompt(0, 6)
    cfg = IndexerConfig(pods=(x.spec("x", p2p="10.0.0.1:7100"), y.spec("y", p2p="10.0.0.2:7100")),
                        block_size=BS, default_model="m", replay_timeout_s=2.0, stale_after_s=0.5)
    from kvtier.indexer.service import IndexerService

    svc = IndexerService(cfg)
    with svc, TestClient(build_app(svc)) as c:
        assert ready(svc, x, y)
        x.publish([a.stored(0, 6, "CPU")])
        y.publish([a.stored(0, 4, "CPU")])
        assert wait_until(lambda: matched(svc, a, "x", "CPU") == 6 and
                          matched(svc, a, "y", "CPU") == 4)
        body = {"model": "m", "token_ids": a.toks, "target_pod": "t"}
        assert c.post("/v1/source", json=body).json()["source"]["pod"] == "x"
        port, rport = x.port, x.replay_port
        x.close()
        # x's blocks are still indexed, but x is not offered once silent past 0.5 s
        assert wait_until(lambda: c.get("/healthz").json()["pods"]["x"]["stale"], timeout=10)
        assert c.post("/v1/source", json=body).json()["source"]["pod"] == "y"
        assert c.get("/healthz").json()["pods"]["y"]["stale"] is False
        assert matched(svc, a, "x", "CPU") == 6
        assert 'kvtier_indexer_pod_stale{pod="x"} 1.0' in c.get("/metrics").text
        # the pod comes back (an engine restart: seq from 0) and replays
        x2 = Publisher(topic="kv@x", port=port, replay_port=rport)
        try:
            assert wait_until(lambda: not c.get("/healthz").json()["pods"]["x"]["stale"],
                              timeout=15), svc.pod_details()["x"]
            # as in test_publisher_restart_clears_the_pod: the second batch reveals the
            # restart, the replay from 0 brings the first back
            x2.publish([a.stored(0, 4, "CPU")])
            time.sleep(0.2)
            x2.publish([a.stored(4, 5, "CPU")])
            assert wait_until(lambda: matched(svc, a, "x", "CPU") == 5, timeout=15)
            assert c.post("/v1/source", json=body).json()["source"]["pod"] == "x"
        finally:
            x2.close()


def test_route_equals_lookup_plus_source(pubs):
    t, u, v = pubs("kv@t"), pubs("kv@u"), pubs("kv@v")
    a = Prompt(0, 10)
    specs = [t.spec("t", p2p="10.0.0.1:1"), u.spec("u", p2p="10.0.0.2:2"),
             v.spec("v", p2p="10.0.0.3:3")]
    svc = make(specs)
    with svc, TestClient(build_app(svc)) as c:
        assert ready(svc, t, u, v)
        t.publish([a.stored(0, 2)])
        u.publish([a.stored(0, 8, "CPU")])
        v.publish([a.stored(0, 7, "CPU"), a.stored(0, 3)])
        assert wait_until(lambda: matched(svc, a, "v", "CPU") == 7 and
                          matched(svc, a, "u", "CPU") == 8 and matched(svc, a, "t") == 2)
        for extra in ({}, {"min_cached_token_delta": 0}, {"loads": {"u": 4, "v": 1}},
                      {"min_cached_token_delta": 100}):
            for target in ("t", "u", "v", "nobody"):
                body = {"model": "m", "token_ids": a.toks + [7], "target_pod": target, **extra}
                lk = c.post("/v1/lookup", json=body).json()
                src = c.post("/v1/source", json=body).json()
                rt = c.post("/v1/route", json=body)
                assert rt.status_code == 200, rt.text
                assert rt.json() == {**lk, **src}, (target, extra)
        # loads: v is within one block of u and less loaded
        body = {"model": "m", "token_ids": a.toks, "target_pod": "t", "loads": {"u": 4, "v": 1}}
        assert c.post("/v1/route", json=body).json()["source"]["pod"] == "v"
        # no target: the source for a target that holds nothing
        r = c.post("/v1/route", json={"model": "m", "token_ids": a.toks}).json()
        assert r["source"]["pod"] == "u" and r["target_matched_tokens"] == 0
        assert r["delta"] == 8 * BS and r["matches"][0] == \
            {"pod": "u", "tier": "CPU", "matched_tokens": 8 * BS}
        # the in-process call gives the same answer
        assert svc.route("m", a.toks).matches == svc.lookup("m", a.toks).matches


@pytest.mark.parametrize("body,status,needle", [
    ({"model": "m"}, 400, "token_ids"),
    ({"model": "m", "token_ids": []}, 400, "empty"),
    ({"model": "m", "token_ids": [1], "loads": {"u": -1}}, 400, "loads"),
    ({"model": "m", "token_ids": [1], "loads": ["u"]}, 400, "loads"),
    ({"model": "m", "token_ids": [1], "target_pod": ""}, 400, "target_pod"),
])
def test_route_bad_input_is_a_4xx(pubs, body, status, needle):
    t = pubs("kv@t")
    svc = make([t.spec("t")])
    with svc, TestClient(build_app(svc)) as c:
        r = c.post("/v1/route", json=body)
        assert r.status_code == status and needle in r.json()["error"], r.text
        if "target_pod" not in body:
            r = c.post("/v1/source", json={**body, "target_pod": "t"})
            assert r.status_code == 400 and needle in r.json()["error"], r.text


def test_a_stream_added_over_http_joins_its_pod(pubs):
    eng, host = pubs("kv@d"), pubs("kv@dh")
    a = Prompt(0, 4)
    svc = make([eng.spec("d")])
    with svc, TestClient(build_app(svc)) as c:
        assert ready(svc, eng)
        spec = f"d=tcp://127.0.0.1:{host.port},replay=tcp://127.0.0.1:{host.replay_port}," \
               "p2p=10.0.0.4:7100,topic=kv@dh"
        r = c.post("/v1/pods", json={"spec": spec})
        assert r.status_code == 409 and "stream=" in r.json()["error"]
        r = c.post("/v1/pods", json={"spec": spec, "stream": "host"})
        assert r.status_code == 201 and r.json() == {"added": "d", "stream": "d#host"}
        r = c.post("/v1/pods", json={"spec": spec + ",stream=again"})
        assert r.status_code == 409 and "twice" in r.json()["error"]
        assert ready(svc, host)
        host.publish([a.stored(0, 4, "CPU")])
        assert wait_until(lambda: matched(svc, a, "d", "CPU") == 4)
        assert svc.source("m", a.toks, "q").source.pod == "d"
        assert c.delete("/v1/pods/d").status_code == 200
        assert svc.subscriber.streams == {}
        assert wait_until(lambda: svc.lookup("m", a.toks).matches == [])


def test_fleet_config_file_expresses_streams(monkeypatch):
    for k, v in {"PREFILL_0_HOST": "10.0.1.1", "DECODE_0_HOST": "10.0.1.2"}.items():
        monkeypatch.setenv(k, v)
    cfg = IndexerConfig.load(REPO / "configs" / "indexer-fleet.yaml")
    assert [p.stream_id for p in cfg.pods] == ["prefill-0", "prefill-0#host", "decode-0",
                                              "decode-0#host"]
    assert {p.p2p_host_port for p in cfg.pods if p.name == "decode-0"} == {("10.0.1.2", 7101)}
    assert all("127.0.0.1" not in p.events for p in cfg.pods)
    assert cfg.stale_after_s == 10
    monkeypatch.delenv("DECODE_0_HOST")
    with pytest.raises(ValueError, match="DECODE_0_HOST"):
        IndexerConfig.load(REPO / "configs" / "indexer-fleet.yaml")
