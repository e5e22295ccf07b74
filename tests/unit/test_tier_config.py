"""HostTierConfig: parsed once, per-instance ports from the instance's env."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from kvtier.configs import CONFIG_DIR
from kvtier.devstack.spec import InstanceSpec
from kvtier.tier.config import HostTierConfig

ENV = {"KVTIER_TIER_EVENTS_PORT": "7001", "KVTIER_TIER_REPLAY_PORT": "7002",
       "KVTIER_P2P_PORT": "7003", "KVTIER_POD_NAME": "prefill-1",
       "VLLM_NIXL_SIDE_CHANNEL_PORT": "5000"}


def test_env_ports_fill_enabled_features():
    c = HostTierConfig.from_extra_config({"kv_events": True, "peer_fetch": True}).resolved(ENV)
    assert c.events_endpoint == "tcp://*:7001"
    assert c.replay_endpoint == "tcp://*:7002"
    assert c.p2p_port == 7003
    assert c.pod == "prefill-1"


def test_features_off_by_default_even_with_env():
    c = HostTierConfig.from_extra_config({}).resolved(ENV)
    assert c.events_endpoint is None and c.replay_endpoint is None and c.p2p_port is None
    assert c.pod == "prefill-1"


def test_explicit_keys_beat_env():
    c = HostTierConfig.from_extra_config(
        {"events_endpoint": "tcp://*:9001", "p2p_port": 9003, "pod": "mine",
         "peer_fetch": True}).resolved(ENV)
    assert c.events_endpoint == "tcp://*:9001"
    assert c.replay_endpoint == "tcp://*:7002"  # events on -> replay from env
    assert c.p2p_port == 9003 and c.pod == "mine"


def test_env_beats_offsets_and_offsets_remain_a_fallback():
    raw = {"events_port_offset": 1001, "replay_port_offset": 1002, "p2p_port_offset": 1000}
    c = HostTierConfig.from_extra_config(raw).resolved(ENV)
    assert (c.events_endpoint, c.p2p_port) == ("tcp://*:7001", 7003)
    legacy = HostTierConfig.from_extra_config(raw).resolved({"VLLM_NIXL_SIDE_CHANNEL_PORT": "5000"})
    assert legacy.events_endpoint == "tcp://*:6001"
    assert legacy.replay_endpoint == "tcp://*:6002"
    assert legacy.p2p_port == 6000


def test_enabled_feature_without_any_port_is_an_error():
    with pytest.raises(ValueError, match="KVTIER_P2P_PORT"):
        HostTierConfig.from_extra_config({"peer_fetch": True}).resolved({})
    with pytest.raises(ValueError, match="KVTIER_TIER_EVENTS_PORT"):
        HostTierConfig.from_extra_config({"kv_events": True}).resolved({})


def test_unknown_keys_refused_and_aliases_accepted():
    with pytest.raises(ValidationError):
        HostTierConfig.from_extra_config({"cpu_byts": 1})
    assert HostTierConfig.from_extra_config({"host_bytes": 4096}).cpu_bytes_to_use == 4096


def _kvtier_children(cfg: dict) -> list[dict]:
    if cfg["kv_connector"] == "KVTierConnector":
        return [cfg]
    return [c for c in cfg.get("kv_connector_extra_config", {}).get("connectors", [])
            if c["kv_connector"] == "KVTierConnector"]


def _connector_configs() -> list[Path]:
    return [p for p in sorted(CONFIG_DIR.glob("*.json"))
            if "kv_connector" in json.loads(p.read_text())]


def test_every_shipped_json_is_a_connector_config_or_a_cost_model():
    from kvtier.cost.model import CostModel

    for p in sorted(CONFIG_DIR.glob("*.json")):
        if p not in _connector_configs():
            CostModel.model_validate_json(p.read_text())  # raises if it is neither


@pytest.mark.parametrize("path", _connector_configs(), ids=lambda p: p.name)
def test_shipped_configs_parse_and_carry_no_ports(path):
    """Every shipped config's kvtier part parses, and resolves against the
    env a stack instance really gets (no fixed or offset ports in files)."""
    cfg = json.loads(path.read_text())
    inst = InstanceSpec(name="prefill-0", role="prefill", model="m", http_port=1,
                        side_channel_port=2, events_port=3, replay_port=4,
                        tier_events_port=5, tier_replay_port=6, tier_p2p_port=7,
                        tier_metrics_port=8)
    for child in _kvtier_children(cfg):
        extra = child.get("kv_connector_extra_config", {})
        assert not [k for k in extra if "port" in k or "endpoint" in k], extra
        c = HostTierConfig.from_extra_config(extra).resolved(inst.env())
        if c.peer_fetch:
            assert c.p2p_port == 7
        if c.kv_events:
            assert c.events_endpoint == "tcp://*:5" and c.replay_endpoint == "tcp://*:6"
        assert c.pod == "prefill-0"
        if c.metrics:
            assert c.metrics_port == 8


@pytest.mark.parametrize("name", ["vllm-offload-peer", "multi-nixl-vllm-offload-peer"])
def test_cuda_peer_tier_configs_name_the_tier_vllm_loads_and_carry_no_ports(name):
    """The CUDA host tier with kvtier's peer fetch (docs/gpu.md): vLLM's OffloadingConnector,
    its tiering spec reached by module path, one "kvtier-peer" tier, ports from the env."""
    cfg = json.loads((CONFIG_DIR / f"{name}.json").read_text())
    children = cfg["kv_connector_extra_config"]["connectors"] if "connectors" in \
        cfg["kv_connector_extra_config"] else [cfg]
    off = [c for c in children if c["kv_connector"] == "OffloadingConnector"]
    assert len(off) == 1
    extra = off[0]["kv_connector_extra_config"]
    assert extra["offload_prompt_only"] is False
    assert (extra["spec_name"], extra["spec_module_path"]) == \
        ("KVTierTieringSpec", "kvtier.connectors.peer_tier")
    [tier] = extra["secondary_tiers"]
    assert tier["type"] == "kvtier-peer"
    assert not [k for k in tier if "port" in k]
    import inspect

    from kvtier.connectors import peer_tier  # the module vLLM imports by spec_module_path

    params = inspect.signature(peer_tier.KVTierPeerTier).parameters
    assert set(tier) - {"type"} <= set(params), "a tier key the class does not take"
    assert hasattr(peer_tier, extra["spec_name"])
