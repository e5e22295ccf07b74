"""Decode-side leases on retained KV: the table, its control server and its metrics.

A decode node in bidirectional P/D keeps each finished turn's blocks so the next turn's
prefill can read them. vLLM frees them when they were read or when ``decoder_kv_blocks_ttl``
(480 s) passed. ``LeaseTable`` puts a shorter, renewable lease under that bound:

- ``grant`` when a turn finishes: deadline = now + lease (``decode_lease_s``, or the
  request's own ``kvtier_decode_lease_s``), never past vLLM's TTL deadline;
- ``renew`` (the router, while the conversation is worth holding): deadline =
  max(deadline, now + lease), capped at the TTL deadline;
- ``release`` (the router: conversation closed, params dropped or trimmed, next turn served
  another way): deadline = now;
- ``finished`` when the engine freed the blocks: counted as *read* (before the deadline),
  *released* (after a release) or *expired* (nobody renewed; a dead router frees within
  one lease).

The table only decides deadlines; the connector hands the changed ones (``take_updates``) to
vLLM's NIXL worker, which frees blocks whose deadline passed. ``LeaseServer`` answers the wire
protocol (``kvtier.wire.leases``) on a ZMQ ROUTER socket; ``LeaseCollector`` exports the
table as Prometheus metrics (prefix ``kvtier_decode_``, label ``pod``):

===================================  =======  ==============================================
blocks_retained / leases_held        gauge    blocks (and turns) now held under a lease
block_seconds_held_total             counter  integral of blocks_retained over time
leases_granted_total                 counter  turns that finished with retained blocks
turns_not_retained_total             counter  turns that asked to keep nothing (freed at once)
idle_steps_slowed_total              counter  empty engine steps slowed while turns are retained
leases_renewed_total                 counter  renewals that extended a live lease
leases_released_total{reason}        counter  early releases (closed|dropped|trimmed|moved|other)
leases_expired_total                 counter  leases that ran out (not renewed, or TTL bound)
leases_read_total                    counter  leases ended by the next turn's read
expiry_lag_seconds_total             counter  sum, over expired leases, of deadline -> freed
expiry_lag_seconds_max               gauge    the longest such lag (an engine slow to free)
===================================  =======  ==============================================

Threading model: ``LeaseTable`` is thread-safe (one lock): the scheduler thread grants,
drains updates and reports finished requests; the server thread renews and releases; the
metrics thread reads snapshots. ``LeaseServer`` owns its socket on its own thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import zmq
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvtier.wire.leases import (
    LeaseReply,
    LeaseRequest,
    LeaseState,
    Op,
    ProtocolError,
    ReleaseReason,
)

log = logging.getLogger(__name__)

# A lease that ends within this much of its deadline ended by running out, not by a read.
_EXPIRY_SLACK_S = 0.05


@dataclass
class _Lease:
    blocks: int
    bound: float       # vLLM's TTL deadline: no lease goes past it
    deadline: float
    released: ReleaseReason | None = None


class LeaseTable:
    def __init__(self, default_lease_s: float,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if not default_lease_s > 0:
            raise ValueError(f"default_lease_s must be > 0, not {default_lease_s!r}")
        self.default_lease_s = float(default_lease_s)
        self.clock = clock
        self._lock = threading.Lock()
        self._leases: dict[str, _Lease] = {}
        self._updates: dict[str, float] = {}
        self._blocks = 0
        self._block_seconds = 0.0
        self._since = clock()
        self.counts: dict[str, int] = {"granted": 0, "renewed": 0, "expired": 0, "read": 0,
                                       "not_retained": 0, "idle_steps_slowed": 0}
        self.released: dict[str, int] = {r.value: 0 for r in ReleaseReason}
        # How long after its deadline the engine freed an expired lease's blocks.
        self._lag_total = 0.0
        self._lag_max = 0.0

    # ---- the scheduler's side ------------------------------------------------
    def grant(self, request_id: str, blocks: int, ttl_deadline: float,
              lease_s: float | None = None) -> float:
        """Hold ``blocks`` for a finished turn; returns the lease deadline."""
        with self._lock:
            now = self._tick()
            deadline = min(ttl_deadline, now + (lease_s or self.default_lease_s))
            old = self._leases.pop(request_id, None)
            if old is not None:
                self._blocks -= old.blocks
            self._leases[request_id] = _Lease(blocks, ttl_deadline, deadline)
            self._blocks += blocks
            self.counts["granted"] += 1
            return deadline

    def not_retained(self) -> None:
        """A finished turn asked to keep nothing (``kvtier_decode_retain: false``): its blocks
        were freed at once, no lease granted."""
        with self._lock:
            self.counts["not_retained"] += 1

    def idle_step_slowed(self) -> None:
        """An engine step that scheduled nothing while turns are retained was slowed
        (``retained_idle_step_ms``, ``kvtier.connectors.params_feed``)."""
        with self._lock:
            self.counts["idle_steps_slowed"] += 1

    def take_updates(self) -> dict[str, float]:
        """Deadlines changed since the last call (request id -> new deadline)."""
        with self._lock:
            out, self._updates = self._updates, {}
            return out

    def finished(self, request_ids: Iterable[str]) -> None:
        """The engine freed these requests' blocks (read, released or expired)."""
        with self._lock:
            now = self._tick()
            for rid in request_ids:
                lease = self._leases.pop(rid, None)
                if lease is None:
                    continue
                self._blocks -= lease.blocks
                self._updates.pop(rid, None)
                if lease.released is not None:
                    continue  # counted when released
                if now >= lease.deadline - _EXPIRY_SLACK_S:
                    self.counts["expired"] += 1
                    lag = max(0.0, now - lease.deadline)
                    self._lag_total += lag
                    self._lag_max = max(self._lag_max, lag)
                else:
                    self.counts["read"] += 1

    # ---- the router's side ---------------------------------------------------
    def renew(self, request_ids: Iterable[str], lease_s: float | None = None,
              ) -> dict[str, LeaseState]:
        with self._lock:
            now = self._tick()
            out: dict[str, LeaseState] = {}
            for rid in request_ids:
                lease = self._leases.get(rid)
                if lease is None or lease.released is not None or lease.deadline <= now:
                    out[rid] = LeaseState(False)
                    continue
                new = min(lease.bound, max(lease.deadline, now + (lease_s or self.default_lease_s)))
                if new > lease.deadline:
                    lease.deadline = new
                    self._updates[rid] = new
                    self.counts["renewed"] += 1
                out[rid] = LeaseState(True, lease.deadline - now, lease.deadline)
            return out

    def release(self, request_ids: Iterable[str], reason: ReleaseReason,
                ) -> dict[str, LeaseState]:
        with self._lock:
            now = self._tick()
            out: dict[str, LeaseState] = {}
            for rid in request_ids:
                lease = self._leases.get(rid)
                if lease is None or lease.released is not None or lease.deadline <= now:
                    out[rid] = LeaseState(False)
                    continue
                lease.released, lease.deadline = reason, now
                self._updates[rid] = now
                self.released[reason.value] += 1
                out[rid] = LeaseState(False, 0.0, now)
            return out

    # ---- accounting ----------------------------------------------------------
    def _tick(self) -> float:
        now = self.clock()
        self._block_seconds += self._blocks * (now - self._since)
        self._since = now
        return now

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            self._tick()
            return {"blocks_retained": self._blocks, "leases_held": len(self._leases),
                    "block_seconds_held": self._block_seconds, **self.counts,
                    "released": dict(self.released), "default_lease_s": self.default_lease_s,
                    "expiry_lag_s_total": self._lag_total, "expiry_lag_s_max": self._lag_max}


