"""The host tier's KV events, in vLLM's wire format, on the tier's own ZMQ sockets.

Wire (identical to ``vllm/distributed/kv_events.py`` in 0.32, so the kvtier
indexer's subscriber consumes it unchanged):

- PUB multipart ``(topic, seq as 8-byte big-endian, payload)``;
- ``payload`` = msgpack of the array ``[ts, events, data_parallel_rank]``;
- each event a map tagged ``"type"``: ``BlockStored`` (``medium: "CPU"``,
  ``token_ids`` always included), ``BlockRemoved``, ``AllBlocksCleared``;
  fields at their default are omitted;
- a ROUTER replay socket answers a DEALER ``[b"", seq8]`` with every buffered
  batch from ``seq`` on as ``[b"", topic, seq8, payload]``, then
  ``[b"", b"", END_SEQ8, b""]`` (vLLM's ``ZmqEventPublisher._service_replay``).

Block identity: ``block_hashes`` carry the *engine* block hash (the same value
vLLM's own GPU-medium events carry) when the connector knew it, else the
kvtier ``RequestKey``; ``parent_block_hash`` follows the same rule. Token ids
are always present, so a consumer can key blocks its own way.

Threading model: ``publish()`` may be called from any one thread; it only
enqueues. A daemon thread owns both sockets (ZMQ sockets are not
thread-safe) and serves replay requests between sends.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence

import msgspec
import zmq

from kvtier.ids import Tier
from kvtier.tier.manager import TierEvent, TierEventKind
from kvtier.wire.kv_events import (
    END_SEQ,
    BatchOut,
    ClearedOut,
    EventOut,
    RemovedOut,
    StoredOut,
)

log = logging.getLogger(__name__)
def to_wire_events(events: Sequence[TierEvent], block_size: int) -> list[EventOut]:
    """Translate tier events into vLLM event structs (one BlockStored per block)."""
    out: list[EventOut] = []
    cpu = Tier.CPU.value
    for ev in events:
        if ev.kind is TierEventKind.STORED:
            for key, meta in zip(ev.keys, ev.metas):
                h = meta.engine_hash if meta.engine_hash is not None else key
                parent = (meta.parent_engine_hash if meta.parent_engine_hash is not None
                          else meta.parent_key)
                out.append(StoredOut([int(h)], None if parent is None else int(parent),
                                       list(meta.token_ids), block_size, None, cpu, None))
        elif ev.kind is TierEventKind.REMOVED:
            hashes = [int(m.engine_hash if m.engine_hash is not None else k)
                      for k, m in zip(ev.keys, ev.metas)]
            out.append(RemovedOut(hashes, cpu))
        else:
            out.append(ClearedOut())
    return out


class TierEventPublisher:
    """ZMQ PUB + replay ROUTER, vLLM-compatible. ``close()`` stops the thread."""

    def __init__(self, endpoint: str, replay_endpoint: str | None, topic: str,
                 buffer_steps: int = 10000, data_parallel_rank: int = 0):
        self.topic = topic.encode()
        self.dp_rank = data_parallel_rank
        self._q: queue.Queue = queue.Queue()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = 0
        self._stop = threading.Event()
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._endpoint, self._replay_endpoint = endpoint, replay_endpoint
        self._ready = threading.Event()
        self._error: Exception | None = None
        self._thread = threading.Thread(target=self._run, name="kvtier-tier-events", daemon=True)
        self._thread.start()
        self._ready.wait(10)
        if self._error is not None:
            raise self._error

    def publish(self, events: Sequence[TierEvent], block_size: int) -> None:
        wire = to_wire_events(events, block_size)
        if wire:
            self._q.put(BatchOut(time.time(), wire, self.dp_rank))

    def _run(self) -> None:
        try:
            pub = self._ctx.socket(zmq.PUB)
            pub.bind(self._endpoint)
            router = None
            if self._replay_endpoint:
                router = self._ctx.socket(zmq.ROUTER)
                router.bind(self._replay_endpoint)
        except Exception as e:  # surfaced to the constructor
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        enc = msgspec.msgpack.Encoder()
        poller = zmq.Poller()
        if router is not None:
            poller.register(router, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                try:
                    batch = self._q.get(timeout=0.02)
                except queue.Empty:
                    batch = None
                if batch is not None:
                    payload = enc.encode(batch)
                    seq = self._seq
                    self._seq += 1
                    self._buffer.append((seq, payload))
                    pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
                if router is not None and poller.poll(0):
                    self._serve_replay(router)
        finally:
            pub.close(linger=0)
            if router is not None:
                router.close(linger=0)

    def _serve_replay(self, router: zmq.Socket) -> None:
        frames = router.recv_multipart()
        if len(frames) != 3:
            log.warning("tier events: bad replay request with %d frames", len(frames))
            return
        client_id, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in self._buffer:
            if seq >= start_seq:
                router.send_multipart([client_id, b"", self.topic, seq.to_bytes(8, "big"),
                                       payload])
        router.send_multipart([client_id, b"", b"", END_SEQ.to_bytes(8, "big"), b""])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
