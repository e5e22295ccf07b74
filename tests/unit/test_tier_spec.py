"""HostTierSpec: one factory makes both halves of the host tier, every field at construction."""

from __future__ import annotations

import pytest

from kvtier.reuse_gate import DEFAULT_MIN_CACHED_TOKEN_DELTA
from kvtier.runtime import free_ports
from kvtier.tier.config import HostTierConfig
from kvtier.tier.scheduler import TierScheduler
from kvtier.tier.spec import HostTierSpec, KVGeometry, check_block_size
from kvtier.transfer_params import RemoteKVSource
from tests.fakes.peer import RecordingPeer

GEOMETRY = KVGeometry(block_size=4, slot_bytes=1024, num_blocks=16,
                      layer_names=("l0", "l1"), layout="test|bs4")


def _spec(**cfg: object) -> HostTierSpec:
    return HostTierSpec(HostTierConfig.model_validate({"cpu_bytes_to_use": 8 * 1024, **cfg}),
                        GEOMETRY, engine_id="e0", engine_model="/models/tiny-llama")


def test_the_scheduler_half_is_built_whole_from_the_config():
    spec = _spec(min_cached_token_delta=64, offload_prompt_only=True, lease_s=7.0)
    sched = spec.get_scheduler()
    try:
        assert isinstance(sched, TierScheduler)
        assert sched.min_cached_token_delta == 64 and sched.offload_prompt_only
        assert sched.peer is None and sched.events is None and sched.services == ()
        assert sched.tier.num_slots == 8 and sched.tier.slot_bytes == 1024
        assert sched.block_size == 4 and sched.hasher.model == "tiny-llama"
        assert spec.pool_tag == "e0-tp0of1" and spec.num_slots == 8
    finally:
        sched.close()


def test_the_default_gate_is_the_one_reuse_gate_default():
    assert HostTierConfig().min_cached_token_delta == DEFAULT_MIN_CACHED_TOKEN_DELTA
    sched = _spec().get_scheduler()
    assert sched.min_cached_token_delta == DEFAULT_MIN_CACHED_TOKEN_DELTA
    sched.close()


def test_metrics_are_a_service_the_scheduler_closes():
    port = free_ports(1)[0]
    sched = _spec(metrics_port=port).get_scheduler()
    assert len(sched.services) == 1
    sched.close()


@pytest.mark.parametrize("gain,pulls", [(4, False), (5, True), (6, True)],
                         ids=["threshold-1", "threshold", "threshold+1"])
def test_the_engine_gates_a_peer_pull_at_the_threshold(gain, pulls):
    """min_cached_token_delta = 5, block size 1, nothing local: the scheduler pulls a
    source's prefix only when it gains 5 tokens or more (kvtier.reuse_gate.gains_enough)."""
    spec = HostTierSpec(HostTierConfig(cpu_bytes_to_use=8 * 1024, min_cached_token_delta=5),
                        KVGeometry(1, 1024, 16, ("l0",), "x"), engine_id="e1",
                        engine_model="tiny-llama")
    sched = spec.get_scheduler()
    peer = RecordingPeer()
    gated = TierScheduler(sched.tier, sched.hasher, 1, peer=peer,  # type: ignore[arg-type]
                          min_cached_token_delta=sched.min_cached_token_delta)
    src = RemoteKVSource(pod="p", host="127.0.0.1", port=9, num_tokens=gain)
    gated.pull_from_peer(src, list(range(1, 20)), 0)
    assert peer.fetched == ([gain] if pulls else [])
    sched.close()


def test_the_worker_half_shares_the_specs_pin_registry():
    torch = pytest.importorskip("torch")
    spec = _spec()
    w1, w2 = spec.get_worker(), spec.get_worker()
    try:
        assert w1.pins is w2.pins
        assert (w1.pool_tag, w1.num_slots, w1.slot_bytes, w1.num_blocks, w1.layer_names) == \
            ("e0-tp0of1", 8, 1024, 16, ("l0", "l1"))
        kv = {n: torch.zeros(16, 512, dtype=torch.uint8) for n in GEOMETRY.layer_names}
        w1.register_kv_caches(kv)
        assert w1.pool is not None and w1.pins.ranges() == {}  # CPU tensors: nothing pinned
    finally:
        w1.close()
        w2.close()


def test_block_size_must_be_the_engines():
    assert check_block_size(HostTierConfig(), 32) == 32
    assert check_block_size(HostTierConfig(block_size=32), 32) == 32
    with pytest.raises(ValueError, match="must be equal"):
        check_block_size(HostTierConfig(block_size=16), 32)