class LeaseServer:
    """Answers ``kvtier.wire.leases`` requests against one table, on its own thread."""

    def __init__(self, table: LeaseTable, endpoint: str) -> None:
        self.table = table
        self._sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(endpoint)
        self.endpoint: str = str(self._sock.getsockopt_string(zmq.LAST_ENDPOINT))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvtier-leases", daemon=True)
        self._thread.start()

    def handle(self, raw: bytes) -> LeaseReply:
        try:
            req = LeaseRequest.decode(raw)
        except ProtocolError as e:
            return LeaseReply(False, error=str(e))
        if req.op is Op.RENEW:
            return LeaseReply(True, self.table.renew(req.request_ids, req.lease_s))
        if req.op is Op.RELEASE:
            return LeaseReply(True, self.table.release(req.request_ids, req.reason))
        return LeaseReply(True, stats=self.table.snapshot())

    def _run(self) -> None:
        sock = self._sock
        while not self._stop.is_set():
            try:
                if not sock.poll(100):
                    continue
                frames = sock.recv_multipart()
            except zmq.ZMQError:
                if self._stop.is_set():
                    return
                raise
            # [identity, payload] from a DEALER; [identity, b"", payload] from a REQ.
            if len(frames) < 2:
                continue
            head, raw = frames[:-1], frames[-1]
            try:
                reply = self.handle(raw)
            except Exception as e:  # never let one request stop the server
                log.exception("lease request failed")
                reply = LeaseReply(False, error=f"internal error: {e!r}")
            sock.send_multipart([*head, reply.encode()])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close(0)


