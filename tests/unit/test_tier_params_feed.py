"""The decode node's connector config, parsed once: ParamsFeedConfig, DecodeLeases, NixlKnobs."""

from __future__ import annotations

import socket

import pytest
from pydantic import ValidationError

from kvtier.runtime import free_ports
from kvtier.tier.env import InstanceEnv
from kvtier.tier.params_feed import DecodeLeases, NixlKnobs, ParamsFeedConfig

NIXL = {"bidirectional_kv_xfer": True, "kv_recompute_threshold": 64,
        "decoder_kv_blocks_ttl": 480}


def resolve(extra: dict, env: dict) -> ParamsFeedConfig:
    return ParamsFeedConfig.from_extra_config(extra).resolved(env)


def test_nixls_own_keys_are_left_to_nixl():
    cfg = ParamsFeedConfig.from_extra_config({**NIXL, "params_feed_port_offset": 1000})
    assert cfg.params_feed_port_offset == 1000 and cfg.decode_lease_s == 0


def test_endpoint_precedence_key_then_env_then_offset():
    side = {InstanceEnv.NIXL_SIDE_CHANNEL_PORT: "5600"}
    both = {"params_feed_endpoint": "tcp://*:1", "params_feed_port_offset": 10,
            "lease_endpoint": "tcp://*:2", "lease_port_offset": 11}
    env = {**side, InstanceEnv.PARAMS_FEED_PORT: "7", InstanceEnv.LEASE_PORT: "8"}
    r = resolve(both, env)
    assert (r.params_feed_endpoint, r.lease_endpoint) == ("tcp://*:1", "tcp://*:2")
    offsets = {"params_feed_port_offset": 10, "lease_port_offset": 11}
    r = resolve(offsets, env)
    assert (r.params_feed_endpoint, r.lease_endpoint) == ("tcp://*:7", "tcp://*:8")
    r = resolve(offsets, side)
    assert (r.params_feed_endpoint, r.lease_endpoint) == ("tcp://*:5610", "tcp://*:5611")
    r = resolve({}, side)
    assert (r.params_feed_endpoint, r.lease_endpoint) == (None, None)


@pytest.mark.parametrize("bad", [-1, True, "30", None])
def test_decode_lease_must_be_seconds(bad):
    with pytest.raises(ValidationError, match="decode_lease_s must be a number of seconds"):
        ParamsFeedConfig.from_extra_config({"decode_lease_s": bad})


def test_leases_on_need_a_server_address():
    with pytest.raises(ValueError, match="lease server has no address"):
        resolve({"decode_lease_s": 30}, {})
    assert resolve({"decode_lease_s": 0}, {}).lease_endpoint is None


def test_a_misspelt_knob_cannot_pass():
    with pytest.raises(ValidationError):
        ParamsFeedConfig(decode_lease=30)  # type: ignore[call-arg]
    with pytest.raises(ValidationError):
        NixlKnobs(bidirectional_kv_xfer=True, decoder_kv_blocks_tl=30)  # type: ignore[call-arg]
    assert NixlKnobs(bidirectional_kv_xfer=False).model_dump() == {
        "bidirectional_kv_xfer": False, "decoder_kv_blocks_ttl": None,
        "kv_recompute_threshold": None}


def _port_pair() -> int:
    """A free port whose next port is free too (the lease metrics listen on port + 1)."""
    for _ in range(50):
        (port,) = free_ports(1)
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair")


def test_decode_leases_start_from_the_resolved_config():
    port = _port_pair()
    assert DecodeLeases.start(resolve({}, {})) is None
    cfg = resolve({"decode_lease_s": 20, "lease_endpoint": f"tcp://127.0.0.1:{port}"},
                  {InstanceEnv.POD_NAME: "decode-3"})
    assert cfg.pod == "decode-3"
    leases = DecodeLeases.start(cfg)
    assert leases is not None
    try:
        assert leases.table.default_lease_s == 20
        assert leases.server.endpoint == f"tcp://127.0.0.1:{port}"
        assert leases.metrics.port == port + 1
        # the request's own lease wins when it is a positive number, else the default
        assert leases.grant("a", 2, bound=1e12, asked=5) < leases.grant("b", 2, 1e12, "x")
    finally:
        leases.close()


def test_idle_steps_are_slowed_by_default_on_the_cpu_only_and_the_knob_is_checked():
    unset = ParamsFeedConfig()
    assert unset.retained_idle_step_ms is None
    assert unset.idle_step_s(cpu_platform=True) == 0.005
    assert unset.idle_step_s(cpu_platform=False) == 0.0
    off = ParamsFeedConfig.from_extra_config({"retained_idle_step_ms": 0})
    assert off.idle_step_s(cpu_platform=True) == 0.0
    ten = ParamsFeedConfig.from_extra_config({"retained_idle_step_ms": 10})
    assert ten.idle_step_s(cpu_platform=False) == 0.01
    for bad in (-1, True, "5"):
        with pytest.raises(ValidationError, match="retained_idle_step_ms must be a number of milliseconds"):
            ParamsFeedConfig.from_extra_config({"retained_idle_step_ms": bad})
