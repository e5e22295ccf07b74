"""Prometheus text reading (kvtier.ab.live.scrape): sample sums by name and labels."""

from __future__ import annotations

import math

import httpx
import pytest

from kvtier.ab.live.scrape import metric, scrape

PAGE = """\
# HELP vllm:num_requests_running Requests running.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 2.0
vllm:num_requests_running{engine="1",model_name="tiny"} 1.0
# HELP vllm:prompt_tokens_by_source Prompt tokens by source.
# TYPE vllm:prompt_tokens_by_source counter
vllm:prompt_tokens_by_source_total{model_name="tiny",source="local_compute"} 96.0
vllm:prompt_tokens_by_source_total{model_name="tiny",source="external_kv_transfer"} 288.0
vllm:prompt_tokens_by_source_created{model_name="tiny",source="local_compute"} 1.7e+09
# HELP vllm:nixl_xfer_time_seconds Transfer time.
# TYPE vllm:nixl_xfer_time_seconds histogram
vllm:nixl_xfer_time_seconds_bucket{le="0.1",model_name="tiny"} 3.0
vllm:nixl_xfer_time_seconds_bucket{le="+Inf",model_name="tiny"} 4.0
vllm:nixl_xfer_time_seconds_count{model_name="tiny"} 4.0
vllm:nixl_xfer_time_seconds_sum{model_name="tiny"} 0.25
# HELP kvtier_indexer_index_keys Request keys in the index
# TYPE kvtier_indexer_index_keys gauge
kvtier_indexer_index_keys 5.0
"""


def test_sums_samples_whose_labels_include_the_ones_asked_for() -> None:
    assert metric(PAGE, "vllm:num_requests_running") == 3.0
    assert metric(PAGE, "vllm:num_requests_running", {"engine": "1"}) == 1.0
    assert metric(PAGE, "vllm:prompt_tokens_by_source_total",
                  {"source": "external_kv_transfer"}) == 288.0
    assert metric(PAGE, "vllm:prompt_tokens_by_source_total") == 384.0
    assert metric(PAGE, "vllm:nixl_xfer_time_seconds_sum") == 0.25
    assert metric(PAGE, "kvtier_indexer_index_keys") == 5.0


def test_names_are_sample_names_not_prefixes_or_families() -> None:
    assert metric(PAGE, "vllm:num_requests") == 0.0
    assert metric(PAGE, "vllm:prompt_tokens_by_source") == 0.0  # the family; samples end _total
    assert metric(PAGE, "vllm:nixl_xfer_time_seconds_count") == 4.0


def test_absent_is_zero_unless_required() -> None:
    assert metric(PAGE, "vllm:num_requests_running", {"engine": "9"}) == 0.0
    assert metric("", "anything") == 0.0
    with pytest.raises(KeyError, match="engine"):
        metric(PAGE, "vllm:num_requests_running", {"engine": "9"}, required=True)
    assert metric(PAGE, "kvtier_indexer_index_keys", required=True) == 5.0


def test_a_malformed_page_raises() -> None:
    with pytest.raises(ValueError):
        metric("this is { not prometheus\n", "x")


def _client(handler: httpx.MockTransport) -> httpx.Client:
    return httpx.Client(transport=handler)


def test_scrape_fetches_and_is_nan_when_the_page_is_not_there() -> None:
    ok = httpx.MockTransport(lambda r: httpx.Response(200, text=PAGE))
    with _client(ok) as c:
        assert scrape(c, "http://e:1", "vllm:nixl_xfer_time_seconds_sum") == 0.25
        assert scrape(c, "http://e:1", "vllm:num_requests_running", {"engine": "0"}) == 2.0

    def down(r: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=r)

    with _client(httpx.MockTransport(down)) as c:
        assert math.isnan(scrape(c, "http://e:1", "vllm:num_requests_running"))
    garbage = httpx.MockTransport(lambda r: httpx.Response(500, text="Internal { error"))
    with _client(garbage) as c:
        assert math.isnan(scrape(c, "http://e:1", "vllm:num_requests_running"))
