"""The host tier's peer address (multi-host): where ``p2p_host`` comes from, and bad values.

Order (kvtier.tier.config): ``p2p_host`` in the file > ``KVTIER_P2P_HOST`` > the default
route's source address > the host name's address > an up, non-loopback interface >
127.0.0.1 (warning). Resolved only when peer fetch is on.
"""

from __future__ import annotations

import json
import logging
import socket

import pytest

from kvtier.configs import CONFIG_DIR
from kvtier.devstack.spec import InstanceSpec
from kvtier.tier import config as tc
from kvtier.tier.config import HostTierConfig
from kvtier.tier.env import InstanceEnv

PEER = {"peer_fetch": True}
PORT = {"KVTIER_P2P_PORT": "7003"}


@pytest.fixture()
def detected(monkeypatch):
    """Detectors replaced by a table the test fills; records which ones ran."""
    found: dict[str, str | None] = {"route": None, "hostname": None, "interface": None}
    ran: list[str] = []

    def make(name):
        def detect():
            ran.append(name)
            return found[name]
        return detect

    for name in found:
        monkeypatch.setattr(tc, f"{name}_address", make(name))
    return found, ran


def resolve(extra=PEER, env=None):
    return HostTierConfig.from_extra_config(extra).resolved({**PORT, **(env or {})})


def test_order_file_then_env_then_route_hostname_interface_then_loopback(detected, caplog):
    found, ran = detected
    found.update(route="10.0.0.1", hostname="10.0.0.2", interface="10.0.0.3")
    # 127.0.0.x: bindable on any Linux host, so given values pass the "is it mine" check
    assert resolve({**PEER, "p2p_host": "127.0.0.2"}, {InstanceEnv.P2P_HOST: "127.0.0.3"}).p2p_host \
        == "127.0.0.2"
    assert resolve({**PEER, "peer_host": "127.0.0.2"}).p2p_host == "127.0.0.2"   # alias
    assert resolve(env={InstanceEnv.P2P_HOST: "127.0.0.3"}).p2p_host == "127.0.0.3"
    assert resolve(env={InstanceEnv.P2P_HOST: ""}).p2p_host == "10.0.0.1"   # empty = unset, as ports
    assert ran == ["route"]                  # given values never run a detector
    assert resolve().p2p_host == "10.0.0.1"
    found["route"] = None
    assert resolve().p2p_host == "10.0.0.2"
    found["hostname"] = None
    assert resolve().p2p_host == "10.0.0.3"
    found["interface"] = None
    with caplog.at_level(logging.WARNING, logger="kvtier.tier.config"):
        assert resolve().p2p_host == "127.0.0.1"
    assert "KVTIER_P2P_HOST" in caplog.text and "cannot reach" in caplog.text


def test_how_is_reported(detected):
    found, _ = detected
    found["route"] = "10.0.0.1"
    assert tc.resolve_p2p_host(None, {})[1].startswith("detected: the default route")
    assert tc.resolve_p2p_host(None, {InstanceEnv.P2P_HOST: "127.0.0.1"}) == ("127.0.0.1", InstanceEnv.P2P_HOST)
    assert tc.resolve_p2p_host("localhost", {})[0] == "127.0.0.1"   # a name -> its address


def test_not_resolved_without_peer_fetch(detected):
    _, ran = detected
    c = HostTierConfig.from_extra_config({"kv_events": True}).resolved(
        {"KVTIER_TIER_EVENTS_PORT": "1", InstanceEnv.P2P_HOST: "no good"})
    assert c.p2p_host is None and ran == []


@pytest.mark.parametrize("value,why", [
    ("", "empty"),
    ("0.0.0.0", "wildcard"),
    ("tcp://10.0.0.1", "no scheme"),
    ("10.0.0.1:7100", "without a port"),
    ("::1", "IPv6 is not supported"),
    ("[fe80::1]", "IPv6 is not supported"),
    ("10.0.0.256", "not a valid IPv4"),
    ("224.0.0.1", "not a unicast"),
    ("bad_host!", "not a valid host name"),
    ("198.51.100.7", "not an address of this host"),   # TEST-NET-2: nobody's own
])
def test_bad_values_are_clear_errors_naming_their_source(value, why):
    with pytest.raises(ValueError, match=why) as e:
        resolve(env={InstanceEnv.P2P_HOST: value} if value else {InstanceEnv.P2P_HOST: " "})
    assert InstanceEnv.P2P_HOST in str(e.value)
    with pytest.raises(ValueError, match=why) as e:
        resolve({**PEER, "p2p_host": value})
    assert str(e.value).startswith("p2p_host (kv_connector_extra_config)=")


def test_unresolvable_name(monkeypatch):
    def fail(*a, **k):
        raise socket.gaierror(-2, "Name or service not known")

    monkeypatch.setattr(tc.socket, "getaddrinfo", fail)
    with pytest.raises(ValueError, match="cannot resolve"):
        resolve(env={InstanceEnv.P2P_HOST: "peer-7.example"})


def test_detectors_give_a_usable_address_of_this_host_or_none():
    for detect in (tc.route_address, tc.hostname_address, tc.interface_address):
        addr = detect()
        if addr is not None:
            assert not addr.startswith("127.") and tc._bindable(addr), (detect, addr)
    addr, how = tc.resolve_p2p_host(None, {})
    assert tc._bindable(addr) and how


def _kvtier_children(cfg: dict) -> list[dict]:
    if cfg["kv_connector"] == "KVTierConnector":
        return [cfg]
    return [c for c in cfg.get("kv_connector_extra_config", {}).get("connectors", [])
            if c["kv_connector"] == "KVTierConnector"]


def test_shipped_configs_name_no_peer_host_and_the_dev_stack_supplies_it(detected):
    """No config file assumes 127.0.0.1; ``kvtier stack up`` (one host) gives it per
    instance through KVTIER_P2P_HOST."""
    _, ran = detected
    inst = InstanceSpec(name="prefill-0", role="prefill", model="m", http_port=1,
                        side_channel_port=2, events_port=3, replay_port=4,
                        tier_events_port=5, tier_replay_port=6, tier_p2p_port=7,
                        tier_metrics_port=8)
    assert inst.env()[InstanceEnv.P2P_HOST] == "127.0.0.1"
    peers = 0
    for p in sorted(CONFIG_DIR.glob("*.json")):
        cfg = json.loads(p.read_text())
        if "kv_connector" not in cfg:
            continue
        for child in _kvtier_children(cfg):
            extra = child.get("kv_connector_extra_config", {})
            assert not {"p2p_host", "peer_host"} & set(extra), p.name
            c = HostTierConfig.from_extra_config(extra).resolved(inst.env())
            if c.peer_fetch:
                peers += 1
                assert (c.p2p_host, c.p2p_port) == ("127.0.0.1", 7), p.name
    assert peers >= 3 and ran == []
