"""Prometheus metrics of the indexer (prefix ``kvtier_indexer_``), as wrappers.

- ``InstrumentedIndex`` wraps any ``KVIndex`` and times ``lookup`` (the
  llm-d ``InstrumentedIndex`` pattern), so backends stay free of metrics.
- Per-stream series carry ``pod`` (the pod name) and ``stream`` (the stream
  id: the pod name for a pod's first stream); ``pod_stale`` is per pod.
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
from collections import defaultdict
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvtier.ids import EngineBlockHash, PodId, RequestKey, Tier
from kvtier.indexer.index import BackendUnavailable

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
        self._stale_after_s = 10.0
        self.registry.register(self)

    def bind(self, subscriber: Subscriber, index: KVIndex, stale_after_s: float = 10.0) -> None:
        self._subscriber, self._index = subscriber, index
        self._stale_after_s = stale_after_s

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        sub, idx = self._subscriber, self._index
        if sub is None or idx is None:
            return
        pods = list(sub.streams.values())
        applied = CounterMetricFamily(P + "events_applied", "KV events applied",
                                      labels=["pod", "stream", "kind"])
        dropped = CounterMetricFamily(P + "events_dropped", "Blocks or events not indexed",
                                      labels=["pod", "stream", "reason"])
        simple: dict[str, tuple[str, str | None]] = {
            "gaps": ("Sequence discontinuities seen (recovered by replay or not)", "gaps"),
            "missing_batches": ("Event batches lost for good", "missing"),
            "malformed_frames": ("Frames that could not be decoded", "malformed"),
            "replays": ("Replay requests sent", "replays"),
            "replay_timeouts": ("Replay requests not answered in time", "replay_timeouts"),
            "publisher_restarts": ("Publisher restarts detected (seq went back)", "restarts"),
            "backend_resyncs": ("Replays after the index backend failed", "resyncs"),
            "blocks_stored": ("Blocks stored", None),
        }
        lab = ["pod", "stream"]
        fams = {k: CounterMetricFamily(P + k, h, labels=lab) for k, (h, _) in simple.items()}
        connected = GaugeMetricFamily(P + "pod_connected", "1 if the stream's PUB is connected",
                                      labels=lab)
        last_seq = GaugeMetricFamily(P + "pod_last_seq", "Last event batch seq received",
                                     labels=lab)
        stale = GaugeMetricFamily(P + "pod_stale", "1 if the pod is not offered as a source "
                                  "(every stream down past stale_after_s)", labels=["pod"])
        now = time.monotonic()
        pod_stale: defaultdict[str, bool] = defaultdict(lambda: True)
        for st in pods:
            n = [st.pod, st.name]
            for kind, v in list(st.counters.applied.items()):
                applied.add_metric([*n, kind], v)
            for reason, v in list(st.counters.dropped.items()):
                dropped.add_metric([*n, reason], v)
            for k, (_, attr) in simple.items():
                fams[k].add_metric(n, st.counters.blocks_stored if attr is None
                                   else getattr(st, attr))
            connected.add_metric(n, 1.0 if st.connected else 0.0)
            last_seq.add_metric(n, st.last_seq)
            pod_stale[st.pod] &= st.stale(now, self._stale_after_s)
        for pod, is_stale in pod_stale.items():
            stale.add_metric([pod], 1.0 if is_stale else 0.0)
        try:
            stats: IndexStats | None = idx.stats()
        except BackendUnavailable:
            stats = None
        yield applied
        yield dropped
        yield from fams.values()
        yield connected
        yield last_seq
        yield stale
        yield GaugeMetricFamily(P + "pods", "Subscribed pods", value=len(pod_stale))
        yield GaugeMetricFamily(P + "streams", "Subscribed event streams", value=len(pods))
        yield GaugeMetricFamily(P + "backend_up", "1 if the index backend answers",
                                value=0.0 if stats is None else 1.0)
        if stats is None:
            return
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

    def ping(self) -> None:
        self._inner.ping()

    def close(self) -> None:
        self._inner.close()

    def __getattr__(self, name: str) -> Any:  # anything else a backend has (``pods``, ...)
        return getattr(self._inner, name)
