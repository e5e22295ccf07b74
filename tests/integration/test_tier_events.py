"""The host tier's KV events on real ZMQ, decoded with vLLM's own structs."""

from __future__ import annotations

import msgspec
import pytest
import zmq

from kvtier.ids import EngineBlockHash, RequestKey
from kvtier.runtime import free_ports
from kvtier.tier.events import TierEventPublisher
from kvtier.tier.manager import BlockMeta, HostTier
from kvtier.wire.kv_events import END_SEQ

pytestmark = pytest.mark.integration


def _subscribed(pub: TierEventPublisher, sub: zmq.Socket) -> int:
    """Publish probe batches until ``sub`` receives them (a PUB drops what it sends before
    the subscription has reached it; no fixed sleep is long enough on a loaded machine);
    the last probe's seq."""
    probe = HostTier(1, 64)
    for i in range(100):
        job = probe.prepare_store([RequestKey(10_000 + i)])
        probe.complete_store(job.job_id, True)
        pub.publish(probe.take_events(), block_size=4)
        if sub.poll(100):
            break
    else:
        raise AssertionError("the subscription never reached the publisher")
    last = -1
    while sub.poll(300):  # probes still on their way
        last = int.from_bytes(sub.recv_multipart()[1], "big")
    return last


def test_publish_and_replay_vllm_format():
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

    pub_port, replay_port = free_ports(2)
    pub = TierEventPublisher(f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}",
                             "kv@p0-cpu")
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{pub_port}")
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@p0-cpu")
    try:
        seq0 = _subscribed(pub, sub) + 1
        tier = HostTier(1, 64)
        metas = [BlockMeta(token_ids=tuple(range(4)), engine_hash=EngineBlockHash(111))]
        job = tier.prepare_store([RequestKey(7)], metas)
        tier.complete_store(job.job_id, True)
        job = tier.prepare_store([RequestKey(8)])  # evicts 7 (REMOVED), no engine hash
        tier.complete_store(job.job_id, True)
        tier.clear()
        pub.publish(tier.take_events(), block_size=4)

        assert sub.poll(5000)
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv@p0-cpu" and int.from_bytes(seq, "big") == seq0
        batch = msgspec.msgpack.decode(payload, type=KVEventBatch)
        kinds = [type(e) for e in batch.events]
        assert kinds == [BlockStored, BlockRemoved, BlockStored, AllBlocksCleared]
        stored = batch.events[0]
        assert stored.block_hashes == [111] and stored.medium == "CPU"
        assert stored.token_ids == [0, 1, 2, 3] and stored.block_size == 4
        assert batch.events[1].block_hashes == [111]
        assert batch.events[2].block_hashes == [8]  # RequestKey when no engine hash

        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{replay_port}")
        dealer.send_multipart([b"", seq0.to_bytes(8, "big")])
        assert dealer.poll(5000)
        # vLLM's replay frames: (b"", topic, seq, payload), then (b"", b"", END, b"")
        _, rtopic, rseq, rpayload = dealer.recv_multipart()
        assert rtopic == b"kv@p0-cpu"
        assert int.from_bytes(rseq, "big") == seq0 and rpayload == payload
        assert dealer.poll(5000)
        assert dealer.recv_multipart() == [b"", b"", END_SEQ.to_bytes(8, "big"), b""]
        dealer.close(linger=0)
    finally:
        sub.close(linger=0)
        pub.close()
