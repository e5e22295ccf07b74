"""Retention accounting as Prometheus metrics, served from the tier's own process.

The host tier's manager (and so its ``TierStats``) lives in vLLM's scheduler
process (EngineCore), not in the API server whose ``/metrics`` vLLM serves.
So the tier serves its own Prometheus endpoint: ``TierMetricsServer`` wraps a
``snapshot`` callable (STYLE rule 9: metrics as a wrapper, nothing in the
tier knows about Prometheus) in a collector that reads the stats *at scrape
time*, so ``block_seconds_held`` is exact to the scrape with no sampling
thread. Port: ``metrics_port`` in the connector's config or
``KVTIER_METRICS_PORT`` in the instance's environment.

Metrics (prefix ``kvtier_tier_``; labels ``pod`` and ``model`` on every one):

====================================  =======  =========================================
name                                  type     meaning
====================================  =======  =========================================
blocks_held / bytes_held              gauge    READY blocks (and their bytes) now held
capacity_bytes                        gauge    pool size
block_seconds_held_total              counter  integral of blocks_held over time
byte_seconds_held_total               counter  integral of bytes_held over time (the A/B
                                               harness's retention cost: rate() of it is
                                               the mean bytes held over a window)
hit_blocks_total                      counter  blocks found by prefix lookups
miss_lookups_total                    counter  prefix lookups that ended on a missing block
evictions_total                       counter  blocks evicted (LRU, invalidation)
stores_skipped_total                  counter  blocks offered for store that were present
stores_refused_total                  counter  blocks not stored: tier full of pinned blocks
bytes_moved_total{path}               counter  store | load | peer_in | peer_out
peer_fallbacks_total{reason}          counter  peer fetches that fell back to recompute
peer_fetches_total                    counter  peer fetches that asked a source
peer_fetch_seconds_total{phase}       counter  the reader's seconds in them: handshake |
                                               hold | read | release (rate() of one over
                                               rate() of peer_fetches: its mean per fetch)
====================================  =======  =========================================

Threading model: prometheus_client's HTTP server thread calls ``snapshot``;
the callable must take the tier's lock itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvtier.tier.accounting import PATHS, PEER_PHASES

PREFIX = "kvtier_tier_"


class TierCollector(Collector):
    def __init__(self, snapshot: Callable[[], dict[str, Any]], slot_bytes: int,
                 capacity_bytes: int, pod: str, model: str):
        self.snapshot = snapshot
        self.slot_bytes, self.capacity_bytes = slot_bytes, capacity_bytes
        self.labels = {"pod": pod, "model": model}

    def _fam(self, cls: type[CounterMetricFamily] | type[GaugeMetricFamily], name: str, doc: str,
             value: float, **extra: str) -> Metric:
        labels = {**self.labels, **extra}
        fam = cls(PREFIX + name, doc, labels=list(labels))
        fam.add_metric(list(labels.values()), value)
        return fam

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot()
        g, c = GaugeMetricFamily, CounterMetricFamily
        yield self._fam(g, "blocks_held", "READY blocks held in the host tier", s["blocks_held"])
        yield self._fam(g, "bytes_held", "Bytes of READY blocks held", s["bytes_held"])
        yield self._fam(g, "capacity_bytes", "Host tier pool size", self.capacity_bytes)
        # Counter families take the name without _total; the exposition adds it.
        yield self._fam(c, "block_seconds_held", "Integral of blocks held over time",
                        s["block_seconds_held"])
        yield self._fam(c, "byte_seconds_held", "Integral of bytes held over time",
                        s["block_seconds_held"] * self.slot_bytes)
        yield self._fam(c, "hit_blocks", "Blocks found by prefix lookups", s["hits"])
        yield self._fam(c, "miss_lookups", "Prefix lookups ended by a missing block", s["misses"])
        yield self._fam(c, "evictions", "Blocks evicted", s["evictions"])
        yield self._fam(c, "stores_skipped", "Blocks offered for store already present",
                        s["stores_skipped"])
        yield self._fam(c, "stores_refused", "Blocks not stored because the tier was full",
                        s["stores_refused"])
        moved = c(PREFIX + "bytes_moved", "Bytes moved per path", labels=[*self.labels, "path"])
        for path in PATHS:
            moved.add_metric([*self.labels.values(), path], s["bytes_moved"].get(path, 0))
        yield moved
        fb = c(PREFIX + "peer_fallbacks", "Peer fetches that fell back to recompute, by reason",
               labels=[*self.labels, "reason"])
        for reason, n in sorted(s["peer_fallbacks"].items()):
            fb.add_metric([*self.labels.values(), reason], n)
        yield fb
        yield self._fam(c, "peer_fetches", "Peer fetches that asked a source", s["peer_fetches"])
        secs = c(PREFIX + "peer_fetch_seconds", "Reader's seconds in peer fetches, by phase",
                 labels=[*self.labels, "phase"])
        for phase in PEER_PHASES:
            secs.add_metric([*self.labels.values(), phase], s["peer_fetch_s"].get(phase, 0.0))
        yield secs


class TierMetricsServer:
    """``/metrics`` on ``http://host:port`` for one tier; ``close()`` stops it."""

    def __init__(self, collector: TierCollector, port: int, host: str = "127.0.0.1"):
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(collector)
        self.server, self.thread = start_http_server(port, host, registry=self.registry)
        self.url = f"http://{host}:{self.server.server_port}/metrics"

    def close(self) -> None:
        """Stop serving and free the port; idempotent."""
        if not self.thread.is_alive():
            return
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)
