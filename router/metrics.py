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
        self.loop_stalls = Histogram(p + "event_loop_stall_seconds", "Stalls of the router's "
                                     "event loop of at least loop_stall_warn_s (every request "
                                     "waited meanwhile; the log names the blocking line)",
                                     buckets=(1, 2.5, 5, 10, 30, 60, 120, 300), registry=r)
        self.stale_resends = Counter(p + "upstream_stale_resends",
                                     "Engine requests sent again on a new connection after the "
                                     "pooled one they were written on turned out closed",
                                     registry=r)
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
                                   "messages no leg of this router waited for (unmatched), "
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
        self.ejections = Counter(p + "instance_ejections", "Instances ejected, by cause "
                                 "(health: failed checks or refused connection; legs: legs "
                                 "timed out or broke in a row)", ["instance", "reason"],
                                 registry=r)
        # The conversation store (memory or redis).
        self.store_backend = Gauge(p + "store_backend", "1 for the conversation store backend "
                                   "in use", ["backend"], registry=r)
        self.store_up = Gauge(p + "store_up", "1 while the conversation store answers",
                              registry=r)
        self.store_lookups = Counter(p + "store_lookups", "Conversation store takes by result "
                                     "(hit, miss, expired, unavailable) and how the "
                                     "conversation was named (named, implicit)",
                                     ["result", "session"], registry=r)
        self.store_dropped = Counter(p + "store_dropped", "Entries dropped before use, by "
                                     "reason (evicted, expired, decode_down)", ["reason"],
                                     registry=r)
        self.store_errors = Counter(p + "store_errors", "Store calls that failed or were "
                                    "skipped while the store is down (turn served without "
                                    "reuse)", ["op"], registry=r)
        self.store_latency = Histogram(p + "store_latency_seconds", "Conversation store call "
                                       "latency (Redis round trips)", ["op"],
                                       buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005,
                                                0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1),
                                       registry=r)
        self.dependency_up = Gauge(p + "dependency_up", "1 while a dependency answers "
                                   "(indexer, store)", ["dependency"], registry=r)
        # The cost model in use (router/costs.py): refits online, and what it predicts.
        self.cost_refits = Counter(p + "cost_refits", "Online refits of the cost model that "
                                   "changed it (cost_refit)", registry=r)
        self.cost_model_seconds = Gauge(p + "cost_model_seconds", "The cost model in use, by "
                                        "term: prefill_fixed, prefill_per_token, PATH_setup",
                                        ["term"], registry=r)
        # What each path really cost (kvtier.cost.estimator, cost_learn) and the exploration.
        self.cost_estimate = Gauge(p + "cost_estimate_seconds", "Live estimate of a prefill "
                                   "leg's seconds by reuse path and context bucket (tokens): "
                                   "the median of the bucket's recent legs; the decision blends "
                                   "it with the cost model by sample count", ["path", "bucket"],
                                   registry=r)
        self.cost_estimate_samples = Gauge(p + "cost_estimate_samples", "Samples behind each "
                                           "cost estimate (its ring, bounded)",
                                           ["path", "bucket"], registry=r)
        self.cost_explored = Counter(p + "cost_explored", "Turns whose reuse path was taken to "
                                     "keep a young or stale estimate alive (explore_share), "
                                     "by the path taken", ["path"], registry=r)
        self.cost_switches = Counter(p + "cost_switches", "Context buckets whose chosen "
                                     "path changed between reusing and recomputing (explored "
                                     "turns aside), by bucket and by what it chose now "
                                     "(reuse, recompute); each switch is logged", ["bucket", "to"],
                                     registry=r)
        # Decode pressure (router/pressure.py, hold_pressure): what prices a held turn.
        self.decode_pressure = Gauge(p + "decode_pressure", "Each decode node's KV pressure "
                                     "as last scraped: kv_cache_usage (0-1), requests_waiting, "
                                     "and the factor on the hold price horizon (1: half full; "
                                     "above 1: emptier, holds priced lower)",
                                     ["instance", "signal"], registry=r)
        # Decode leases (router/retention.py): the router's side of retained device KV.
        self.lease_calls = Counter(p + "lease_calls", "Calls to decode nodes' lease servers "
                                   "by op (renew, release) and result (ok, refused, "
                                   "unavailable)", ["op", "result"], registry=r)
        self.lease_releases = Counter(p + "lease_releases", "Retained turns released early, "
                                      "by reason (closed, dropped, trimmed, moved)", ["reason"],
                                      registry=r)
        self.lease_lost = Counter(p + "lease_lost", "Leases a renewal found gone (expired, "
                                  "read or released elsewhere): their params are not offered",
                                  registry=r)
        self.leases_held = Gauge(p + "leases_held", "Retained turns this router renews, per "
                                 "decode instance", ["instance"], registry=r)
        self.hold_choices = Counter(p + "hold_choices", "Per-turn retention choices by basis "
                                    "(renew: fixed; adaptive: conversation, fleet, default) and "
                                    "action (hold, release)", ["basis", "action"], registry=r)
        self.hold_seconds = Histogram(p + "hold_seconds", "How long each retained turn is held "
                                      "on its decode device (0: released at once)",
                                      buckets=(0, 1, 5, 15, 30, 60, 120, 300, 600), registry=r)
        self.host_copy_checks = Counter(p + "host_copy_checks", "Continuation turns of adaptive "
                                        "retention by whether a host tier still held the turn "
                                        "before (held, gone): the host copy's survival rate",
                                        ["result"], registry=r)
