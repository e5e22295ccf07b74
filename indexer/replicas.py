"""Indexer replicas on one shared backend (Redis): resume, health, rebuild after data loss.

Several ``kvtier indexer --backend redis://...`` daemons may serve one index.
Each subscribes to every stream and applies the same events (writes are
idempotent), so any replica answers any query, and one that restarts answers
at once from what the others kept writing. ``ReplicaSync`` adds, for a
backend that supports it (``SharedIndex``: ``RedisIndex``):

- **resume**: every ``interval_s`` it saves each stream's last applied seq in
  the backend; a replica that starts resumes each stream from there (a replay
  of what came after) instead of from 0, so a restart does not re-apply
  history over the live index.
- **health**: it pings the backend and logs when it goes down and comes back
  (queries meanwhile answer 503; the subscriber replays what it could not
  apply, see ``kvtier.indexer.subscriber``).
- **data loss**: the backend holds a generation id, claimed once per dataset.
  When the id is gone or changed (Redis restarted without persistence, or
  was replaced), every stream is cleared and replayed from 0.

Threading model: one daemon thread; it reads ``PodState`` fields and sets
``resync_from``/``resync_clear`` (which the I/O thread acts on).
"""

from __future__ import annotations

import logging
import threading
import uuid
from typing import Protocol, runtime_checkable

from kvtier.ids import PodId
from kvtier.indexer.index import BackendUnavailable
from kvtier.indexer.subscriber import Subscriber

log = logging.getLogger(__name__)


@runtime_checkable
class SharedIndex(Protocol):
    def ping(self) -> None: ...

    def generation(self, claim: str | None = None) -> str | None: ...

    def save_seqs(self, seqs: dict[PodId, int]) -> None: ...

    def load_seqs(self) -> dict[PodId, int]: ...


class ReplicaSync:
    def __init__(self, index: SharedIndex, subscriber: Subscriber,
                 interval_s: float = 1.0) -> None:
        self.index = index
        self.subscriber = subscriber
        self.interval_s = interval_s
        self.gen: str | None = None
        self.up = True
        self.rebuilds = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def resume_seqs(self) -> dict[PodId, int]:
        """Claim (or join) the dataset's generation; the saved seq per stream (empty when
        the backend cannot be reached: streams then replay from 0)."""
        try:
            self.gen = self.index.generation(claim=uuid.uuid4().hex)
            seqs = self.index.load_seqs()
        except BackendUnavailable as e:
            log.error("index backend unavailable at start (%s); replaying every stream", e)
            self.up = False
            return {}
        if seqs:
            log.info("resuming %d stream(s) from the shared index's seqs", len(seqs))
        return seqs

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name="kvtier-indexer-replica")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        try:
            self.check_once()   # save the last seqs on the way out
        except Exception:  # noqa: BLE001 - shutting down; the loop logged it already
            pass

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.check_once()
            except Exception:
                log.exception("replica sync failed")

    def check_once(self) -> None:
        try:
            self.index.ping()
            gen = self.index.generation()
            if gen is None or gen != self.gen:
                gen = self.index.generation(claim=uuid.uuid4().hex)
                if self.gen is not None:
                    self._rebuild(gen)
                self.gen = gen
            # A stream waiting for a resync has not applied past applied_seq: saving it
            # is still right (it is what the index holds).
            self.index.save_seqs({st.name: st.applied_seq
                                  for st in list(self.subscriber.streams.values())
                                  if st.applied_seq >= 0})
        except BackendUnavailable as e:
            if self.up:
                log.error("index backend down: %s (queries answer 503 until it is back)", e)
            self.up = False
            return
        if not self.up:
            log.info("index backend back")
        self.up = True

    def _rebuild(self, gen: str | None) -> None:
        self.rebuilds += 1
        log.warning("index backend lost its data (generation %s -> %s): replaying every "
                    "stream from 0", self.gen, gen)
        for st in list(self.subscriber.streams.values()):
            st.resync_clear = True
            st.resync_from = 0
