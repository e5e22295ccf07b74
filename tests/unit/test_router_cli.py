"""``kvtier router``'s defaults deliver kvtier's features: the decode nodes' params feed and
lease server come from a ``kvtier stack up`` state file or from ``--decode URL,feed=,lease=``,
and a router configured for what a node cannot give says so once per node and on /healthz."""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from kvtier.configs import load_config_file
from kvtier.devstack.cli import DEFAULT_KV_CONFIG
from kvtier.devstack.spec import StackSpec
from kvtier.router.app import create_app
from kvtier.router.cli import config_from_args, register, with_stack_state
from kvtier.router.config import RouterConfig, parse_instance
from kvtier.runtime import free_ports
from tests.fakes.engine import D_URL, P_URL, FakeEngines

FEED, LEASE = "tcp://127.0.0.1:5001", "tcp://127.0.0.1:5002"


def _args(*argv: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    register(ap.add_subparsers(dest="command"))
    return ap.parse_args(["router", *argv])


def _state(tmp_path: Path) -> Path:
    f = tmp_path / "stack.json"
    f.write_text(json.dumps({"instances": [], "router": {"instances": [
        {"name": "prefill-0", "url": P_URL, "role": "prefill"},
        {"name": "decode-0", "url": D_URL, "role": "decode", "params_feed": FEED,
         "lease": LEASE}]}}))
    return f


def test_parse_instance_reads_feed_lease_and_name_and_refuses_the_rest() -> None:
    assert parse_instance(f"{D_URL},feed={FEED},lease={LEASE},name=d1") == {
        "url": D_URL, "params_feed": FEED, "lease": LEASE, "name": "d1"}
    assert parse_instance(D_URL) == {"url": D_URL}
    for bad in (f"{D_URL},fed={FEED}", f"{D_URL},feed", f"{D_URL},lease="):
        with pytest.raises(ValueError, match="expected URL"):
            parse_instance(bad)


def test_decode_flag_with_feed_and_lease(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # no default state file here
    cfg = config_from_args(_args("--prefill", P_URL,
                                 "--decode", f"{D_URL},feed={FEED},lease={LEASE}"))
    (d,) = cfg.decode_instances
    assert (d.name, d.url, d.params_feed, d.lease) == ("decode-0", D_URL, FEED, LEASE)


def test_stack_state_alone_gives_every_instance_with_its_feed_and_lease(tmp_path) -> None:
    cfg = config_from_args(_args("--stack-state", str(_state(tmp_path))))
    (d,) = cfg.decode_instances
    assert (d.params_feed, d.lease) == (FEED, LEASE)
    assert [p.url for p in cfg.prefill_instances] == [P_URL]


def test_stack_state_fills_the_urls_it_knows_and_flags_win(tmp_path) -> None:
    state = json.loads(_state(tmp_path).read_text())["router"]["instances"]
    raw = with_stack_state([P_URL], [D_URL, "http://other:1"], state)
    cfg = RouterConfig.model_validate(raw)
    d0, d1 = cfg.decode_instances
    assert (d0.params_feed, d0.lease) == (FEED, LEASE)
    assert (d1.params_feed, d1.lease) == (None, None)
    raw = with_stack_state(None, [f"{D_URL},lease=tcp://10.0.0.1:9"], state)
    (d,) = RouterConfig.model_validate(raw).decode_instances
    assert (d.params_feed, d.lease) == (FEED, "tcp://10.0.0.1:9")


def test_the_default_state_file_is_read_when_present(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".kvtier").mkdir()
    _state(tmp_path).rename(tmp_path / ".kvtier" / "stack.json")
    (d,) = config_from_args(_args("--decode", D_URL, "--prefill", P_URL)).decode_instances
    assert (d.params_feed, d.lease) == (FEED, LEASE)


def test_a_bad_state_file_is_a_clear_error(tmp_path) -> None:
    bad = tmp_path / "x.json"
    bad.write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a `kvtier stack up` state file"):
        config_from_args(_args("--stack-state", str(bad)))
    with pytest.raises(ValueError, match="No such file"):
        config_from_args(_args("--stack-state", str(tmp_path / "missing.json")))


def test_capability_warnings_per_node() -> None:
    base = {"prefill": [P_URL], "decode": [D_URL, f"http://d2:1,feed={FEED},lease={LEASE}"]}
    cfg = RouterConfig.model_validate({**base, "decode_lease_s": 6})
    w = cfg.capability_warnings()
    assert set(w) == {"decode-0"}
    assert any("no params feed" in x for x in w["decode-0"])
    assert any("no lease endpoint" in x for x in w["decode-0"])
    # leases not asked for: only the feed is missing; buffered capture needs no feed
    assert len(RouterConfig.model_validate(base).capability_warnings()["decode-0"]) == 1
    buffered = RouterConfig.model_validate({**base, "stream_capture": "buffered"})
    assert buffered.capability_warnings() == {}


def test_the_router_warns_once_per_node_and_healthz_says_so(caplog) -> None:
    dead_lease = f"tcp://127.0.0.1:{free_ports(1)[0]}"
    cfg = RouterConfig.model_validate({
        "prefill": [P_URL], "decode": [D_URL, f"http://d2.test:1,feed={FEED},lease={dead_lease}"],
        "decode_lease_s": 6, "log_json": False})
    with caplog.at_level(logging.WARNING, logger="kvtier.router"):
        with TestClient(create_app(cfg, transport=FakeEngines(), health_checks=False)) as c:
            caps = c.get("/healthz").json()["decode_capabilities"]
            for _ in range(40):
                if caps["decode-1"]["lease"] != "unknown":
                    break
                time.sleep(0.1)
                caps = c.get("/healthz").json()["decode_capabilities"]
    assert caps["decode-0"]["lease"] == "none" and caps["decode-0"]["params_feed"] is None
    assert len(caps["decode-0"]["warnings"]) == 2
    assert caps["decode-1"]["lease"] == "unreachable" and caps["decode-1"]["warnings"] == []
    starts = [r.getMessage() for r in caplog.records if "decode node decode-0" in r.getMessage()]
    assert len(starts) == 2  # one line per missing capability, once
    assert any("decode-1: its lease server" in r.getMessage() for r in caplog.records)


def test_stack_up_defaults_to_kvtiers_connector_and_writes_the_router_instances() -> None:
    assert DEFAULT_KV_CONFIG == "nixl-bidirectional-lease"
    spec = StackSpec(model="m", prefill=1, decode=1,
                     kv_transfer_config=load_config_file(DEFAULT_KV_CONFIG), base_port=20000)
    p, d = spec.instances()
    extra = load_config_file(DEFAULT_KV_CONFIG)["kv_connector_extra_config"]
    assert d.router_endpoints() == {
        "params_feed": f"tcp://127.0.0.1:{d.side_channel_port + extra['params_feed_port_offset']}",
        "lease": f"tcp://127.0.0.1:{d.side_channel_port + extra['lease_port_offset']}"}
    plain = StackSpec(model="m", prefill=1, decode=1,
                      kv_transfer_config=load_config_file("nixl-bidirectional"), base_port=20000)
    assert plain.instances()[1].router_endpoints() == {}
