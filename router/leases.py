"""The router's side of decode leases: renew what is worth holding, release what is not.

A decode node running ``KVTierNixlConnector`` with ``decode_lease_s`` holds each retained turn
under a lease (``kvtier.tier.leases``) that runs out unless renewed. ``LeaseKeeper`` tracks, per
decode node, the engine request ids whose params the router keeps for a next turn, and every
``lease_s / 3`` renews those still worth holding in one message per node, all nodes at once
and on a fixed cadence, so one slow or dead node neither delays the others nor pushes the
next round back (a router that dies stops renewing, and the nodes free its turns within one
lease). It releases a turn early when
the router gives it up: params dropped or trimmed, the next turn served another way, the
conversation closed, or the hold the adaptive policy chose is over (``hold_until``). A renewal
that finds the lease gone tells the router (``on_lost``) so it drops the params instead of
offering a read the prefill would decline.

Each renewal answers the lease's deadline on the node's scheduler clock; ``deadline`` gives it
back so the router can patch ``remote_blocks_expiry_time`` into the params it hands a prefill
(vLLM's prefill declines a read within 5 s of that deadline rather than read freed blocks).

Threading model: one asyncio loop (the router's). Calls to one node are serialized by a lock
per node (one DEALER socket each); ``track``/``forget`` are plain dict updates on the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import zmq
import zmq.asyncio

from kvtier.ids import PodId
from kvtier.wire.leases import LeaseReply, LeaseRequest, Op, ProtocolError, ReleaseReason

log = logging.getLogger("kvtier.router.leases")


@dataclass
class _Held:
    hold_until: float        # router monotonic clock: renew until then, release after
    deadline: float | None   # the node's scheduler clock, from the last answer


class LeaseKeeper:
    def __init__(self, endpoints: dict[PodId, str], lease_s: float, *,
                 timeout_s: float = 1.0,
                 on_lost: Callable[[PodId, str], None] | None = None,
                 on_result: Callable[[str, str], None] | None = None,
                 on_release: Callable[[ReleaseReason, int], None] | None = None) -> None:
        if not lease_s > 0:
            raise ValueError(f"lease_s must be > 0, not {lease_s!r}")
        self.endpoints = dict(endpoints)
        self.lease_s = float(lease_s)
        self.timeout_s = timeout_s
        self.on_lost = on_lost
        self.on_result = on_result or (lambda op, result: None)
        self.on_release = on_release or (lambda reason, n: None)
        self._held: dict[PodId, dict[str, _Held]] = {p: {} for p in self.endpoints}
        self._ctx = zmq.asyncio.Context.instance()
        self._socks: dict[PodId, zmq.asyncio.Socket] = {}
        self._locks: dict[PodId, asyncio.Lock] = {}
        self._task: asyncio.Task[None] | None = None

    def has(self, pod: PodId) -> bool:
        return pod in self.endpoints

    # ---- bookkeeping (the flow calls these) -----------------------------------
    def track(self, pod: PodId, request_id: str, hold_s: float | None = None,
              deadline: float | None = None) -> None:
        """Keep renewing ``request_id`` on ``pod`` for ``hold_s`` (default: until forgotten)."""
        if pod not in self._held:
            return
        until = time.monotonic() + hold_s if hold_s is not None else float("inf")
        self._held[pod][request_id] = _Held(until, deadline)

    def forget(self, pod: PodId, request_id: str) -> None:
        """Stop renewing without releasing (the next turn is reading it: vLLM frees it)."""
        if pod in self._held:
            self._held[pod].pop(request_id, None)

    def deadline(self, pod: PodId, request_id: str) -> float | None:
        h = self._held.get(pod, {}).get(request_id)
        return h.deadline if h is not None else None

    def held(self, pod: PodId) -> int:
        return len(self._held.get(pod, {}))

    def tracked(self, pod: PodId) -> list[str]:
        return list(self._held.get(pod, {}))

    def holds(self, pod: PodId, request_id: str) -> bool:
        """Whether ``request_id`` on ``pod`` is still being renewed."""
        return request_id in self._held.get(pod, {})

    # ---- calls -----------------------------------------------------------------
    async def release(self, pod: PodId, request_ids: Iterable[str],
                      reason: ReleaseReason) -> bool:
        """Give up these turns' leases; True when ``pod``'s lease server confirmed it."""
        ids = tuple(request_ids)
        for rid in ids:
            self.forget(pod, rid)
        if ids and pod in self.endpoints:
            self.on_release(reason, len(ids))
            reply = await self.call(pod, LeaseRequest(Op.RELEASE, ids, None, reason))
            return reply is not None and reply.ok
        return False

    async def renew_all(self) -> None:
        """One renewal round: renew what is still worth holding, release the rest; every node
        at once, so a node that does not answer delays nobody else's renewal."""
        now = time.monotonic()
        pods = list(self._held)
        results = await asyncio.gather(*(self._renew_pod(p, now) for p in pods),
                                       return_exceptions=True)
        for pod, r in zip(pods, results):
            if isinstance(r, BaseException):
                if isinstance(r, asyncio.CancelledError):
                    raise r
                log.error("lease renewal on %s failed", pod, exc_info=r)

    async def _renew_pod(self, pod: PodId, now: float) -> None:
        held = self._held[pod]
        over = [rid for rid, h in held.items() if h.hold_until <= now]
        if over:
            await self.release(pod, over, ReleaseReason.MOVED)
        ids = tuple(held)
        if not ids:
            return
        reply = await self.call(pod, LeaseRequest(Op.RENEW, ids, self.lease_s))
        if reply is None:
            return
        for rid, state in reply.leases.items():
            h = held.get(rid)
            if h is None:
                continue
            if state.held:
                h.deadline = state.deadline
            else:
                held.pop(rid, None)
                if self.on_lost is not None:
                    self.on_lost(pod, rid)

    async def call(self, pod: PodId, req: LeaseRequest) -> LeaseReply | None:
        """One request to ``pod``'s lease server; None when it did not answer in time."""
        lock = self._locks.setdefault(pod, asyncio.Lock())
        async with lock:
            sock = self._socks.get(pod)
            if sock is None:
                sock = self._ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(self.endpoints[pod])
                self._socks[pod] = sock
            try:
                await sock.send(req.encode())
                if not await sock.poll(int(self.timeout_s * 1000)):
                    raise TimeoutError
                reply = LeaseReply.decode(await sock.recv())
            except (TimeoutError, ProtocolError, zmq.ZMQError) as e:
                # A late answer would pair with the next request: start a fresh socket.
                sock.close(0)
                self._socks.pop(pod, None)
                self.on_result(req.op.value, "unavailable")
                log.warning("lease %s on %s failed: %s", req.op.value, pod,
                            type(e).__name__ if isinstance(e, TimeoutError) else e)
                return None
            self.on_result(req.op.value, "ok" if reply.ok else "refused")
            if not reply.ok:
                log.warning("lease %s on %s refused: %s", req.op.value, pod, reply.error)
            return reply

    # ---- lifecycle -----------------------------------------------------------------
    async def start(self) -> None:
        if self.endpoints and self._task is None:
            self._task = asyncio.create_task(self._loop())

    async def _loop(self) -> None:
        period = self.lease_s / 3
        due = time.monotonic() + period
        while True:
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            try:
                await self.renew_all()
            except Exception:  # a bad round must not stop renewing
                log.exception("lease renewal round failed")
            due = next_round(due, time.monotonic(), period)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for sock in self._socks.values():
            sock.close(0)
        self._socks.clear()


def next_round(due: float, now: float, period: float) -> float:
    """When the renewal round after the one ``due`` then starts, if it ended at ``now``.

    Rounds keep a fixed cadence from when they were due, not from when the last one ended: a
    round that waited out a node's timeout (1 s) must not push the next one back by as much,
    or a 3 s lease renewed every 1 s would run out after a single late answer. A round that
    overran whole periods is followed at once, once (no burst of catch-up rounds)."""
    nxt = due + period
    return nxt if nxt > now else now
