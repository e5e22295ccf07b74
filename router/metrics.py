"""Prometheus metrics of one router app (prefix ``kvtier_router_``).

Each app owns a ``CollectorRegistry`` so several routers (tests, the A/B
harness) can live in one process without clashing.

Threading model: prometheus_client metrics are thread-safe; the app's event
loop is the only writer.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LAT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        p = "kvtier_router_"
        self.requests = Counter(p + "requests", "Client requests by endpoint and final status",
                                ["endpoint", "status"], registry=r)
        self.ttft = Histogram(p + "ttft_seconds", "Time to the first byte sent to the client",
                              ["endpoint", "stream"], buckets=_LAT_BUCKETS, registry=r)
        self.e2e = Histogram(p + "e2e_seconds", "Request latency, first byte in to last byte out",
                             ["endpoint", "stream"], buckets=_LAT_BUCKETS, registry=r)
        # kvtier_router_reuse_total{path}: path is a kvtier.ids.ReusePath value. Requests
        # served in direct mode count as "none" (no prefill leg reused anything for them).
        self.reuse = Counter(p + "reuse", "Prefill legs by planned KV reuse path "
                             "(dp_read: D->P read of the last turn, p2p: peer host tier, "
                             "local: prefill's own cache per indexer, none; direct mode: none)",
                             ["path"], registry=r)
        self.reused_tokens = Counter(p + "reused_tokens", "Tokens of D's KV handed to prefills",
                                     registry=r)
        self.params_dropped = Counter(p + "params_dropped", "Retained decode params not used",
                                      ["reason"], registry=r)
        self.params_trimmed = Counter(p + "params_trimmed",
                                      "Retained params trimmed to a proven prefix", registry=r)
        self.upstream_errors = Counter(p + "upstream_errors", "Failed engine legs",
                                       ["leg", "kind"], registry=r)
        self.retries = Counter(p + "retries", "Legs retried elsewhere or recomputed",
                               ["leg", "action"], registry=r)
        self.indexer_unavailable = Counter(p + "indexer_unavailable",
                                           "Indexer calls that failed (request served anyway)",
                                           ["call"], registry=r)
        self.bad_requests = Counter(p + "bad_requests", "Requests refused with 4xx by the router",
                                    registry=r)
        self.client_disconnects = Counter(p + "client_disconnects",
                                          "Clients gone before the answer; upstream cancelled",
                                          registry=r)
        self.params_feed = Counter(p + "params_feed", "Decode params feed: messages received "
                                   "for a streamed leg, waits timed out, malformed messages, "
                                   "legs not registered (overflow)", ["result"], registry=r)
        self.params_in_stream = Counter(p + "params_in_stream", "Engine kv_transfer_params "
                                        "found in a relayed stream (stripped)", registry=r)
        self.conversations = Gauge(p + "conversations", "Entries in the conversation store",
                                   registry=r)
        self.store_bytes = Gauge(p + "conversation_store_bytes", "Bytes held by the store",
                                 registry=r)
        self.healthy = Gauge(p + "instance_healthy", "1 if the instance is admitted",
                             ["instance", "role"], registry=r)
        self.in_flight = Gauge(p + "instance_in_flight", "Requests in flight per instance",
                               ["instance"], registry=r)
