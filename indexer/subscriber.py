"""ZMQ subscription to every KV-event stream, with replay, gap and health accounting.

A pod may have several streams (engine + host tier, DP ranks; see
``kvtier.indexer.config``); everything here is per *stream*, keyed by its
stream id, which is also the holder name its blocks are indexed under.

Per stream: one SUB socket on the pod's PUB endpoint (with a socket monitor, so
"connected" is what TCP says, not a guess) and, if the pod has a replay
endpoint, one DEALER to vLLM's replay ROUTER. vLLM's replay protocol:
request ``[b"", seq8]``; answer: one ``[b"", topic, seq8, payload]`` per
buffered batch with seq >= the request, then ``[b"", b"", 0xff*8, b""]``.

Sequence tracking (``PodState.last_seq``, the last batch handed to the index):

- start, reconnect (monitor CONNECTED), a jump ahead in seq: replay from
  ``last_seq + 1`` (or 0); live batches that arrive meanwhile wait in
  ``pending`` and are merged in seq order when the replay ends.
- ``gaps`` counts discontinuities seen (a jump ahead, or a replay that starts
  later than asked because the pod's buffer wrapped), recovered or not;
  ``missing`` counts the batches nobody could supply. The index goes on.
- a *live* batch with seq <= last_seq means the publisher restarted (vLLM
  counts from 0 per process): the pod is cleared and replayed from 0.
- frames that cannot be decoded are counted in ``malformed`` and skipped;
  when their seq frame was readable the seq still counts as consumed.
- a replay that is not answered within ``replay_timeout_s`` (a pod that never
  answers) is abandoned: the DEALER is recreated (so late answers are not
  mistaken for new ones) and the wait is counted in ``replay_timeouts``.
- health: ``down_since`` is when the stream last lost its PUB (or was added;
  a silent host is noticed by ZMTP heartbeats within ``HEARTBEAT_TIMEOUT_MS``);
  it is cleared once the stream is connected *and* its replay is done, so a
  pod that comes back is offered again only after it has caught up.
- index backend down (``BackendUnavailable`` from a worker): the worker stops
  applying that stream and records the first seq it could not apply; the I/O
  thread then (at most once per ``resync_backoff_s``) starts a new *epoch*,
  rewinds ``last_seq`` and replays from there. Batches of an older epoch
  still queued are dropped, so a stream is never applied out of order.

Threading model: one I/O thread owns every ZMQ socket (pyzmq sockets are not
thread-safe) and does the sequence bookkeeping; it hands decoded batches to
``apply_workers`` threads, a pod's streams always to the same worker (shard
by a stable hash of the pod name), so each stream is applied in order and
pods are independent. A worker writes only ``resync_from``/``resync_clear``
and ``applied_seq`` of a stream; the I/O thread everything else. ``add_pod``/``remove_pod`` may be called from any
thread; they are queued to the I/O thread.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
import zlib
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Literal

import zmq

from kvtier.ids import ModelName, PodId
from kvtier.indexer.config import PodSpec
from kvtier.indexer.fastdecode import decode_frames
from kvtier.indexer.index import BackendUnavailable
from kvtier.indexer.ingest import EventApplier, PodCounters
from kvtier.wire.kv_events import END_SEQ, EventBatch, MalformedFrame, decode_seq

log = logging.getLogger(__name__)

_POLL_MS = 50
# ZMTP heartbeats on every SUB: a publisher whose host vanished (power off, partition)
# sends no FIN, so without them TCP would look connected for many minutes. libzmq answers
# PINGs by itself, so vLLM's PUB needs no setting for this.
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 3000
# A connect to an unreachable host is abandoned after this and retried (the OS default
# retries one SYN for ~2 minutes, so a host that comes back would wait that long).
CONNECT_TIMEOUT_MS = 2000


class _Clear(Enum):
    CLEAR = "clear"


_CLEAR = _Clear.CLEAR  # worker command: clear the pod (publisher restarted)
_MONITOR_EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED


@dataclass
class PodState:
    """One event stream of a pod (named ``PodState`` since a pod used to have one)."""

    spec: PodSpec
    model: ModelName
    last_seq: int = -1            # -1: nothing received yet
    applied_seq: int = -1         # last seq the worker applied (snapshots)
    connected: bool = False
    ever_connected: bool = False
    gaps: int = 0
    missing: int = 0
    malformed: int = 0
    replays: int = 0
    replay_timeouts: int = 0
    restarts: int = 0
    foreign_topic: int = 0
    counters: PodCounters = field(default_factory=PodCounters)
    removed: bool = False
    down_since: float | None = field(default_factory=time.monotonic)  # None: live, caught up
    epoch: int = 0                # bumped by each resync after a backend failure
    resync_from: int | None = None  # worker: first seq it could not apply (backend down)
    resync_clear: bool = False    # worker: a clear could not be applied either
    resyncs: int = 0
    # I/O-thread private:
    replay_deadline: float | None = None
    gap_open: bool = False        # a detected gap is being replayed (counted once)
    pending: list[EventBatch] = field(default_factory=list)

    @property
    def name(self) -> PodId:
        """The stream id: the holder name in the index, the key in ``Subscriber.streams``."""
        return self.spec.stream_id

    @property
    def pod(self) -> PodId:
        return self.spec.name

    def stale(self, now: float, after_s: float) -> bool:
        d = self.down_since
        return d is not None and now - d > after_s

    @property
    def replaying(self) -> bool:
        return self.replay_deadline is not None


_Role = Literal["sub", "mon", "replay"]
_Socks = tuple[zmq.SyncSocket, zmq.SyncSocket, zmq.SyncSocket | None]  # SUB, its monitor, DEALER
# An apply worker's queue: (stream, batch to apply or _CLEAR, epoch), or None to stop it.
_WorkQueue = queue.Queue[tuple[PodState, EventBatch | Literal[_Clear.CLEAR], int] | None]


class Subscriber:
    def __init__(self, applier: EventApplier, default_model: ModelName, apply_workers: int = 2,
                 replay_timeout_s: float = 3.0, max_pending: int = 100_000,
                 ctx: zmq.SyncContext | None = None, resync_backoff_s: float = 1.0) -> None:
        self.applier = applier
        self.default_model = default_model
        self.replay_timeout_s = replay_timeout_s
        self.max_pending = max_pending
        self.resync_backoff_s = resync_backoff_s
        self._last_resync: dict[PodId, float] = {}
        self._ctx = ctx or zmq.Context()
        self._own_ctx = ctx is None
        self.streams: dict[PodId, PodState] = {}   # by stream id
        self.substreams = 0   # streams named NAME#S (a pod's second, third, ...)
        # pod -> its streams; replaced (never mutated) on add/remove, so readers on other
        # threads see a whole tuple without a lock
        self._by_pod: dict[PodId, tuple[PodState, ...]] = {}
        self._socks: dict[PodId, _Socks] = {}
        self._by_sock: dict[zmq.SyncSocket, tuple[PodId, _Role]] = {}
        self._cmds: deque[tuple[Literal["add", "remove"], PodState]] = deque()
        self._queues: list[_WorkQueue] = [queue.Queue() for _ in range(apply_workers)]
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._poller = zmq.Poller()

    # -- public, any thread --------------------------------------------------------------

    def start(self) -> None:
        self._threads = [threading.Thread(target=self._io_loop, name="kvtier-indexer-io",
                                          daemon=True)]
        for i, q in enumerate(self._queues):
            self._threads.append(threading.Thread(target=self._worker, args=(q,),
                                                  name=f"kvtier-indexer-apply-{i}", daemon=True))
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for q in self._queues:
            q.put(None)
        for t in self._threads:
            t.join(timeout=5)
        for name in list(self._socks):
            self._close(name)
        if self._own_ctx:
            self._ctx.term()

    def add_pod(self, spec: PodSpec, last_seq: int = -1) -> PodState:
        """Subscribe to one stream of a pod; ``last_seq`` >= 0 resumes after a snapshot."""
        if spec.stream_id in self.streams:
            raise ValueError(f"stream {spec.stream_id!r} already subscribed")
        st = PodState(spec=spec, model=spec.model or self.default_model,
                      last_seq=last_seq, applied_seq=last_seq)
        self.streams[spec.stream_id] = st
        self._by_pod[spec.name] = (*self._by_pod.get(spec.name, ()), st)
        if spec.stream is not None:
            self.substreams += 1
        self._cmds.append(("add", st))
        return st

    def remove_pod(self, name: PodId) -> list[PodState]:
        """Unsubscribe every stream of pod ``name`` and forget their blocks."""
        gone = [st for st in list(self.streams.values()) if st.pod == name]
        for st in gone:
            self.remove_stream(st.name)
        return gone

    def remove_stream(self, stream_id: PodId) -> PodState | None:
        st = self.streams.pop(stream_id, None)
        if st is not None:
            st.removed = True
            rest = tuple(o for o in self._by_pod.get(st.pod, ()) if o is not st)
            if rest:
                self._by_pod[st.pod] = rest
            else:
                self._by_pod.pop(st.pod, None)
            if st.spec.stream is not None:
                self.substreams -= 1
            self._cmds.append(("remove", st))
        return st

    def streams_of(self, pod: PodId) -> tuple[PodState, ...]:
        return self._by_pod.get(pod, ())

    def drain(self, timeout: float = 10.0) -> None:
        """Wait until every batch received so far has been applied (tests, snapshots)."""
        deadline = time.monotonic() + timeout
        for q in self._queues:
            while q.unfinished_tasks and time.monotonic() < deadline:
                time.sleep(0.005)

    # -- I/O thread ------------------------------------------------------------------------

    def _io_loop(self) -> None:
        while not self._stop.is_set():
            while self._cmds:
                op, target = self._cmds.popleft()
                try:
                    self._open(target) if op == "add" else self._close(target.name, target)
                except zmq.ZMQError as e:
                    log.error("pod %s: %s failed: %s", target.name, op, e)
            try:
                ready = dict(self._poller.poll(_POLL_MS))
            except zmq.ZMQError:
                if self._stop.is_set():
                    return
                raise
            for sock in ready:
                owner = self._by_sock.get(sock)
                if owner is None:
                    continue
                name, role = owner
                st = self.streams.get(name)
                if st is None:
                    continue
                try:
                    if role == "sub":
                        self._on_sub(st, sock)
                    elif role == "mon":
                        self._on_monitor(st, sock)
                    else:
                        self._on_replay(st, sock)
                except Exception:  # never let one pod kill the loop
                    log.exception("pod %s: error handling %s socket", name, role)
            now = time.monotonic()
            for st in list(self.streams.values()):
                if st.replay_deadline is not None and now > st.replay_deadline:
                    log.warning("pod %s: replay not answered in %.1fs", st.name,
                                self.replay_timeout_s)
                    st.replay_timeouts += 1
                    self._reset_dealer(st)
                    self._finish_replay(st)
                if st.resync_from is not None and \
                        now - self._last_resync.get(st.name, 0.0) >= self.resync_backoff_s:
                    self._last_resync[st.name] = now
                    self._resync(st)

    def _resync(self, st: PodState) -> None:
        """The index backend failed while applying ``st``: replay from the first batch it
        could not apply (from 0, after a clear, if a clear failed too)."""
        frm = st.resync_from if st.resync_from is not None else 0
        st.epoch += 1               # first: the worker drops what it still has queued
        st.resync_from = None
        st.resyncs += 1
        if st.resync_clear:
            st.resync_clear = False
            frm = 0
            st.applied_seq = -1     # what the index holds of it now (saved by replicas)
            self._queue_for(st).put((st, _CLEAR, st.epoch))
        log.warning("pod %s: index backend failed; replaying from seq %d", st.name, frm)
        st.last_seq = frm - 1
        st.pending = []
        st.gap_open = True          # not a publisher gap: not counted in ``gaps``
        if st.replaying:
            st.replay_deadline = None
            self._reset_dealer(st)  # late answers to the old request are dropped
        if self._socks[st.name][2] is not None:
            self._request_replay(st)
        else:
            st.gap_open = False     # no replay: the next live batch counts what is lost

    def _open(self, st: PodState) -> None:
        name = st.name
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        sub.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        sub.setsockopt(zmq.CONNECT_TIMEOUT, CONNECT_TIMEOUT_MS)
        sub.setsockopt(zmq.SUBSCRIBE, st.spec.topic.encode())
        mon = sub.get_monitor_socket(_MONITOR_EVENTS)
        sub.connect(st.spec.events)
        dealer = self._new_dealer(st)
        self._socks[name] = (sub, mon, dealer)
        roles: tuple[tuple[zmq.SyncSocket | None, _Role], ...] = (
            (sub, "sub"), (mon, "mon"), (dealer, "replay"))
        for s, role in roles:
            if s is not None:
                self._by_sock[s] = (name, role)
                self._poller.register(s, zmq.POLLIN)
        if dealer is not None:
            # Ask right away: ZMQ queues the request until the ROUTER is reachable.
            self._request_replay(st)

    def _new_dealer(self, st: PodState) -> zmq.SyncSocket | None:
        if st.spec.replay is None:
            return None
        d = self._ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.setsockopt(zmq.CONNECT_TIMEOUT, CONNECT_TIMEOUT_MS)
        d.connect(st.spec.replay)
        return d

    def _reset_dealer(self, st: PodState) -> None:
        sub, mon, old = self._socks[st.name]
        if old is not None:
            self._poller.unregister(old)
            self._by_sock.pop(old, None)
            old.close(linger=0)
        new = self._new_dealer(st)
        self._socks[st.name] = (sub, mon, new)
        if new is not None:
            self._by_sock[new] = (st.name, "replay")
            self._poller.register(new, zmq.POLLIN)

    def _close(self, name: PodId, st: PodState | None = None) -> None:
        socks = self._socks.pop(name, None)
        if socks is None:
            return
        sub, mon, dealer = socks
        for s in (mon, dealer):
            if s is not None:
                self._poller.unregister(s)
                self._by_sock.pop(s, None)
        self._poller.unregister(sub)
        self._by_sock.pop(sub, None)
        sub.disable_monitor()
        for s in (mon, dealer, sub):
            if s is not None:
                s.close(linger=0)
        if st is not None:
            self._queue_for(st).put((st, _CLEAR, st.epoch))

    def _request_replay(self, st: PodState) -> None:
        sock = self._socks[st.name][2]
        if sock is None or st.replaying:
            return
        try:
            sock.send_multipart([b"", (st.last_seq + 1).to_bytes(8, "big")], zmq.NOBLOCK)
        except zmq.Again:
            return
        st.replays += 1
        st.replay_deadline = time.monotonic() + self.replay_timeout_s

    def _on_monitor(self, st: PodState, mon: zmq.SyncSocket) -> None:
        from zmq.utils.monitor import recv_monitor_message

        while True:
            try:
                msg = recv_monitor_message(mon, zmq.NOBLOCK)
            except zmq.Again:
                return
            if msg["event"] == zmq.EVENT_CONNECTED:
                reconnect = st.ever_connected
                st.connected = st.ever_connected = True
                if reconnect or st.replay_timeouts:
                    self._request_replay(st)
                if not st.replaying:
                    st.down_since = None
                if reconnect:
                    log.info("pod %s: events reconnected", st.name)
            elif msg["event"] == zmq.EVENT_DISCONNECTED:
                if st.connected:
                    log.info("pod %s: events disconnected", st.name)
                st.connected = False
                if st.down_since is None:
                    st.down_since = time.monotonic()

    def _on_sub(self, st: PodState, sock: zmq.SyncSocket) -> None:
        for _ in range(1000):  # bounded, so one busy pod cannot starve the others
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            batch = self._decode(st, frames)
            if batch is None:
                continue
            if st.replaying:
                if len(st.pending) >= self.max_pending:
                    st.pending.pop(0)  # becomes a counted gap when the replay ends
                st.pending.append(batch)
            else:
                self._on_live(st, batch)

    def _decode(self, st: PodState, frames: list[bytes]) -> EventBatch | None:
        if st.spec.topic and len(frames) == 3 and frames[0] != st.spec.topic.encode():
            st.foreign_topic += 1  # a topic that merely starts with ours
            return None
        try:
            return decode_frames(frames)
        except MalformedFrame as e:
            st.malformed += 1
            log.debug("pod %s: malformed frame: %s", st.name, e)
            try:  # a readable seq still counts as consumed: an empty batch
                return EventBatch(seq=decode_seq(frames[1]), ts=0.0, events=[]) \
                    if len(frames) == 3 else None
            except MalformedFrame:
                return None

    def _on_live(self, st: PodState, b: EventBatch) -> None:
        if st.last_seq >= 0 and b.seq <= st.last_seq:
            log.info("pod %s: seq went back %d -> %d: publisher restarted", st.name,
                     st.last_seq, b.seq)
            st.restarts += 1
            self._queue_for(st).put((st, _CLEAR, st.epoch))
            st.last_seq = -1
            if self._socks[st.name][2] is not None:
                st.pending = [b]
                self._request_replay(st)
                return
        if b.seq == st.last_seq + 1:
            self._hand_over(st, b)
            return
        if self._socks[st.name][2] is not None:
            st.gaps += 1
            st.gap_open = True
            st.pending = [b]
            self._request_replay(st)
            return
        self._skip_to(st, b.seq)
        self._hand_over(st, b)

    def _on_replay(self, st: PodState, sock: zmq.SyncSocket) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if frames and frames[0] == b"":
                frames = frames[1:]
            if len(frames) == 3 and frames[1] == END_SEQ.to_bytes(8, "big"):
                self._finish_replay(st)
                continue
            if not st.replaying:
                continue  # an answer to a request we gave up on
            b = self._decode(st, frames)
            if b is None or b.seq <= st.last_seq:
                continue
            if b.seq > st.last_seq + 1:
                self._skip_to(st, b.seq)  # aged out of the pod's replay buffer
            self._hand_over(st, b)

    def _finish_replay(self, st: PodState) -> None:
        st.replay_deadline = None
        pending, st.pending = sorted(st.pending, key=lambda b: b.seq), []
        for b in pending:
            if b.seq <= st.last_seq:
                continue
            if b.seq > st.last_seq + 1:
                self._skip_to(st, b.seq)
            self._hand_over(st, b)
        st.gap_open = False
        if st.connected:
            st.down_since = None

    def _skip_to(self, st: PodState, seq: int) -> None:
        lost = seq - st.last_seq - 1
        if lost > 0:
            if not st.gap_open:
                st.gaps += 1
            st.missing += lost
            log.warning("pod %s: %d batch(es) before seq %d could not be recovered",
                        st.name, lost, seq)

    def _hand_over(self, st: PodState, b: EventBatch) -> None:
        st.last_seq = b.seq
        self._queue_for(st).put((st, b, st.epoch))

    def _queue_for(self, st: PodState) -> _WorkQueue:
        return self._queues[zlib.crc32(st.pod.encode()) % len(self._queues)]

    def _siblings(self, st: PodState) -> list[PodId]:
        """The pod's other streams: where a parent block may have been stored."""
        return [o.name for o in self._by_pod.get(st.pod, ()) if o is not st]

    # -- apply workers -------------------------------------------------------------------

    def _worker(self, q: _WorkQueue) -> None:
        applier = self.applier
        while True:
            item = q.get()
            try:
                if item is None:
                    return
                st, b, epoch = item
                if epoch != st.epoch or (st.resync_from is not None and not st.removed):
                    continue  # superseded by a resync, or waiting for one
                if b is _CLEAR:
                    try:
                        applier.index.clear_pod(st.name)
                    except BackendUnavailable as e:
                        if st.removed:
                            log.error("pod %s: removed, but clearing it failed: %s", st.name, e)
                        else:
                            st.resync_clear = True
                            st.resync_from = 0
                        continue
                    st.applied_seq = -1
                elif not st.removed:
                    try:
                        applier.apply(st.name, st.model, b, st.counters,
                                      functools.partial(self._siblings, st))
                    except BackendUnavailable as e:
                        log.warning("pod %s: seq %d not applied: %s", st.name, b.seq, e)
                        st.resync_from = b.seq
                        continue
                    st.applied_seq = b.seq
            except Exception:
                log.exception("apply failed")
            finally:
                q.task_done()

