"""Instance pool: health, in-flight counts and the choice of instances.

Choice, in order: among healthy instances of the role, prefer the longest
cached prefix the indexer reports (KV-aware), then the fewest in-flight
requests (load-aware), then round-robin.

Ejection has two causes, and each has its own way back:

- ``health``: ``eject_after_failures`` failed health checks in a row, or a refused
  connection. One successful health check (or leg) readmits. A refused connection also
  turns a ``legs`` ejection into this one: the wedged process is gone, and whatever answers
  on its address next is a new one (a restarted engine comes back without waiting for
  traffic to probe it).
- ``legs``: ``eject_after_failures`` legs in a row that timed out or broke (an engine
  that hangs while its ``/health`` still answers 200). Health checks do not readmit it;
  every ``probe_interval_s`` it is offered one leg (a probe), and the first successful
  leg readmits it.

Threading model: one asyncio event loop owns a pool; nothing here awaits
except ``check_all`` (the health loop), which only flips flags.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx

from kvtier.ids import PodId
from kvtier.router.config import InstanceConfig

log = logging.getLogger(__name__)


class Ejected:
    """Why an instance is out (``InstanceState.ejected``; the ejections metric's label)."""

    HEALTH = "health"  # failed health checks or refused a connection
    LEGS = "legs"      # its legs timed out or broke in a row


@dataclass
class InstanceState:
    cfg: InstanceConfig
    healthy: bool = True
    failures: int = 0       # health checks (and refusals) failed in a row
    leg_failures: int = 0   # legs timed out / broken in a row
    in_flight: int = 0
    ejected: str | None = None  # an ``Ejected`` value while out
    probe_at: float = 0.0   # monotonic: when a legs-ejected instance may get a probe leg

    @property
    def name(self) -> PodId:
        return self.cfg.name

    @property
    def url(self) -> str:
        return self.cfg.url


class InstancePool:
    def __init__(self, prefill: Iterable[InstanceConfig], decode: Iterable[InstanceConfig],
                 eject_after_failures: int = 2, probe_interval_s: float = 5.0,
                 on_eject: Callable[[InstanceState, str], None] = lambda _i, _r: None,
                 clock: Callable[[], float] = time.monotonic):
        self.prefill = [InstanceState(c) for c in prefill]
        self.decode = [InstanceState(c) for c in decode]
        by_name: dict[PodId, InstanceState] = {}
        for s in [*self.prefill, *self.decode]:
            # A "both" instance appears in both lists: share one state object.
            by_name.setdefault(s.name, s)
        self.prefill = [by_name[s.name] for s in self.prefill]
        self.decode = [by_name[s.name] for s in self.decode]
        self.by_name = by_name
        self.eject_after = eject_after_failures
        self.probe_interval_s = probe_interval_s
        self.on_eject = on_eject
        self.clock = clock
        # One round-robin counter per candidate list (prefills, decodes...): a shared one
        # advanced by every choice would pair each request's prefill with the same parity.
        self._rr: dict[tuple[PodId, ...], itertools.count[int]] = {}

    def loads(self) -> dict[str, int]:
        """Requests in flight per prefill instance (the indexer's tie-break among sources)."""
        return {i.name: i.in_flight for i in self.prefill}

    def all(self) -> list[InstanceState]:
        return list(self.by_name.values())

    def choose(self, candidates: list[InstanceState], matched: dict[PodId, int] | None = None,
               exclude: set[PodId] | frozenset = frozenset()) -> InstanceState | None:
        """Best healthy candidate not in ``exclude``; None when none is left."""
        live = [c for c in candidates if c.healthy and c.name not in exclude]
        probe = self._probe(candidates, exclude)
        if probe is not None:
            return probe
        if not live:
            # Everything ejected: try the un-excluded ones anyway rather than
            # refuse; a health check may simply be late.
            live = [c for c in candidates if c.name not in exclude]
            if not live:
                return None
        key = tuple(c.name for c in candidates)
        counter = self._rr.get(key)
        if counter is None:
            counter = self._rr[key] = itertools.count()
        rr = next(counter)
        matched = matched or {}
        n = len(live)
        ranked = sorted(
            range(n),
            key=lambda i: (-matched.get(live[i].name, 0), live[i].in_flight, (i - rr) % n),
        )
        return live[ranked[0]]

    @contextmanager
    def busy(self, inst: InstanceState) -> Iterator[InstanceState]:
        inst.in_flight += 1
        try:
            yield inst
        finally:
            inst.in_flight -= 1

    def _probe(self, candidates: list[InstanceState],
               exclude: set[PodId] | frozenset) -> InstanceState | None:
        """A legs-ejected candidate due for its probe leg (then not again for a while)."""
        now = self.clock()
        for c in candidates:
            if (c.ejected == Ejected.LEGS and c.name not in exclude and now >= c.probe_at):
                c.probe_at = now + self.probe_interval_s
                return c
        return None

    def _eject(self, inst: InstanceState, why: str, count: int) -> None:
        if inst.healthy:
            log.warning("ejecting %s (%s) after %d failure(s): %s", inst.name, inst.url,
                        count, why)
            inst.healthy = False
            inst.ejected = why
            inst.probe_at = self.clock() + self.probe_interval_s
            self.on_eject(inst, why)
        elif why == Ejected.LEGS:
            inst.ejected = why  # a legs ejection outlives a health one

    def mark_failed(self, inst: InstanceState, hard: bool = False) -> None:
        """A health check of ``inst`` failed (or it refused a connection: ``hard``, ejects
        now)."""
        inst.failures += 1
        if hard and inst.ejected == Ejected.LEGS:
            inst.ejected = Ejected.HEALTH  # refused: the process its legs wedged on is gone
        if hard or inst.failures >= self.eject_after:
            self._eject(inst, Ejected.HEALTH, inst.failures)

    def leg_failed(self, inst: InstanceState) -> None:
        """A leg to ``inst`` timed out or broke: enough in a row eject it until a leg works."""
        inst.leg_failures += 1
        if inst.leg_failures >= self.eject_after:
            self._eject(inst, Ejected.LEGS, inst.leg_failures)

    def leg_ok(self, inst: InstanceState) -> None:
        """A leg to ``inst`` succeeded: the only way back from a legs ejection."""
        inst.leg_failures = 0
        if not inst.healthy:
            self._admit(inst)

    def mark_ok(self, inst: InstanceState) -> None:
        """A health check of ``inst`` succeeded: readmits it unless its legs ejected it."""
        inst.failures = 0
        if not inst.healthy and inst.ejected != Ejected.LEGS:
            self._admit(inst)

    def _admit(self, inst: InstanceState) -> None:
        log.info("readmitting %s (%s)", inst.name, inst.url)
        inst.failures = 0
        inst.healthy = True
        inst.ejected = None

    async def check_all(self, client: httpx.AsyncClient, timeout_s: float) -> None:
        async def one(inst: InstanceState) -> None:
            try:
                r = await client.get(f"{inst.url}/health", timeout=timeout_s)
                ok = r.status_code == 200
            except httpx.HTTPError:
                ok = False
            if ok:
                self.mark_ok(inst)
            else:
                self.mark_failed(inst)

        await asyncio.gather(*(one(i) for i in self.all()))
