"""The live runner's probes without servers: engine metric deltas and peaks, the decode nodes'
own retention metrics, the router's served log as a router process writes it
(kvtier.ab.live.probes)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

import httpx

from kvtier.ab.live.probes import (
    DecodeRetention,
    Endpoint,
    EngineProbe,
    RouterLog,
    ServedTurn,
    kv_capacity_blocks,
    lease_endpoint,
    lease_metrics_offset,
    lease_metrics_urls,
    lease_port_offset,
)
from kvtier.ab.records import RunResult, engine_summary
from kvtier.ab.strategies import builtin
from kvtier.configs import load_config_file
from kvtier.router.cli import JsonFormatter


def _engine_page(queue: tuple[float, float, float], itl_count: float, preempt: float,
                 running: float) -> str:
    q01, qinf, qsum = queue
    return f"""\
# TYPE vllm:request_queue_time_seconds histogram
vllm:request_queue_time_seconds_bucket{{engine="0",le="0.1",model_name="m"}} {q01}
vllm:request_queue_time_seconds_bucket{{engine="0",le="+Inf",model_name="m"}} {qinf}
vllm:request_queue_time_seconds_count{{engine="0",model_name="m"}} {qinf}
vllm:request_queue_time_seconds_sum{{engine="0",model_name="m"}} {qsum}
# TYPE vllm:inter_token_latency_seconds histogram
vllm:inter_token_latency_seconds_bucket{{engine="0",le="0.05",model_name="m"}} {itl_count}
vllm:inter_token_latency_seconds_bucket{{engine="0",le="+Inf",model_name="m"}} {itl_count}
vllm:inter_token_latency_seconds_count{{engine="0",model_name="m"}} {itl_count}
vllm:inter_token_latency_seconds_sum{{engine="0",model_name="m"}} {itl_count * 0.02}
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{{engine="0",model_name="m"}} {preempt}
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="m"}} {running}
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="m"}} 1.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} 0.25
"""


class Pages:
    """A fake fleet: each URL's /metrics text, changeable between reads."""

    def __init__(self, pages: dict[str, str]) -> None:
        self.pages = pages

    def client(self) -> httpx.Client:
        def handle(req: httpx.Request) -> httpx.Response:
            base = f"{req.url.scheme}://{req.url.host}:{req.url.port}"
            text = self.pages.get(base)
            return httpx.Response(200, text=text) if text is not None else httpx.Response(404)
        return httpx.Client(transport=httpx.MockTransport(handle))


def test_engine_probe_records_deltas_per_role_and_peaks() -> None:
    p, d = "http://127.0.0.1:1", "http://127.0.0.1:2"
    fleet = Pages({p: _engine_page((5, 5, 0.1), 0, 0, 0), d: _engine_page((2, 3, 0.5), 100, 1, 0)})
    probe = EngineProbe([Endpoint("prefill-0", "prefill", p), Endpoint("decode-0", "decode", d)])
    with fleet.client() as c:
        probe.start(c)
        fleet.pages[d] = _engine_page((2, 3, 0.5), 100, 1, 3)
        assert probe.sample(c) == {"prefill-0": 0.25, "decode-0": 0.25}
        # the run: 4 more decode requests queued, 2 of them > 0.1 s; 200 tokens; 2 preemptions
        fleet.pages[d] = _engine_page((4, 7, 2.5), 300, 3, 1)
        probe.sample(c)
        eng = probe.finish(c)
    dec = eng["decode"]
    assert dec["queue"]["count"] == 4 and abs(dec["queue"]["sum"] - 2.0) < 1e-9
    assert dec["queue"]["buckets"] == [["0.1", 2.0], ["+Inf", 4.0]]
    assert dec["itl"]["count"] == 200 and dec["preemptions"] == 2
    assert dec["peak_running"] == 3 and dec["peak_waiting"] == 1
    assert eng["prefill"]["queue"]["count"] == 0
    s = engine_summary(eng)
    assert abs(s["decode_queue_mean_s"] - 0.5) < 1e-9 and s["preemptions"] == 2
    assert abs(s["decode_itl_mean_s"] - 0.02) < 1e-9
    # the summary of a run carries them
    assert RunResult("x", meta={"engine": eng}).summary()["decode_peak_running"] == 3


def _cache_info(n: int) -> str:
    return ('# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{block_size="32",'
            f'cache_dtype="auto",engine="0",num_cpu_blocks="None",num_gpu_blocks="{n}",'
            f'num_gpu_blocks_override="{n}"}} 1.0\n')


