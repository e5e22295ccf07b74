"""The one reuse gate: router, indexer and engine agree at the boundary of
``min_cached_token_delta`` (delta = threshold - 1, threshold, threshold + 1), and at a
threshold of 0 (a pull of nothing is never worth it), because all three call
``kvtier.reuse_gate.gains_enough``.

Each side is driven through its own code path, not through the gate function: the router's
``Route.source_for``, the indexer's ``choose_source`` (what ``/v1/source`` and ``/v1/route``
answer) and the host tier scheduler's ``pull_from_peer`` (the engine's defensive check).
"""

from __future__ import annotations

import pytest

from kvtier.ids import PodId, Tier
from kvtier.indexer.select import choose_source
from kvtier.reuse_gate import DEFAULT_MIN_CACHED_TOKEN_DELTA, gains_enough
from kvtier.router.config import RouterConfig
from kvtier.router.indexer_client import Route
from kvtier.tier.config import HostTierConfig
from kvtier.tier.scheduler import TierScheduler
from kvtier.tier.spec import HostTierSpec, KVGeometry
from kvtier.transfer_params import RemoteKVSource
from kvtier.wire.indexer_api import Source
from tests.fakes.peer import RecordingPeer

TARGET, PEER = PodId("prefill-0"), PodId("peer-1")
HELD = 8  # tokens the target already holds (block size 1 so any delta is expressible)


def _router(threshold: int, gain: int) -> bool:
    route = Route(matched={TARGET: HELD, PEER: HELD + gain},
                  best=Source(pod=PEER, tier="CPU", matched_tokens=HELD + gain,
                              p2p_host="127.0.0.1", p2p_port=7000))
    return route.source_for(TARGET, threshold, "m", 1) is not None


def _indexer(threshold: int, gain: int) -> bool:
    merged = {(TARGET, Tier.GPU): HELD, (PEER, Tier.CPU): HELD + gain}
    choice = choose_source(merged, 1, TARGET, threshold, lambda _p: ("127.0.0.1", 7000),
                           lambda _p: True)
    return choice.source is not None


def _engine(threshold: int, gain: int) -> bool:
    spec = HostTierSpec(HostTierConfig(cpu_bytes_to_use=64 * 1024,
                                       min_cached_token_delta=threshold),
                        KVGeometry(1, 1024, 64, ("l0",), "x"), engine_id="e-gate",
                        engine_model="tiny-llama")
    base = spec.get_scheduler()
    try:
        peer = RecordingPeer()
        sched = TierScheduler(base.tier, base.hasher, 1, peer=peer,  # type: ignore[arg-type]
                              min_cached_token_delta=base.min_cached_token_delta)
        prompt = list(range(1, HELD + gain + 3))
        sched.pull_from_peer(RemoteKVSource(pod=PEER, host="127.0.0.1", port=9,
                                            num_tokens=HELD + gain), prompt, HELD)
        return bool(peer.fetched)
    finally:
        base.close()


@pytest.mark.parametrize("threshold", [0, 1, 5, 64])
@pytest.mark.parametrize("offset", [-1, 0, 1], ids=["threshold-1", "threshold", "threshold+1"])
def test_router_indexer_and_engine_agree_at_the_boundary(threshold: int, offset: int) -> None:
    gain = threshold + offset
    want = gains_enough(gain, threshold)
    assert want == (gain >= max(threshold, 1))
    assert (_router(threshold, gain), _indexer(threshold, gain), _engine(threshold, gain)) \
        == (want, want, want)


def test_one_default_everywhere() -> None:
    from kvtier.indexer.config import IndexerConfig

    assert DEFAULT_MIN_CACHED_TOKEN_DELTA == 1
    assert RouterConfig.model_fields["min_cached_token_delta"].default \
        == DEFAULT_MIN_CACHED_TOKEN_DELTA
    assert IndexerConfig().min_cached_token_delta == DEFAULT_MIN_CACHED_TOKEN_DELTA
    assert HostTierConfig().min_cached_token_delta == DEFAULT_MIN_CACHED_TOKEN_DELTA
