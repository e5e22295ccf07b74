"""LoopWatchdog: a blocked event loop is logged while it lasts, with the blocking line, and
measured when it turns again; a loop that keeps turning is never reported."""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
from collections.abc import Callable

import pytest

from kvtier.watchdog import LoopWatchdog


def _stuck_in_sync_call(seconds: float) -> None:
    time.sleep(seconds)  # the line a report must name


async def _watched(stalls: list[float], *blocks: Callable[[], None],
                   idle_s: float = 0.05) -> None:
    """Watch a loop that turns for ``idle_s``, then runs each of ``blocks`` on the loop with
    0.1 s of turning after each (the heartbeat turns again)."""
    dog = LoopWatchdog("test", threshold_s=0.2, interval_s=0.02, on_stall=stalls.append)
    dog.start()
    await asyncio.sleep(idle_s)
    for block in blocks:
        block()
        await asyncio.sleep(0.1)
    await dog.stop()


def test_a_blocked_loop_is_reported_while_blocked_with_its_stack_then_measured(caplog):
    stalls: list[float] = []
    with caplog.at_level(logging.WARNING, logger="kvtier.watchdog"):
        asyncio.run(_watched(stalls, lambda: _stuck_in_sync_call(0.8), idle_s=0.1))
    during = [r.getMessage() for r in caplog.records if "has not turned" in r.getMessage()]
    assert len(during) == 1, during  # once per stall, not every check
    assert "_stuck_in_sync_call" in during[0] and "time.sleep(seconds)" in during[0]
    assert len(stalls) == 1 and 0.6 < stalls[0] < 1.5, stalls
    after = [r.getMessage() for r in caplog.records if "stood still" in r.getMessage()]
    assert len(after) == 1 and "the test's event loop" in after[0]
    assert "it waited" in after[0], after  # a sleep uses no CPU


def test_a_stall_that_computes_is_told_apart_from_one_that_waits(caplog):
    def spin(seconds: float) -> None:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    with caplog.at_level(logging.WARNING, logger="kvtier.watchdog"):
        asyncio.run(_watched([], lambda: spin(0.5)))
    after = [r.getMessage() for r in caplog.records if "stood still" in r.getMessage()]
    assert len(after) == 1, after
    # The spin used 0.5 s of its thread's CPU whatever else the machine ran (the words depend
    # on how much wall time that took).
    used = float(re.search(r"used ([0-9.]+) s of CPU", after[0]).group(1))
    assert used >= 0.45, after


def test_a_turning_loop_is_never_reported(caplog):
    stalls: list[float] = []
    with caplog.at_level(logging.WARNING, logger="kvtier.watchdog"):
        asyncio.run(_watched(stalls, idle_s=0.7))
    assert stalls == [] and not caplog.records


def test_two_stalls_are_two_reports(caplog):
    stalls: list[float] = []
    with caplog.at_level(logging.WARNING, logger="kvtier.watchdog"):
        asyncio.run(_watched(stalls, *[lambda: _stuck_in_sync_call(0.5)] * 2))
    assert len(stalls) == 2
    assert sum("has not turned" in r.getMessage() for r in caplog.records) == 2


def test_stop_ends_the_watcher_thread():
    async def run() -> LoopWatchdog:
        dog = LoopWatchdog("test", threshold_s=0.2, interval_s=0.02)
        dog.start()
        await asyncio.sleep(0.05)
        await dog.stop()
        return dog

    dog = asyncio.run(run())
    assert dog._thread is not None
    dog._thread.join(timeout=2)
    assert not dog._thread.is_alive()


def test_a_restart_right_after_stop_leaves_one_watcher():
    async def run() -> tuple[LoopWatchdog, threading.Thread]:
        dog = LoopWatchdog("test", threshold_s=1.0, interval_s=0.02)
        dog.start()
        first = dog._thread
        await dog.stop()
        dog.start()  # within the first watcher's 0.2 s wait
        await asyncio.sleep(0.05)
        await dog.stop()
        assert first is not None
        return dog, first

    dog, first = asyncio.run(run())
    first.join(timeout=2)
    assert not first.is_alive()
    assert dog._thread is not None
    dog._thread.join(timeout=2)
    assert not dog._thread.is_alive()


@pytest.mark.parametrize("kw", [{"threshold_s": 0}, {"interval_s": -1}])
def test_bad_settings_are_refused(kw):
    with pytest.raises(ValueError, match="must be > 0"):
        LoopWatchdog("test", **kw)
