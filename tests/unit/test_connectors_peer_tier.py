"""kvtier's peer fetch as a vLLM secondary tier (kvtier.connectors.peer_tier): vLLM's own
tier interface (0.32 here), two tiers, real NIXL over DRAM; only the spec is a stand-in
(tests/fakes/offloading.py)."""

from __future__ import annotations

import time

import numpy as np
import pytest

tiering = pytest.importorskip("vllm.v1.kv_offload.tiering.base")
nixl = pytest.importorskip("nixl")

from vllm.v1.kv_offload.base import LookupResult, ReqContext  # noqa: E402

from kvtier.connectors.peer_tier import KVTierPeerTier  # noqa: E402
from kvtier.runtime import free_ports  # noqa: E402
from tests.fakes.offloading import offloading_spec  # noqa: E402

ROW = 2048


def _job(job_id: int, keys: list[bytes], rows: list[int], ctx: ReqContext):
    cls = getattr(tiering, "TransferJob", None) or tiering.JobMetadata
    field = "chunk_ids" if hasattr(cls, "__dataclass_fields__") and \
        "chunk_ids" in cls.__dataclass_fields__ else "block_ids"
    return cls(job_id=job_id, keys=keys, is_promotion=False, req_context=ctx,
               **{field: np.array(rows, dtype=np.int64)})


def _tier(view: np.ndarray, port: int | None) -> KVTierPeerTier:
    return KVTierPeerTier(offloading_spec(), memoryview(view), "kvtier-peer",
                          cpu_bytes_to_use=64 * ROW, p2p_port=port, min_cached_token_delta=16)


def test_a_second_engine_pulls_the_first_ones_blocks_through_vllms_tier_calls():
    rng = np.random.default_rng(0)
    a_rows = rng.integers(0, 255, size=(16, ROW), dtype=np.uint8)
    b_rows = np.zeros((16, ROW), dtype=np.uint8)
    port = free_ports(1)[0]
    a, b = _tier(a_rows, port), _tier(b_rows, None)
    keys = [bytes([i]) * 32 + (0).to_bytes(4, "big") for i in range(6)]
    try:
        a.submit_store(_job(1, keys, list(range(6)), ReqContext("t1")))
        a.drain_jobs()
        assert [(r.job_id, r.success) for r in a.get_finished_jobs()] == [(1, True)]
        assert a.lookup(keys[0], ReqContext("t1")) is LookupResult.HIT

        ctx = ReqContext("t2", kv_transfer_params={"remote_kv_source": {
            "pod": "a", "host": "127.0.0.1", "port": port, "num_tokens": 6 * 16}})
        assert b.lookup(keys[0], ReqContext("t2")) is LookupResult.MISS  # no peer named
        assert [b.lookup(k, ctx) for k in keys] == [LookupResult.RETRY] * 6
        b.on_schedule_end(None)
        deadline = time.monotonic() + 20
        while b.has_pending_work() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [b.lookup(k, ctx) for k in keys] == [LookupResult.HIT] * 6
        b.submit_load(_job(2, keys, [8, 9, 10, 11, 12, 13], ctx))
        b.drain_jobs()
        assert [(r.job_id, r.success) for r in b.get_finished_jobs()] == [(2, True)]
        assert np.array_equal(b_rows[8:14], a_rows[0:6])
        b.on_request_finished(ctx)
    finally:
        a.shutdown()
        b.shutdown()


def test_vllm_finds_the_tier_by_its_type_name():
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    import kvtier.connectors

    kvtier.connectors.register()
    kvtier.connectors.register()  # idempotent
    assert SecondaryTierFactory.get_tier_class({"type": "kvtier-peer"}) is KVTierPeerTier