def test_decode_blocks_in_use_come_from_usage_and_the_engines_capacity() -> None:
    """The ledger's cap: the decode engines' KV usage times their capacity in blocks."""
    assert kv_capacity_blocks(_cache_info(160)) == 160
    assert kv_capacity_blocks(_engine_page((0, 0, 0), 0, 0, 0)) is None
    p, d = "http://127.0.0.1:1", "http://127.0.0.1:2"
    info = _cache_info(160)
    fleet = Pages({p: _engine_page((0, 0, 0), 0, 0, 0),  # the prefill does not say: not needed
                   d: _engine_page((0, 0, 0), 0, 0, 0) + info})
    probe = EngineProbe([Endpoint("prefill-0", "prefill", p), Endpoint("decode-0", "decode", d)])
    with fleet.client() as c:
        probe.start(c)
        assert probe.capacity == {"decode-0": 160}
        assert probe.decode_blocks_in_use(probe.sample(c)) == 40.0  # 25% of 160
        assert probe.decode_blocks_in_use({"prefill-0": 0.25}) != 0  # NaN: decode unread
    blind = EngineProbe([Endpoint("decode-0", "decode", d)])
    with Pages({d: _engine_page((0, 0, 0), 0, 0, 0)}).client() as c:
        blind.start(c)
        u = blind.decode_blocks_in_use(blind.sample(c))
        assert u != u  # capacity unknown: no cap


def test_an_unreadable_instance_is_left_out() -> None:
    fleet = Pages({})
    probe = EngineProbe([Endpoint("decode-0", "decode", "http://127.0.0.1:9")])
    with fleet.client() as c:
        probe.start(c)
        assert probe.sample(c)["decode-0"] != probe.sample(c)["decode-0"]  # NaN
        assert probe.finish(c) == {}


def test_lease_metrics_are_found_only_in_a_lease_config() -> None:
    lease = load_config_file("nixl-bidirectional-lease")
    assert lease_metrics_offset(lease) == 1002
    assert lease_metrics_urls([7000], lease) == ["http://127.0.0.1:8002"]
    multi = {"kv_connector": "MultiConnector",
             "kv_connector_extra_config": {"connectors": [lease, load_config_file("kvtier-peer")]}}
    assert lease_metrics_offset(multi) == 1002
    assert lease_metrics_offset(load_config_file("nixl-bidirectional")) is None
    assert lease_metrics_offset(builtin("device-ttl").kv_transfer_config()) is None
    no_leases = {**lease, "kv_connector_extra_config": {
        **lease["kv_connector_extra_config"], "decode_lease_s": 0}}
    assert lease_metrics_offset(no_leases) is None


def _lease_page(blocks: float, held: float) -> str:
    return f"""\
# TYPE kvtier_decode_blocks_retained gauge
kvtier_decode_blocks_retained{{pod="decode-0"}} {blocks}
# TYPE kvtier_decode_block_seconds_held counter
kvtier_decode_block_seconds_held_total{{pod="decode-0"}} {held}
"""


def test_decode_retention_reads_the_nodes_own_count() -> None:
    u = "http://127.0.0.1:8002"
    fleet = Pages({u: _lease_page(0, 100.0)})
    own = DecodeRetention([u])
    with fleet.client() as c:
        own.start(c)
        fleet.pages[u] = _lease_page(12, 130.0)
        assert own.active and own.sample(c) == 12
        assert own.finish(c) == 30.0
    off = DecodeRetention([])
    with Pages({}).client() as c:
        off.start(c)
        assert not off.active and off.finish(c) != off.finish(c)  # NaN: keep the ledger


@contextlib.contextmanager
def router_log(path: Path) -> Iterator[RouterLog]:
    """The router's records as a router process writes them (``log_json``: its
    ``JsonFormatter``, a line each) into ``path``, read back by a ``RouterLog``."""
    h = logging.FileHandler(path)
    h.setFormatter(JsonFormatter())
    loggers = [logging.getLogger(n) for n in ("kvtier.router", "kvtier.watchdog")]
    before = [(lg.level, lg.propagate) for lg in loggers]
    for lg in loggers:
        lg.addHandler(h)
        lg.setLevel(logging.INFO)
        lg.propagate = False
    try:
        yield RouterLog(path)
    finally:
        for lg, (level, propagate) in zip(loggers, before, strict=True):
            lg.removeHandler(h)
            lg.setLevel(level)
            lg.propagate = propagate
        h.close()


def test_served_log_keeps_refusals_by_client_request_id(caplog, tmp_path) -> None:
    lg = logging.getLogger("kvtier.router")
    before = (lg.level, lg.propagate)
    with router_log(tmp_path / "router.log") as rl:
        lg.info("served", extra={"client_request_id": "r1", "refusal": "expired"})
        lg.info("served", extra={"client_request_id": "r2"})
        lg.info("something else", extra={"client_request_id": "r3", "refusal": "stale"})
        lg.warning("a real warning")
        with caplog.at_level(logging.WARNING):
            rl.read()
        served = rl.served
        assert served.take("r1") == "expired" and served.take("r2") == ""
        assert served.take("r3") == "" and served.take("r1") == ""
    assert "a real warning" in caplog.text  # warnings still reach the console
    assert (lg.level, lg.propagate) == before


