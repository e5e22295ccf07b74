"""Tell when an event loop stops turning, and what stopped it.

A server on asyncio is one thread: a callback that blocks (a synchronous call, a long
CPU loop, a lock held elsewhere) stalls every request at once, and nothing on the loop
can say so while it lasts. ``LoopWatchdog`` stamps a heartbeat from the loop every
``interval_s`` and watches the stamp from a thread of its own:

- a stamp older than ``threshold_s`` is logged once per stall, while the stall lasts,
  with the loop thread's current stack: the line that blocks it;
- when the loop turns again, the stall's length is logged, with the CPU time the loop's
  thread used meanwhile (close to the stall: it computed; close to 0: it waited, on a lock,
  on I/O, or for a CPU on a crowded machine), and handed to ``on_stall`` (a metric).

    dog = LoopWatchdog("router", threshold_s=1.0, on_stall=hist.observe)
    dog.start()          # on the loop
    ...
    await dog.stop()

Threading model: the heartbeat task runs on the watched loop and is the only writer of
the stamp; the watcher thread only reads it and ``sys._current_frames()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable

log = logging.getLogger("kvtier.watchdog")

# Frames of the stack logged for a stall: the innermost ones say what blocks.
_STACK_FRAMES = 12


class LoopWatchdog:
    def __init__(self, name: str, threshold_s: float = 1.0, interval_s: float = 0.1,
                 on_stall: Callable[[float], None] | None = None) -> None:
        if not threshold_s > 0 or not interval_s > 0:
            raise ValueError(f"threshold_s and interval_s must be > 0, not {threshold_s!r}, "
                             f"{interval_s!r}")
        self.name = name
        self.threshold_s = float(threshold_s)
        self.interval_s = float(interval_s)
        self.on_stall = on_stall
        self._beat = time.monotonic()
        self._loop_thread: int | None = None
        self._task: asyncio.Task[None] | None = None
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()

    def start(self) -> None:
        """Start watching the running loop (call from it)."""
        if self._task is not None:
            return
        self._loop_thread = threading.get_ident()
        self._beat = time.monotonic()
        # Each start has its own event: a watcher of an earlier start still waiting out its
        # last check never sees this one cleared.
        self._stopped = threading.Event()
        self._task = asyncio.get_running_loop().create_task(self._heartbeat())
        self._thread = threading.Thread(target=self._watch, args=(self._stopped,), daemon=True,
                                        name=f"kvtier-{self.name}-watchdog")
        self._thread.start()

    async def stop(self) -> None:
        self._stopped.set()
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _heartbeat(self) -> None:
        cpu = time.thread_time()
        while True:
            await asyncio.sleep(self.interval_s)
            now, cpu_now = time.monotonic(), time.thread_time()
            late = now - self._beat - self.interval_s
            used, cpu = cpu_now - cpu, cpu_now
            self._beat = now
            if late >= self.threshold_s:
                log.warning("the %s's event loop stood still for %.2f s, nothing it serves "
                            "moved meanwhile; its thread used %.2f s of CPU in that time (%s)",
                            self.name, late, used,
                            "it computed" if used >= late / 2 else
                            "it waited: on a lock, on I/O, or for a CPU")
                if self.on_stall is not None:
                    self.on_stall(late)

    def _watch(self, stopped: threading.Event) -> None:
        told: float | None = None  # the stamp of the stall already logged
        # Checked 5 times a threshold: any stall of 1.2 thresholds is seen while it lasts.
        while not stopped.wait(self.threshold_s / 5):
            beat = self._beat
            age = time.monotonic() - beat - self.interval_s
            if age < self.threshold_s or beat == told:
                continue
            told = beat
            frame = sys._current_frames().get(self._loop_thread or -1)
            where = ("".join(traceback.format_stack(frame, limit=_STACK_FRAMES))
                     if frame is not None else "(its thread is gone)\n")
            log.warning("the %s's event loop has not turned for %.1f s; its thread is at "
                        "(innermost last):\n%s", self.name, age, where.rstrip())
