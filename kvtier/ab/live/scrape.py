"""Reading Prometheus text exposition: one sample sum, parsed by ``prometheus_client``.

``metric(text, name, labels)`` is the one reader of ``/metrics`` pages in kvtier's harness and
tests (vLLM engines, the router, the indexer, the host tier); ``scrape(client, url, name)``
fetches and reads in one call for the A/B runner's samplers.

Names are *sample* names as they appear on the page (``vllm:nixl_xfer_time_seconds_sum``,
``kvtier_tier_bytes_moved_total``), not family names: a counter's family drops ``_total`` and
a histogram's family owns ``_sum``/``_count``/``_bucket``, and callers ask for the line they see.

Threading model: pure functions; ``scrape`` uses the caller's ``httpx.Client`` on the caller's
thread.
"""

from __future__ import annotations

from collections.abc import Mapping

import httpx
from prometheus_client.parser import text_string_to_metric_families


def metric(text: str, name: str, labels: Mapping[str, str] | None = None, *,
           required: bool = False) -> float:
    """Sum of every sample called ``name`` whose labels include ``labels`` (0.0 when none;
    ``KeyError`` instead with ``required``). Raises ``ValueError`` on a malformed page."""
    want = dict(labels or {})
    total, seen = 0.0, False
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and want.items() <= s.labels.items():
                total += s.value
                seen = True
    if required and not seen:
        raise KeyError(f"no sample {name}{want or ''} on the metrics page")
    return total


def scrape(client: httpx.Client, url: str, name: str,
           labels: Mapping[str, str] | None = None) -> float:
    """``metric`` of ``url``'s ``/metrics``; NaN when the page cannot be fetched or parsed
    (a sampler keeps going while an engine restarts or stops)."""
    try:
        text = client.get(f"{url}/metrics", timeout=5).text
        return metric(text, name, labels)
    except (httpx.HTTPError, ValueError):
        return float("nan")
