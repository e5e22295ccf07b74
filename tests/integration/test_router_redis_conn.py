"""router/redis_conn.py against a real redis-server: a deadline passed only because the
router's own loop was held up does not fail a call Redis answered in time; a Redis that
does not answer still fails it. Under both loops the router can run on (uvloop runs due
timers before it polls its sockets; asyncio polls first)."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import uvloop

from kvtier.router.redis_conn import RedisConn

LOOPS = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
# Redis answers 1 after 50 ms of its own time: never before the loop's next poll.
_ANSWER_AFTER_50_MS = """
local t0 = redis.call('TIME')
repeat local t = redis.call('TIME')
until (t[1] - t0[1]) * 1000000 + (t[2] - t0[2]) >= 50000
return 1
"""


def _run(make_loop: Callable[[], asyncio.AbstractEventLoop],
         coro: Coroutine[Any, Any, Any]) -> Any:
    loop = make_loop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_a_reply_that_waited_on_a_held_up_loop_is_not_a_timeout(redis_url: str,
                                                                  loop: str) -> None:
    """The router's loop busy for longer than the deadline in another socket's callback, polled
    before Redis's reply arrived: uvloop then runs the due timer before it reads the reply."""
    async def go() -> tuple[Any, Any]:
        conn = RedisConn(redis_url, timeout_s=0.2)
        ours, theirs = socket.socketpair()
        lp = asyncio.get_running_loop()

        def busy() -> None:  # a client's request that takes the loop for 0.5 s
            lp.remove_reader(ours)
            time.sleep(0.5)
        try:
            await conn.call("PING")
            lp.add_reader(ours, busy)
            theirs.send(b"x")  # ready at the loop's next poll, before Redis's reply
            fut = conn.send("EVAL", _ANSWER_AFTER_50_MS, 0)  # in the socket during busy()
            assert fut is not None
            return await fut, await conn.call("PING")
        finally:
            ours.close()
            theirs.close()
            await conn.aclose()

    # Before the second look after a late deadline, uvloop (which runs due timers before it
    # reads its sockets) failed this call with "redis did not answer within 0.2 s".
    assert _run(LOOPS[loop], go()) == (1, b"PONG")


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_a_redis_that_does_not_answer_still_times_out(redis_url: str, loop: str) -> None:
    async def go() -> float:
        conn, other = RedisConn(redis_url, timeout_s=0.2), RedisConn(redis_url, timeout_s=2)
        try:
            await conn.call("PING")
            await other.call("CLIENT", "PAUSE", 1000, "ALL")
            t0 = time.perf_counter()
            with pytest.raises(TimeoutError):
                await conn.call("GET", "kvtier-test:paused")
            return time.perf_counter() - t0
        finally:
            await conn.aclose()
            await other.call("CLIENT", "UNPAUSE")
            await other.aclose()

    took = _run(LOOPS[loop], go())
    assert 0.15 < took < 0.9, took