def test_served_log_of_a_router_that_adopts_the_clients_id(tmp_path) -> None:
    lg = logging.getLogger("kvtier.router")
    with router_log(tmp_path / "router.log") as rl:
        lg.info("served", extra={"request_id": "r9", "refusal": "unproven"})
        assert rl.take_turn("r9").refusal == "unproven"


def test_router_log_is_read_as_it_grows_and_keeps_the_stalls(tmp_path) -> None:
    """A line is read once it is whole; the router's legs come with its served line; the
    watchdog's stall lines are kept (the longest stall from them); a turn the router never
    logged is an empty ServedTurn after the wait."""
    path = tmp_path / "router.log"
    rl = RouterLog(path)
    rl.read()  # no file yet: nothing
    with path.open("w") as f:
        f.write('{"ts": 1, "level": "INFO", "logger": "kvtier.router", "msg": "served", '
                '"client_request_id": "r1", "prefill": "prefill-0", "decode": "decode-0", '
                '"ms": 80.5, "prefill_ms": 30.25, "prefill_cached_tokens": 64, '
                '"retained_tokens": 415}\n')
        f.write('not json: uvicorn or vLLM output\n')
        f.write('{"ts": 2, "level": "WARNING", "logger": "kvtier.watchdog", "msg": "the router')
        f.flush()
        assert rl.take_turn("r1") == ServedTurn(prefill="prefill-0", decode="decode-0",
                                                ms=80.5, prefill_ms=30.25, cached_tokens=64,
                                                retained_tokens=415)
        assert rl.stalls == []  # half a line
        f.write("'s event loop stood still for 1.52 s, nothing it serves moved meanwhile; "
                'its thread used 0.00 s of CPU in that time (it waited)"}\n')
        f.write('{"ts": 3, "level": "WARNING", "logger": "kvtier.watchdog", "msg": '
                '"the router\'s event loop has not turned for 1.2 s; its thread is at\\n  x"}\n')
        f.write('{"ts": 4, "level": "WARNING", "logger": "kvtier.watchdog", "msg": '
                '"the router\'s event loop stood still for 2.25 s, nothing it serves moved"}\n')
    rl.read()
    assert [s.split(" for ")[1][:6] for s in rl.stalls] == ["1.52 s", "2.25 s"]
    assert rl.longest_stall_s == 2.25
    assert rl.take_turn("never", wait_s=0.05) == ServedTurn()


def test_lease_endpoint_of_a_decode_node() -> None:
    lease = load_config_file("nixl-bidirectional-lease")
    assert lease_port_offset(lease) == 1001
    assert lease_endpoint(7000, lease) == "tcp://127.0.0.1:8001"
    # tiered-adaptive deploys the lease connector inside a MultiConnector
    assert lease_endpoint(7000, builtin("tiered-adaptive").kv_transfer_config()) == \
        "tcp://127.0.0.1:8001"
    assert lease_endpoint(7000, builtin("tiered").kv_transfer_config()) is None
    fixed = {**lease, "kv_connector_extra_config": {
        **lease["kv_connector_extra_config"], "lease_endpoint": "tcp://10.0.0.1:9"}}
    assert lease_port_offset(fixed) is None and lease_endpoint(7000, None) is None


def test_served_log_keeps_the_hold_choice_of_each_turn(tmp_path) -> None:
    lg = logging.getLogger("kvtier.router")
    ret = logging.getLogger("kvtier.router.retention")
    with router_log(tmp_path / "router.log") as rl:
        # retention: adaptive logs its choice (and why) while the turn is served
        ret.info("hold", extra={"conversation_id": "c1", "pod": "decode-0", "hold_s": 0.0,
                                "hold_basis": "fleet", "hold_samples": 1,
                                "why": "... -> no device retention"})
        lg.info("served", extra={"client_request_id": "r1", "conversation_id": "c1",
                                 "hold_s": 0.0, "hold_basis": "fleet", "hold_samples": 1})
        lg.info("served", extra={"client_request_id": "r2", "conversation_id": "c2",
                                 "hold_s": 2.5, "hold_basis": "conversation",
                                 "hold_samples": 3, "refusal": ""})
        lg.info("served", extra={"client_request_id": "r3", "conversation_id": "c1",
                                 "refusal": "expired"})  # not retained under a lease
        lg.info("served", extra={"client_request_id": "r4", "hold_s": "bad",
                                 "hold_samples": True})
        rl.read()
        served = rl.served
        assert served.take_turn("r1") == ServedTurn("", 0.0, "fleet", 1,
                                                    "... -> no device retention")
        assert served.take_turn("r2") == ServedTurn("", 2.5, "conversation", 3, "")
        r3 = served.take_turn("r3")
        assert r3.refusal == "expired" and r3.hold_s is None and r3.hold_why == ""
        assert served.take_turn("r4") == ServedTurn()
        assert served.take_turn("r1") == ServedTurn()  # taken once
