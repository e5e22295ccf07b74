"""The five strategies as configs: what each starts and how the router is set."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvtier.ab.live.stacks import stack_spec_for
from kvtier.ab.strategies import (
    MIN_DECODE_LEASE_S,
    STRATEGY_NAMES,
    StrategySpec,
    builtin,
    parse_list,
)
from kvtier.cost.model import CostModel, LinkModel
from kvtier.cost.retention import WaitSample
from kvtier.router.config import RouterConfig


def children(cfg: dict) -> dict[str, dict]:
    if cfg["kv_connector"] == "MultiConnector":
        return {c["kv_connector"]: c for c in cfg["kv_connector_extra_config"]["connectors"]}
    return {cfg["kv_connector"]: cfg}


@pytest.mark.parametrize("name", STRATEGY_NAMES)
def test_every_strategy_builds_a_stack_and_router_config(name):
    s = builtin(name)
    spec = stack_spec_for(s, "/models/tiny")
    assert spec.prefill + spec.decode <= 3
    assert "--no-enable-prefix-caching" in spec.extra_args
    assert "--enable-prompt-tokens-details" in spec.extra_args
    ch = children(spec.kv_transfer_config)
    nixl_name = "KVTierNixlConnector" if s.leases else "NixlConnector"
    assert ch[nixl_name]["kv_buffer_device"] == "cpu"
    nixl = ch[nixl_name]["kv_connector_extra_config"]
    assert nixl["bidirectional_kv_xfer"] is s.device_retention
    assert ("KVTierConnector" in ch) is s.host_tier
    # the router accepts the strategy's settings
    RouterConfig.model_validate({"decode": ["http://127.0.0.1:1"], **s.router_settings()})


def test_recompute_and_device_ttl():
    r = builtin("recompute").kv_transfer_config()
    assert r["kv_connector"] == "NixlConnector"
    assert r["kv_connector_extra_config"] == {"bidirectional_kv_xfer": False}
    d = builtin("device-ttl", decode_ttl_s=42).kv_transfer_config()
    assert d["kv_connector_extra_config"]["decoder_kv_blocks_ttl"] == 42
    assert d["kv_connector_extra_config"]["kv_recompute_threshold"] == 64
    assert builtin("device-ttl", 42).router_settings()["decode_kv_ttl_s"] == 42


def test_host_p2p_has_no_device_retention_and_fetches_from_peers():
    s = builtin("host-p2p")
    ch = children(s.kv_transfer_config())
    assert list(ch) == ["NixlConnector", "KVTierConnector"]  # vLLM loads from the first match
    assert ch["NixlConnector"]["kv_connector_extra_config"]["bidirectional_kv_xfer"] is False
    tier = ch["KVTierConnector"]["kv_connector_extra_config"]
    assert tier["peer_fetch"] and tier["kv_events"] and tier["offload_prompt_only"] is False
    assert s.use_indexer and not s.dp_reuse


def test_tiered_short_ttl_and_scaling():
    t = builtin("tiered")
    assert t.decode_ttl_s < builtin("device-ttl").decode_ttl_s
    half = t.scaled(0.5)
    assert half.decode_ttl_s == t.decode_ttl_s / 2
    assert builtin("recompute").scaled(0.1) == builtin("recompute")
    assert t.router_settings()["ttl_margin_s"] < t.router_settings()["decode_kv_ttl_s"]
    assert t.scaled(0.001).decode_ttl_s >= 1.0


def test_adaptive_takes_thresholds_from_the_cost_model():
    cm = CostModel(kv_bytes_per_token=2048, prefill_a_s=0.01, prefill_b_s_per_token=2e-4,
                   reads={"dp_read": LinkModel(setup_s=0.02, bytes_per_s=1e9),
                          "p2p": LinkModel(setup_s=0.05, bytes_per_s=1e9)})
    rec = cm.recommend()
    a = builtin("tiered-adaptive").with_cost_model(cm)
    # vLLM's D->P threshold from the model; the peer gate is one block: the router, which
    # learns each path's cost, decides (a learning router is offered every source)
    assert (a.kv_recompute_threshold, a.min_cached_token_delta) == (
        rec.kv_recompute_threshold, cm.block_size)
    assert rec.min_cached_token_delta > cm.block_size
    assert a.router_settings()["min_cached_token_delta"] == cm.block_size
    tier = children(a.kv_transfer_config())["KVTierConnector"]["kv_connector_extra_config"]
    assert tier["min_cached_token_delta"] == cm.block_size  # the connector's gate agrees
    fixed = builtin("tiered-adaptive").model_copy(update={"cost_learn": False}).with_cost_model(cm)
    assert fixed.min_cached_token_delta == rec.min_cached_token_delta  # no learning: the model's
    assert a.kv_recompute_threshold != builtin("tiered-adaptive").kv_recompute_threshold
    nixl = children(a.kv_transfer_config())["KVTierNixlConnector"]["kv_connector_extra_config"]
    assert nixl["kv_recompute_threshold"] == rec.kv_recompute_threshold
    assert builtin("tiered").with_cost_model(cm) == builtin("tiered")  # not adaptive: unchanged


def test_parse_list_and_validation():
    assert [s.name for s in parse_list("recompute, tiered")] == ["recompute", "tiered"]
    with pytest.raises(ValueError):
        parse_list("recompute,recompute")
    with pytest.raises(ValueError):
        builtin("lru")
    with pytest.raises(ValidationError):
        StrategySpec(name="device-ttl", kv_configs=("nixl-bidirectional",), device_retention=True)
    with pytest.raises(ValidationError):
        builtin("recompute").topology(2, 2)
    assert stack_spec_for(builtin("recompute").topology(2, 1), "m").prefill == 2


def _cm(p2p_setup: float = 0.05) -> CostModel:
    return CostModel(kv_bytes_per_token=2048, prefill_a_s=0.01, prefill_b_s_per_token=2e-4,
                     reads={"dp_read": LinkModel(setup_s=0.02, bytes_per_s=1e9),
                            "p2p": LinkModel(setup_s=p2p_setup, bytes_per_s=1e9)})


def test_tiered_adaptive_deploys_decode_leases():
    s = builtin("tiered-adaptive")
    assert s.leases and s.adaptive and s.device_retention and s.host_copy
    assert s.kv_configs == ("nixl-bidirectional-lease", "kvtier-peer")
    ch = children(s.kv_transfer_config())
    assert list(ch) == ["KVTierNixlConnector", "KVTierConnector"]
    lease = ch["KVTierNixlConnector"]["kv_connector_extra_config"]
    # vLLM's TTL stays the upper bound; the NIXL knobs are set as for NixlConnector
    assert lease["bidirectional_kv_xfer"] is True
    assert lease["decoder_kv_blocks_ttl"] == 480
    assert lease["kv_recompute_threshold"] == s.kv_recompute_threshold
    assert lease["decode_lease_s"] == s.decode_lease_s and lease["lease_port_offset"] == 1001
    # without a cost model the router renews while it keeps a turn (RouterConfig refuses
    # retention: adaptive without one)
    rs = s.router_settings()
    assert rs["decode_lease_s"] == 30 and rs["host_copy"] is True
    assert "retention" not in rs and "cost_model" not in rs
    RouterConfig.model_validate({"decode": ["http://127.0.0.1:1"], **rs})
    # the other strategies have no leases
    assert not any(builtin(n).leases for n in STRATEGY_NAMES if n != "tiered-adaptive")
    with pytest.raises(ValidationError):
        StrategySpec(name="tiered", kv_configs=("nixl-unidirectional",),
                     device_retention=False, leases=True)


def test_with_cost_model_and_leases_sends_the_model_to_the_router():
    cm = _cm()
    s = builtin("tiered-adaptive")
    a = s.with_cost_model(cm, [WaitSample(w, 2000) for w in (100.0, 200.0, 300.0)])
    rec = cm.recommend()
    assert (a.kv_recompute_threshold, a.min_cached_token_delta) == (
        rec.kv_recompute_threshold, cm.block_size)  # cost_learn: the router decides p2p
    # the router decides online: waits do not remove device retention nor change the TTL
    assert a.device_retention and a.dp_reuse and a.decode_ttl_s == s.decode_ttl_s
    assert a.cost_model == cm and a.adaptive_retention
    rs = a.router_settings()
    assert rs["retention"] == "adaptive" and rs["host_copy"] is True
    cfg = RouterConfig.model_validate({"decode": ["http://127.0.0.1:1"], **rs})
    assert cfg.retention == "adaptive" and cfg.cost_model == cm and cfg.host_copy
    assert cfg.decode_kv_ttl_s == 480 and cfg.decode_lease_s == 30
    # a spec with its cost model survives the dump/validate round trip of reports and topology
    assert StrategySpec.model_validate(a.model_dump()) == a
    assert a.topology(1, 1).cost_model == cm
    # without a host copy the hold is priced against recomputing
    d = s.without_host_copy().with_cost_model(cm)
    assert d.kv_configs == ("nixl-bidirectional-lease",) and not d.host_tier
    assert not d.use_indexer and d.router_settings()["host_copy"] is False
    assert d.kv_transfer_config()["kv_connector"] == "KVTierNixlConnector"
    # a cost model without a dp_read link: nothing to hold for, the router renews
    no_dp = CostModel(kv_bytes_per_token=2048, prefill_b_s_per_token=2e-4,
                      reads={"p2p": LinkModel(setup_s=0.05, bytes_per_s=1e9)})
    assert "retention" not in s.with_cost_model(no_dp).router_settings()


def test_leases_scale_with_time_but_not_below_the_read_window():
    s = builtin("tiered-adaptive")
    half = s.scaled(0.5)
    assert half.decode_ttl_s == 240 and half.decode_lease_s == 15
    tiny = s.scaled(0.01)
    assert tiny.decode_ttl_s == pytest.approx(4.8)
    assert tiny.decode_lease_s == MIN_DECODE_LEASE_S >= 6
    assert tiny.router_settings()["decode_lease_s"] == MIN_DECODE_LEASE_S
    assert tiny.kv_transfer_config()["kv_connector_extra_config"]["connectors"][0][
        "kv_connector_extra_config"]["decode_lease_s"] == MIN_DECODE_LEASE_S
    assert s.scaled(1.0) == s


def test_the_routers_ttl_margin_leaves_room_for_vllms_read_margin() -> None:
    from kvtier.ab.strategies import VLLM_READ_MARGIN_S, router_ttl_margin_s

    assert router_ttl_margin_s(480.0) == 30.0
    assert router_ttl_margin_s(30.0) >= VLLM_READ_MARGIN_S + 3.0  # was 3 s: reads declined
    assert router_ttl_margin_s(2.0) == 1.0  # a time-scaled run: half of it
    for ttl in (0.5, 3.0, 30.0, 120.0, 480.0, 900.0):
        assert 0 < router_ttl_margin_s(ttl) < ttl


def test_cost_refit_goes_to_the_router_of_adaptive_lease_strategies_only():
    cm = _cm()
    a = builtin("tiered-adaptive").with_cost_refit().with_cost_model(cm)
    assert a.cost_refit and a.router_settings()["cost_refit"] is True
    cfg = RouterConfig.model_validate({"decode": ["http://127.0.0.1:1"], **a.router_settings()})
    assert cfg.cost_refit and cfg.cost_model == cm
    assert builtin("tiered-adaptive").with_cost_model(cm).router_settings()["cost_refit"] is False
    for name in ("host-p2p", "device-ttl", "recompute"):
        assert not builtin(name).with_cost_refit().cost_refit


def test_vllm_offload_is_vllms_cpu_tier_beside_nixl_with_no_kvtier_component():
    s = builtin("vllm-offload").with_host_bytes(1 << 30)
    ch = children(s.kv_transfer_config())
    assert list(ch) == ["NixlConnector", "OffloadingConnector"]
    assert ch["NixlConnector"]["kv_connector_extra_config"]["bidirectional_kv_xfer"] is False
    off = ch["OffloadingConnector"]
    assert "kv_connector_module_path" not in off  # vLLM's own, nothing of kvtier's
    assert off["kv_connector_extra_config"] == {"cpu_bytes_to_use": 1 << 30,
                                                "offload_prompt_only": False}
    assert not (s.host_tier or s.use_indexer or s.dp_reuse or s.device_retention)
    settings = s.router_settings()
    RouterConfig.model_validate({"decode": ["http://127.0.0.1:1"], **settings})
    assert settings == builtin("recompute").router_settings()
    assert "vllm-offload" in [x.name for x in parse_list("recompute,vllm-offload")]
    with pytest.raises(ValueError, match="alternatives"):
        StrategySpec(name="vllm-offload", kv_configs=("vllm-offload-cpu",),
                     device_retention=False, vllm_offload=True, host_tier=True)


def test_nixl_buffer_device_is_set_for_cuda_only_when_asked():
    for name in ("recompute", "tiered-adaptive", "vllm-offload"):
        spec = builtin(name)
        nixl = next(c for c in children(spec.kv_transfer_config(nixl_buffer_device="cuda"))
                    .values() if c["kv_connector"] in ("NixlConnector", "KVTierNixlConnector"))
        assert nixl["kv_buffer_device"] == "cuda"
        same = next(c for c in children(spec.kv_transfer_config()).values()
                    if c["kv_connector"] in ("NixlConnector", "KVTierNixlConnector"))
        assert same["kv_buffer_device"] == "cpu"


def test_vllm_offload_is_refused_on_the_cpu_platform(monkeypatch):
    from kvtier.devstack.platform import is_cpu_platform

    is_cpu_platform.cache_clear()
    try:
        monkeypatch.setenv("KVTIER_DEVICE", "cpu")
        with pytest.raises(ValueError, match="needs a GPU"):
            stack_spec_for(builtin("vllm-offload"), "tiny")
        is_cpu_platform.cache_clear()
        monkeypatch.setenv("KVTIER_DEVICE", "cuda")
        sspec = stack_spec_for(builtin("vllm-offload"), "tiny")
        assert children(sspec.kv_transfer_config)["NixlConnector"]["kv_buffer_device"] == "cuda"
    finally:
        is_cpu_platform.cache_clear()


def test_one_engine_per_strategy_drops_nixl_peers_and_the_decode_node():
    """``--single-engine`` (issue 29 item 3): recompute has no connector at all, kvtier's host
    tier and vLLM's offloading serve their own engine's turns, and nothing that retains on a
    decode node is offered."""
    r = builtin("recompute").single()
    assert (r.prefill, r.decode, r.single_engine) == (1, 0, True)
    assert r.kv_configs == () and r.kv_transfer_config() is None
    sspec = stack_spec_for(r, "tiny")
    assert (sspec.prefill, sspec.decode, sspec.kv_transfer_config) == (1, 0, None)
    assert "--no-enable-prefix-caching" in sspec.extra_args  # history only from a tier
    h = builtin("host-p2p").with_host_bytes(1 << 28).single()
    cfg = h.kv_transfer_config()
    assert cfg["kv_connector"] == "KVTierConnector"  # alone: no MultiConnector, no Nixl
    extra = cfg["kv_connector_extra_config"]
    assert extra["peer_fetch"] is False and extra["cpu_bytes_to_use"] == 1 << 28
    assert h.host_tier and not (h.use_indexer or h.peer_fetch)
    o = builtin("vllm-offload").single()
    assert o.kv_transfer_config()["kv_connector"] == "OffloadingConnector"
    for name in ("device-ttl", "tiered", "tiered-adaptive"):
        with pytest.raises(ValueError, match="decode node"):
            builtin(name).single()
    with pytest.raises(ValidationError, match="needs a decode instance"):
        builtin("recompute").topology(1, 0)
    with pytest.raises(ValidationError, match="one engine per strategy"):
        StrategySpec.model_validate({**r.model_dump(), "decode": 1})
