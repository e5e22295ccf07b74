"""How pressed each decode node is for KV memory, from its own metrics: ``DecodePressure``.

With ``hold_pressure`` the router's health loop scrapes every decode instance's ``/metrics``
(vLLM's Prometheus page) each ``health_interval_s`` and keeps two figures per node:

- ``vllm:kv_cache_usage_perc``: the share of its KV cache in use, in [0, 1] (vLLM exports a
  fraction despite the name; the largest over the page's series, one per engine);
- ``vllm:num_requests_waiting``: requests queued for a slot (the sum over series).

``factor(pod)`` turns them into the hold policy's price factor ``f`` (``kvtier.cost.hold.
pressure_factor``: 1 at half full, larger on an emptier node, smaller as it fills). A node
whose page did not answer, lacks the two metrics, or was last read more than ``STALE_AFTER``
health intervals ago counts as unknown: ``f = 1``, the configured price, as without pressure. Each node's figures are
exposed (``kvtier_router_decode_pressure{instance,signal}``).

Threading model: one asyncio loop (the router's); ``sample`` runs in the health loop, the
request path only reads ``factor``.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass

import httpx

from kvtier.cost.hold import pressure_factor
from kvtier.ids import PodId
from kvtier.router.metrics import RouterMetrics

USAGE = "vllm:kv_cache_usage_perc"
WAITING = "vllm:num_requests_waiting"
STALE_AFTER = 3.0  # health intervals after which a node's last figures no longer count


@dataclass(frozen=True, slots=True)
class Pressure:
    usage: float    # share of the KV cache in use, [0, 1]
    waiting: float  # requests waiting
    at: float       # monotonic time of the scrape


def parse(page: str) -> Pressure | None:
    """The two figures from a Prometheus text page; None when either is missing."""
    usage: float | None = None
    waiting: float | None = None
    for line in page.splitlines():
        if not line.startswith(("vllm:kv_cache_usage_perc", "vllm:num_requests_waiting")):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        try:
            rest = line.rsplit("}", 1)[1] if "}" in line else line.split(None, 1)[1]
            value = float(rest.split()[0])
        except (ValueError, IndexError):
            continue
        if not math.isfinite(value):
            continue
        if name == USAGE:
            usage = value if usage is None else max(usage, value)
        elif name == WAITING:
            waiting = value if waiting is None else waiting + value
    if usage is None or waiting is None:
        return None
    return Pressure(min(1.0, max(0.0, usage)), max(0.0, waiting), time.monotonic())


class DecodePressure:
    def __init__(self, nodes: Iterable[tuple[PodId, str]], metrics: RouterMetrics, *,
                 interval_s: float, waiting_ref: float = 4.0) -> None:
        self.nodes = dict(nodes)  # pod -> base url
        self.metrics = metrics
        self.max_age_s = STALE_AFTER * interval_s
        self.waiting_ref = waiting_ref
        self._last: dict[PodId, Pressure] = {}

    async def sample(self, client: httpx.AsyncClient, timeout_s: float) -> None:
        """Scrape every decode node once (concurrently); a failure leaves its last figures."""
        async def one(pod: PodId, url: str) -> None:
            try:
                r = await client.get(f"{url}/metrics", timeout=timeout_s)
            except httpx.HTTPError:
                return
            p = parse(r.text) if r.status_code == 200 else None
            if p is not None:
                self.observe(pod, p)

        await asyncio.gather(*(one(p, u) for p, u in self.nodes.items()))

    def observe(self, pod: PodId, p: Pressure) -> None:
        self._last[pod] = p
        g = self.metrics.decode_pressure
        g.labels(pod, "kv_cache_usage").set(p.usage)
        g.labels(pod, "requests_waiting").set(p.waiting)
        g.labels(pod, "factor").set(pressure_factor(p.usage, p.waiting, self.waiting_ref))

    def of(self, pod: PodId) -> Pressure | None:
        """``pod``'s last figures, None when unknown or stale."""
        p = self._last.get(pod)
        if p is None or time.monotonic() - p.at > self.max_age_s:
            return None
        return p

    def factor(self, pod: PodId) -> float:
        """The hold price factor for ``pod`` (1: unknown or idle)."""
        p = self.of(pod)
        return 1.0 if p is None else pressure_factor(p.usage, p.waiting, self.waiting_ref)
