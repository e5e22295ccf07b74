"""Instance pool: health, in-flight counts and the choice of instances.

Choice, in order: among healthy instances of the role, prefer the longest
cached prefix the indexer reports (KV-aware), then the fewest in-flight
requests (load-aware), then round-robin. Instances that fail a health check
``eject_after_failures`` times in a row, or refuse a connection, are ejected;
one successful check readmits them.

Threading model: one asyncio event loop owns a pool; nothing here awaits
except ``check_all`` (the health loop), which only flips flags.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
from kvtier.router.config import InstanceConfig

from kvtier.ids import PodId

log = logging.getLogger(__name__)


@dataclass
class InstanceState:
    cfg: InstanceConfig
    healthy: bool = True
    failures: int = 0
    in_flight: int = 0

    @property
    def name(self) -> PodId:
        return self.cfg.name

    @property
    def url(self) -> str:
        return self.cfg.url


class InstancePool:
    def __init__(self, prefill: Iterable[InstanceConfig], decode: Iterable[InstanceConfig],
                 eject_after_failures: int = 2):
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
        self._rr = itertools.count()

    def all(self) -> list[InstanceState]:
        return list(self.by_name.values())

    def choose(self, candidates: list[InstanceState], matched: dict[PodId, int] | None = None,
               exclude: set[PodId] | frozenset = frozenset()) -> InstanceState | None:
        """Best healthy candidate not in ``exclude``; None when none is left."""
        live = [c for c in candidates if c.healthy and c.name not in exclude]
        if not live:
            # Everything ejected: try the un-excluded ones anyway rather than
            # refuse; a health check may simply be late.
            live = [c for c in candidates if c.name not in exclude]
            if not live:
                return None
        rr = next(self._rr)
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

    def mark_failed(self, inst: InstanceState, hard: bool = False) -> None:
        """A request to ``inst`` failed; ``hard`` (refused connection) ejects now."""
        inst.failures += 1
        if hard or inst.failures >= self.eject_after:
            if inst.healthy:
                log.warning("ejecting %s (%s) after %d failure(s)", inst.name, inst.url,
                            inst.failures)
            inst.healthy = False

    def mark_ok(self, inst: InstanceState) -> None:
        if not inst.healthy:
            log.info("readmitting %s (%s)", inst.name, inst.url)
        inst.failures = 0
        inst.healthy = True

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
