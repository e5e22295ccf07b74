"""Prometheus metrics of the indexer (prefix ``kvtier_indexer_``), as wrappers.

- ``InstrumentedIndex`` wraps any ``KVIndex`` and times ``lookup`` (the
  llm-d ``InstrumentedIndex`` pattern), so backends stay free of metrics.
- Subscriber and index counters are read at scrape time by a custom
  collector from the state the subscriber keeps anyway (``PodState``), so
  nothing in the event path calls into prometheus_client.

Each service has its own ``CollectorRegistry`` (several indexers may live in
one process, e.g. in tests).

Threading model: prometheus_client metrics are thread-safe; the collector
reads plain ints that other threads update (a scrape may see a torn but
never invalid view).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvtier.ids import EngineBlockHash, PodId, RequestKey, Tier

if TYPE_CHECKING:
    from kvtier.indexer.index import Holder, IndexStats, KVIndex, MappingEntry
    from kvtier.indexer.subscriber import Subscriber

P = "kvtier_indexer_"


class IndexerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.lookup_seconds = Histogram(
            P + "lookup_seconds", "Index lookup latency (hashing excluded)",
            buckets=(1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0),
            registry=self.registry)
        self._subscriber: Subscriber | None = None
        self._index: KVIndex | None = None
        self.registry.register(self)

    def bind(self, subscriber: Subscriber, index: KVIndex) -> None:
        self._subscriber, self._index = subscriber, index

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        sub, idx = self._subscriber, self._index
        if sub is None or idx is None:
            return
        pods = list(sub.pods.values())
        applied = CounterMetricFamily(P + "events_applied", "KV events applied", labels=["pod", "kind"])
        dropped = CounterMetricFamily(P + "events_dropped", "Blocks or events not indexed",
                                      labels=["pod", "reason"])
        simple: dict[str, tuple[str, str | None]] = {
            "gaps": ("Sequence discontinuities seen (recovered by replay or not)", "gaps"),
            "missing_batches": ("Event batches lost for good", "missing"),
            "malformed_frames": ("Frames that could not be decoded", "malformed"),
            "replays": ("Replay requests sent", "replays"),
            "replay_timeouts": ("Replay requests not answered in time", "replay_timeouts"),
            "publisher_restarts": ("Publisher restarts detected (seq went back)", "restarts"),
            "blocks_stored": ("Blocks stored", None),
        }
        fams = {k: CounterMetricFamily(P + k, h, labels=["pod"]) for k, (h, _) in simple.items()}
        connected = GaugeMetricFamily(P + "pod_connected", "1 if the pod's PUB is connected",
                                      labels=["pod"])
        last_seq = GaugeMetricFamily(P + "pod_last_seq", "Last event batch seq received",
                                     labels=["pod"])
        for st in pods:
            n = st.spec.name
            for kind, v in list(st.counters.applied.items()):
                applied.add_metric([n, kind], v)
            for reason, v in list(st.counters.dropped.items()):
                dropped.add_metric([n, reason], v)
            for k, (_, attr) in simple.items():
                fams[k].add_metric([n], st.counters.blocks_stored if attr is None
                                   else getattr(st, attr))
            connected.add_metric([n], 1.0 if st.connected else 0.0)
            last_seq.add_metric([n], st.last_seq)
        stats = idx.stats()
        yield applied
        yield dropped
        yield from fams.values()
        yield connected
        yield last_seq
        yield GaugeMetricFamily(P + "pods", "Subscribed pods", value=len(pods))
        yield GaugeMetricFamily(P + "index_keys", "Request keys in the index", value=stats.keys)
        yield GaugeMetricFamily(P + "index_mappings", "Engine-hash mappings (all pods)",
                                value=stats.mappings)
        yield CounterMetricFamily(P + "index_evicted_keys", "Keys evicted by the capacity bound",
                                  value=stats.evicted)


class InstrumentedIndex:
    """A ``KVIndex`` that records lookup latency; everything else passes through."""

    def __init__(self, inner: KVIndex, metrics: IndexerMetrics) -> None:
        self._inner = inner
        self._hist = metrics.lookup_seconds

    def lookup(self, keys: Sequence[RequestKey]) -> dict[Holder, int]:
        t0 = time.perf_counter()
        try:
            return self._inner.lookup(keys)
        finally:
            self._hist.observe(time.perf_counter() - t0)

    def store(self, pod: PodId, tier: Tier,
              blocks: Sequence[tuple[EngineBlockHash, RequestKey]]) -> None:
        self._inner.store(pod, tier, blocks)

    def resolve(self, pod: PodId, engine_hash: EngineBlockHash) -> RequestKey | None:
        return self._inner.resolve(pod, engine_hash)

    def remove(self, pod: PodId, tier: Tier, hashes: Sequence[EngineBlockHash]) -> int:
        return self._inner.remove(pod, tier, hashes)

    def clear_pod(self, pod: PodId) -> int:
        return self._inner.clear_pod(pod)

    def pod_entries(self, pod: PodId) -> list[MappingEntry]:
        return self._inner.pod_entries(pod)

    def stats(self) -> IndexStats:
        return self._inner.stats()

    def close(self) -> None:
        self._inner.close()

    def __getattr__(self, name: str) -> Any:  # anything else a backend has (``pods``, ...)
        return getattr(self._inner, name)
