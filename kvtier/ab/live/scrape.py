"""Reading Prometheus text exposition: one sample sum, parsed by ``prometheus_client``.

``metric(text, name, labels)`` is the one reader of ``/metrics`` pages in kvtier's harness and
tests (vLLM engines, the router, the indexer, the host tier); ``scrape(client, url, name)``
fetches and reads in one call for the A/B runner's samplers.

Names are *sample* names as they appear on the page (``vllm:nixl_xfer_time_seconds_sum``,
``kvtier_tier_bytes_moved_total``), not family names: a counter's family drops ``_total`` and
a histogram's family owns ``_sum``/``_count``/``_bucket``, and callers ask for the line they see.

``histogram(text, family)`` reads one histogram (buckets summed over label sets, ``_sum``,
``_count``); ``page(client, url)`` fetches a ``/metrics`` page once for several reads.

Threading model: pure functions; ``scrape`` and ``page`` use the caller's ``httpx.Client`` on
the caller's thread.
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


def page(client: httpx.Client, url: str) -> str | None:
    """The text of ``url``'s ``/metrics`` (None when it cannot be fetched)."""
    try:
        r = client.get(f"{url}/metrics", timeout=5)
    except httpx.HTTPError:
        return None
    return r.text if r.status_code == 200 else None


def histogram(text: str, family: str, labels: Mapping[str, str] | None = None) -> dict:
    """Histogram ``family`` (the name without ``_bucket``/``_sum``/``_count``) summed over the
    label sets that include ``labels``: ``{"buckets": [[le, count], ...], "sum", "count"}``
    with cumulative counts and ``le`` as written on the page ("+Inf" included). Empty
    buckets when the page has no such histogram. Raises ``ValueError`` on a malformed page."""
    want = dict(labels or {})
    buckets: dict[str, float] = {}
    total_sum = total_count = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if not want.items() <= s.labels.items():
                continue
            if s.name == f"{family}_bucket":
                le = s.labels.get("le", "+Inf")
                buckets[le] = buckets.get(le, 0.0) + s.value
            elif s.name == f"{family}_sum":
                total_sum += s.value
            elif s.name == f"{family}_count":
                total_count += s.value
    return {"buckets": sorted(([le, c] for le, c in buckets.items()), key=lambda x: float(x[0])),
            "sum": total_sum, "count": total_count}


def histogram_delta(end: dict, start: dict) -> dict:
    """``end - start`` of two ``histogram`` reads of one counter-like histogram."""
    before = {le: c for le, c in start.get("buckets", [])}
    return {"buckets": [[le, c - before.get(le, 0.0)] for le, c in end.get("buckets", [])],
            "sum": end.get("sum", 0.0) - start.get("sum", 0.0),
            "count": end.get("count", 0.0) - start.get("count", 0.0)}
