"""The HTTP daemon: API shapes from docs/INTERFACES.md, 4xx for bad input, the CLI as a real process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from kvtier.ab.live.scrape import metric
from kvtier.indexer.config import IndexerConfig, PodSpec
from kvtier.indexer.http import build_app
from kvtier.indexer.service import IndexerService
from kvtier.runtime import free_ports
from tests.helpers import wait_until

from .test_indexer_subscriber import BS, Prompt, Publisher, ready

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture()
def pub():
    p = Publisher()
    yield p
    p.close()


@pytest.fixture()
def client(pub):
    cfg = IndexerConfig(pods=(pub.spec(p2p="10.0.0.1:7000"),), block_size=BS, default_model="m",
                        max_lookup_tokens=1000)
    svc = IndexerService(cfg)
    with svc, TestClient(build_app(svc)) as c:
        assert ready(svc, pub)
        c.svc = svc
        yield c


def test_lookup_source_healthz_metrics(client, pub):
    a = Prompt(0, 5)
    pub.publish([a.stored(0, 5), a.stored(0, 3, "CPU")])
    assert wait_until(lambda: client.post("/v1/lookup", json={"model": "m", "token_ids": a.toks})
                      .json()["matches"] != [])
    r = client.post("/v1/lookup", json={"model": "m", "token_ids": a.toks + [1, 2]})
    assert r.status_code == 200
    assert r.json() == {"block_size": BS, "matches": [
        {"pod": "p", "tier": "GPU", "matched_tokens": 20},
        {"pod": "p", "tier": "CPU", "matched_tokens": 12}]}
    # another model namespace sees nothing
    assert client.post("/v1/lookup", json={"model": "other", "token_ids": a.toks}).json() == \
        {"block_size": BS, "matches": []}
    r = client.post("/v1/source", json={"model": "m", "token_ids": a.toks, "target_pod": "q"})
    assert r.json() == {"source": {"pod": "p", "tier": "CPU", "matched_tokens": 12,
                                   "p2p_host": "10.0.0.1", "p2p_port": 7000},
                        "target_matched_tokens": 0, "delta": 12}
    r = client.post("/v1/source", json={"model": "m", "token_ids": a.toks, "target_pod": "p"})
    assert r.json() == {"source": None, "target_matched_tokens": 20, "delta": 0}
    h = client.get("/healthz").json()
    assert h == {"status": "ok", "pods": {"p": {
        "connected": True, "last_seq": 0, "gaps": 0, "stale": False,
        "streams": {"p": {"connected": True, "last_seq": 0, "gaps": 0}}}}}
    m = client.get("/metrics").text
    assert metric(m, "kvtier_indexer_events_applied_total", {"kind": "BlockStored", "pod": "p"},
                  required=True) == 2
    assert metric(m, "kvtier_indexer_index_keys", required=True) == 5
    assert metric(m, "kvtier_indexer_lookup_seconds_count", required=True) > 0


@pytest.mark.parametrize("path,body,status,needle", [
    ("/v1/lookup", None, 400, "body"),
    ("/v1/lookup", b"{not json", 400, "malformed JSON"),
    ("/v1/lookup", {"token_ids": [1]}, 400, "model"),
    ("/v1/lookup", {"model": "m"}, 400, "token_ids"),
    ("/v1/lookup", {"model": "m", "token_ids": "1,2"}, 400, "token_ids"),
    ("/v1/lookup", {"model": "m", "token_ids": [1, "x"]}, 400, "token_ids[1]"),
    ("/v1/lookup", {"model": "m", "token_ids": [1, -1]}, 400, "token_ids[1]"),
    ("/v1/lookup", {"model": "m", "token_ids": [2**32]}, 400, "token_ids[0]"),
    ("/v1/lookup", {"model": "m", "token_ids": [1.5]}, 400, "token_ids[0]"),
    ("/v1/lookup", {"model": "m", "token_ids": []}, 400, "empty"),
    ("/v1/lookup", {"model": "m", "token_ids": [1] * 1001}, 413, "limit"),
    ("/v1/lookup", [1, 2], 400, "object"),
    ("/v1/source", {"model": "m", "token_ids": [1]}, 400, "target_pod"),
    ("/v1/source", {"model": "m", "token_ids": [1], "target_pod": "p",
                    "min_cached_token_delta": -1}, 400, "min_cached_token_delta"),
    ("/v1/pods", {"spec": "broken"}, 400, "invalid pod"),
    ("/v1/pods", {"name": "x", "events": "http://nope"}, 400, "tcp://"),
    ("/v1/pods", {"spec": "p=tcp://127.0.0.1:1"}, 409, "exists"),
    ("/v1/nothing", {}, 404, "Not Found"),
])
def test_bad_input_is_a_4xx_json_error(client, path, body, status, needle):
    if isinstance(body, bytes) or body is None:
        r = client.post(path, content=body or b"")
    else:
        r = client.post(path, json=body)
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]


def test_wrong_method_and_unknown_pod(client):
    r = client.get("/v1/lookup")
    assert r.status_code == 405 and "error" in r.json()
    r = client.delete("/v1/pods/nope")
    assert r.status_code == 404 and "nope" in r.json()["error"]


def test_add_and_remove_pod_over_http(client):
    pub2 = Publisher(topic="kv@n")
    try:
        spec = f"n=tcp://127.0.0.1:{pub2.port},replay=tcp://127.0.0.1:{pub2.replay_port}," \
               "p2p=127.0.0.1:9,model=m,topic=kv@n"
        assert client.post("/v1/pods", json={"spec": spec}).status_code == 201
        assert ready(client.svc, pub2)
        a = Prompt(0, 2)
        pub2.publish([a.stored(0, 2)])
        assert wait_until(lambda: any(m["pod"] == "n" for m in client.post(
            "/v1/lookup", json={"model": "m", "token_ids": a.toks}).json()["matches"]))
        assert client.get("/v1/pods").json()["pods"]["n"]["blocks_stored"] == 2
        assert client.delete("/v1/pods/n").status_code == 200
        assert wait_until(lambda: client.post(
            "/v1/lookup", json={"model": "m", "token_ids": a.toks}).json()["matches"] == [])
    finally:
        pub2.close()


def test_example_config_file_loads():
    cfg = IndexerConfig.load(REPO / "configs" / "indexer.yaml")
    assert [p.name for p in cfg.pods] == ["prefill-0", "decode-0"]
    assert cfg.pods[0].p2p_host_port == ("127.0.0.1", 7100)
    assert cfg.pods[1].topic == "kv@decode-0" and cfg.default_model == "tiny"


def test_pod_spec_syntax():
    s = PodSpec.parse("a=tcp://h:1,replay=tcp://h:2,p2p=h:3,model=llama")
    assert (s.name, s.events, s.replay, s.p2p, s.model) == ("a", "tcp://h:1", "tcp://h:2",
                                                             "h:3", "llama")
    for bad in ("a", "a=", "a=http://h:1", "a=tcp://h:1,replay", "a=tcp://h:1,bogus=1",
                "a b=tcp://h:1"):
        with pytest.raises(ValueError):
            PodSpec.parse(bad)


def test_cli_daemon_serves_and_snapshots_on_sigterm(pub, tmp_path):
    """`kvtier indexer` as a real process: serves, then writes its snapshot on SIGTERM."""
    (port,) = free_ports(1)
    snap = tmp_path / "s.snap"
    cmd = [sys.executable, "-m", "kvtier.cli", "indexer", "--port", str(port), "--model", "m",
           "--block-size", str(BS), "--snapshot", str(snap),
           "--pod", f"p=tcp://127.0.0.1:{pub.port},replay=tcp://127.0.0.1:{pub.replay_port}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    a = Prompt(0, 3)
    try:
        def up():
            try:
                return httpx.get(f"{url}/healthz").json()["pods"]["p"]["connected"]
            except httpx.HTTPError:
                return False
        assert wait_until(up, timeout=30), proc.stdout.read1().decode() if proc.poll() else ""
        assert pub.wait_subscribed()
        pub.publish([a.stored(0, 3)])
        assert wait_until(lambda: httpx.post(f"{url}/v1/lookup", json={
            "model": "m", "token_ids": a.toks}).json()["matches"] == [
                {"pod": "p", "tier": "GPU", "matched_tokens": 12}])
    finally:
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=30)[0].decode()
    # uvicorn re-raises SIGTERM after a graceful shutdown, so -15 is a clean exit here.
    assert proc.returncode in (0, -signal.SIGTERM), out
    assert "indexer stopped" in out
    assert snap.exists() and snap.stat().st_size > 0


def test_cli_rejects_bad_flags():
    r = subprocess.run([sys.executable, "-m", "kvtier.cli", "indexer", "--pod", "nonsense"],
                       capture_output=True, text=True, env={**os.environ}, timeout=60)
    assert r.returncode == 2 and "bad configuration" in r.stderr
    r = subprocess.run([sys.executable, "-m", "kvtier.cli", "indexer", "--help"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "--backend" in r.stdout and json.dumps("x")
