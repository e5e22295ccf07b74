"""What each decode node can give the router, said once at start and on ``/healthz``.

Streaming with reuse needs a decode node's params feed, and leases need its lease server
(both ``KVTierNixlConnector``: ``configs/nixl-bidirectional-lease.json``). A router configured
for them against a node that lacks them still serves, but worse than asked: a streamed turn
arrives as one chunk, a closed conversation's blocks stay until vLLM's TTL. So:

- at start, one WARNING per node and missing capability (``RouterConfig.capability_warnings``);
- the lease server of every node that has one is probed (a ``stats`` call) until it answers
  once; a node whose server does not answer is logged once, and again when it does;
- ``/healthz`` shows per decode node: its feed, its lease state (``none``, ``unknown`` before
  the first answer, ``ok``, ``unreachable``) and the warnings.

Threading model: one asyncio loop (the router's).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from kvtier.ids import PodId
from kvtier.router.config import RouterConfig
from kvtier.router.leases import LeaseKeeper
from kvtier.wire.leases import LeaseRequest, Op

log = logging.getLogger("kvtier.router.capabilities")

PROBE_INTERVAL_S = 2.0


class DecodeCapabilities:
    def __init__(self, cfg: RouterConfig, keeper: LeaseKeeper) -> None:
        self._cfg = cfg
        self._keeper = keeper
        self.warnings = cfg.capability_warnings()
        self.lease: dict[PodId, str] = {
            i.name: ("unknown" if i.lease and keeper.has(i.name) else "none")
            for i in cfg.decode_instances}
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        for pod, why in self.warnings.items():
            for w in why:
                log.warning("decode node %s: %s", pod, w)
        if any(state == "unknown" for state in self.lease.values()):
            self._task = asyncio.get_running_loop().create_task(self._probe())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _probe(self) -> None:
        pending = [p for p, state in self.lease.items() if state == "unknown"]
        while pending:
            for pod in list(pending):
                reply = await self._keeper.call(pod, LeaseRequest(Op.STATS))
                if reply is not None and reply.ok:
                    if self.lease[pod] == "unreachable":
                        log.warning("decode node %s: its lease server answers now", pod)
                    self.lease[pod] = "ok"
                    pending.remove(pod)
                elif self.lease[pod] != "unreachable":
                    self.lease[pod] = "unreachable"
                    log.warning("decode node %s: its lease server at %s does not answer: "
                                "leases are not renewed or released there until it does",
                                pod, self._keeper.endpoints[pod])
            if pending:
                await asyncio.sleep(PROBE_INTERVAL_S)

    def describe(self) -> dict[str, Any]:
        return {i.name: {"params_feed": i.params_feed, "lease": self.lease[i.name],
                         "lease_endpoint": i.lease, "warnings": self.warnings.get(i.name, [])}
                for i in self._cfg.decode_instances}