class LeaseCollector(Collector):
    PREFIX = "kvtier_decode_"

    def __init__(self, table: LeaseTable, pod: str) -> None:
        self.table, self.pod = table, pod

    def _fam(self, cls: type[CounterMetricFamily] | type[GaugeMetricFamily], name: str,
             doc: str, value: float) -> Metric:
        fam = cls(self.PREFIX + name, doc, labels=["pod"])
        fam.add_metric([self.pod], value)
        return fam

    def collect(self) -> Iterator[Metric]:
        s = self.table.snapshot()
        g, c = GaugeMetricFamily, CounterMetricFamily
        yield self._fam(g, "blocks_retained", "Blocks held for a next turn under a lease",
                        s["blocks_retained"])
        yield self._fam(g, "leases_held", "Finished turns whose blocks are held",
                        s["leases_held"])
        yield self._fam(c, "block_seconds_held", "Integral of blocks_retained over time",
                        s["block_seconds_held"])
        yield self._fam(c, "leases_granted", "Turns that finished with retained blocks",
                        s["granted"])
        yield self._fam(c, "turns_not_retained", "Turns that asked to keep nothing (their "
                        "blocks freed when they finished)", s["not_retained"])
        yield self._fam(c, "idle_steps_slowed", "Engine steps that scheduled nothing while "
                        "turns were retained, slowed by retained_idle_step_ms",
                        s["idle_steps_slowed"])
        yield self._fam(c, "leases_renewed", "Renewals that extended a lease", s["renewed"])
        yield self._fam(c, "leases_expired", "Leases that ran out", s["expired"])
        yield self._fam(c, "leases_read", "Leases ended by the next turn's read", s["read"])
        yield self._fam(c, "expiry_lag_seconds", "Sum over expired leases of the time from "
                        "the deadline to the engine freeing the blocks", s["expiry_lag_s_total"])
        yield self._fam(g, "expiry_lag_seconds_max", "Longest time from an expired lease's "
                        "deadline to the engine freeing its blocks", s["expiry_lag_s_max"])
        rel = c(self.PREFIX + "leases_released", "Leases released early, by reason",
                labels=["pod", "reason"])
        for reason, n in sorted(s["released"].items()):
            rel.add_metric([self.pod, reason], n)
        yield rel


class LeaseMetricsServer:
    """``/metrics`` for one lease table on ``host:port``; ``close()`` stops it."""

    def __init__(self, table: LeaseTable, pod: str, port: int, host: str = "0.0.0.0") -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(LeaseCollector(table, pod))
        self.server, self.thread = start_http_server(port, host, registry=self.registry)
        self.port = self.server.server_port

    def close(self) -> None:
        if self.thread.is_alive():
            self.server.shutdown()
            self.server.server_close()
            self.thread.join(timeout=5)
