"""The decode nodes' finished-request params feeds, as the router hears them.

A streamed decode leg never shows the router the ``kv_transfer_params`` the decode node
retained for the next turn (vLLM 0.32 puts them only into non-streaming answers).
``KVTierNixlConnector`` on the decode node publishes them on ZMQ (``kvtier.wire.params_feed``);
``ParamsFeed`` subscribes to every decode instance that has a ``params_feed`` endpoint and
hands each message to the leg waiting for its tag:

    feed.expect(pod, tag)        # before the leg is sent (the message may beat the stream)
    ...relay the stream...
    msg = await feed.wait(pod, tag, timeout_s)   # None: not heard in time, turn goes on
    feed.forget(pod, tag)        # always (finally)

Bounded: at most ``max_pending`` legs wait at once (``expect`` says False beyond that); a
message nobody expects is counted (``unmatched``) and dropped; a malformed one is counted
and dropped.

Threading model: one asyncio event loop (the app's); one reader task per subscribed pod.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import zmq
import zmq.asyncio

from kvtier.ids import PodId
from kvtier.router.metrics import RouterMetrics
from kvtier.wire.params_feed import TOPIC, FinishedParams

log = logging.getLogger("kvtier.router")


class ParamsFeed:
    def __init__(self, endpoints: dict[PodId, str], metrics: RouterMetrics,
                 max_pending: int = 10_000) -> None:
        self.endpoints = dict(endpoints)
        self.metrics = metrics
        self.max_pending = max_pending
        self._pending: dict[tuple[PodId, str], asyncio.Future[FinishedParams]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._ctx: zmq.asyncio.Context | None = None

    def has(self, pod: PodId) -> bool:
        return pod in self.endpoints

    async def start(self) -> None:
        if not self.endpoints:
            return
        self._ctx = zmq.asyncio.Context()
        for pod, ep in self.endpoints.items():
            sock = self._ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, 10_000)
            sock.setsockopt(zmq.SUBSCRIBE, TOPIC)
            sock.connect(ep)
            self._tasks.append(asyncio.create_task(self._read(pod, sock)))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks.clear()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    async def _read(self, pod: PodId, sock: zmq.asyncio.Socket) -> None:
        try:
            while True:
                frames = await sock.recv_multipart()
                msg = FinishedParams.parse(list(frames))
                if msg is None:
                    self.metrics.params_feed.labels("malformed").inc()
                    continue
                self.deliver(pod, msg)
        finally:
            sock.close(0)

    def expect(self, pod: PodId, tag: str) -> bool:
        if len(self._pending) >= self.max_pending:
            self.metrics.params_feed.labels("overflow").inc()
            return False
        self._pending[(pod, tag)] = asyncio.get_running_loop().create_future()
        return True

    def deliver(self, pod: PodId, msg: FinishedParams) -> None:
        tag = msg.tag
        fut = self._pending.get((pod, tag)) if tag is not None else None
        if fut is None or fut.done():
            # a leg that was not streamed, one that gave up waiting, or another router's
            self.metrics.params_feed.labels("unmatched").inc()
            return
        fut.set_result(msg)

    async def wait(self, pod: PodId, tag: str, timeout_s: float) -> FinishedParams | None:
        fut = self._pending.get((pod, tag))
        if fut is None:
            return None
        try:
            msg = await asyncio.wait_for(asyncio.shield(fut), timeout_s)
        except TimeoutError:
            self.metrics.params_feed.labels("timeout").inc()
            return None
        self.metrics.params_feed.labels("received").inc()
        return msg

    def forget(self, pod: PodId, tag: str) -> None:
        fut = self._pending.pop((pod, tag), None)
        if fut is not None and not fut.done():
            fut.cancel()
