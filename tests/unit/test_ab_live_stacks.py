"""``kvtier ab --stack``: the flags, discovery from a router's ``/healthz`` (a fake router at
the HTTP seam, ``httpx.MockTransport``), the checks against the strategy, what a running
stack refuses, the streamed turn, and the whole command against two real routers in front
of the project's fake engines (tests/fakes/engine.py: no model runs in a unit test)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator

import httpx
import pytest

from kvtier.ab.live.probes import Endpoint
from kvtier.ab.live.running import (
    MetricsPage,
    RunningStack,
    StackError,
    StreamError,
    discover,
    host_bytes,
    lease_metrics_url,
    parse_engine_metrics,
    parse_stacks,
    reset_prefix_caches,
    stacks_markdown,
    stream_turn,
    verify,
)
from kvtier.ab.rawdoc import read_raw
from kvtier.ab.strategies import builtin
from kvtier.ids import Outcome, ReusePath

P, D, IDX = "http://p.test:8001", "http://d.test:8002", "http://idx.test:9000"
ROUTER = "http://router.test:8000"
P_PAGE = ('vllm:cache_config_info{block_size="16",enable_prefix_caching="True",'
          'num_gpu_blocks="100"} 1.0\nvllm:kv_cache_usage_perc 0.0\n')
LEASE_PAGE = "kvtier_decode_blocks_retained 3.0\nkvtier_decode_block_seconds_held_total 9.0\n"
TIER_PAGE = 'kvtier_tier_bytes_held{pod="p"} 4096.0\n'


def _healthz(status: int = 200, lease_endpoint: str | None = "tcp://d.test:5600",
             indexer: bool = True) -> dict:
    return {"status": "ok" if status == 200 else "degraded",
            "down": [] if status == 200 else ["decode"],
            "instances": {"prefill-0": {"role": "prefill", "url": P, "healthy": True},
                          "decode-0": {"role": "decode", "url": D, "healthy": True}},
            "dependencies": {"store": {"backend": "memory", "ok": True},
                             "indexer": {"url": IDX, "ok": True} if indexer else None},
            "decode_capabilities": {"decode-0": {
                "params_feed": "tcp://d.test:5700", "lease": "ok" if lease_endpoint else "none",
                "lease_endpoint": lease_endpoint, "warnings": []}}}


def _client(routes: dict[str, Callable[[httpx.Request], httpx.Response]]) -> httpx.Client:
    """A client whose every request is answered by ``routes[scheme://host:port/path]``
    (404 for anything else)."""
    def handle(request: httpx.Request) -> httpx.Response:
        key = f"{request.url.scheme}://{request.url.host}:{request.url.port}{request.url.path}"
        fn = routes.get(key)
        return fn(request) if fn else httpx.Response(404)
    return httpx.Client(transport=httpx.MockTransport(handle))


def _text(body: str) -> Callable[[httpx.Request], httpx.Response]:
    return lambda _: httpx.Response(200, text=body)


def _json(body: object, status: int = 200) -> Callable[[httpx.Request], httpx.Response]:
    return lambda _: httpx.Response(status, json=body)


def _router_routes(**kw: object) -> dict[str, Callable[[httpx.Request], httpx.Response]]:
    return {f"{ROUTER}/healthz": _json(_healthz(**kw)),  # type: ignore[arg-type]
            f"{ROUTER}/v1/models": _json({"data": [{"id": "served", "max_model_len": 2048}]}),
            f"{P}/metrics": _text(P_PAGE),
            "http://d.test:5601/metrics": _text(LEASE_PAGE)}


# ----------------------------------------------------------------- the flags ---------
def test_stacks_parse_in_order_and_refuse_what_cannot_label_a_stack() -> None:
    got = parse_stacks(["device-ttl=http://a:1/", "recompute= http://b:2"])
    assert list(got.items()) == [("device-ttl", "http://a:1"), ("recompute", "http://b:2")]
    for bad, why in (("device-ttl", "STRATEGY=ROUTER_URL"), ("fast=http://a:1", "not a strategy"),
                     ("recompute=a:1", "not an http"), ("recompute=", "STRATEGY=ROUTER_URL")):
        with pytest.raises(StackError, match=why):
            parse_stacks([bad])
    with pytest.raises(StackError, match="twice"):
        parse_stacks(["recompute=http://a:1", "recompute=http://b:1"])


def test_engine_metrics_take_a_role_or_leave_it_to_the_router() -> None:
    got = parse_engine_metrics(["device-ttl=prefill=http://p:1/metrics,http://d:2"],
                               ["device-ttl"])
    assert got == {"device-ttl": [MetricsPage("http://p:1", "prefill"),
                                  MetricsPage("http://d:2", None)]}
    with pytest.raises(StackError, match="no --stack"):
        parse_engine_metrics(["tiered=http://p:1"], ["device-ttl"])
    with pytest.raises(StackError, match="role 'router'"):
        parse_engine_metrics(["tiered=router=http://p:1"], ["tiered"])


def test_the_ab_command_refuses_local_flags_with_a_stack(capsys) -> None:
    from kvtier.cli import main

    with pytest.raises(SystemExit):
        main(["ab", "--stack", "recompute=http://a:1", "--prefill", "2"])
    assert "--prefill: set by the running stacks" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # nothing is started: its placement is not ours to set
        main(["ab", "--stack", "recompute=http://a:1", "--spinner-nice", "19"])
    assert "--spinner-nice: set by the running stacks" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["ab", "--engine-metrics", "recompute=http://a:1"])
    assert "names the metrics pages of a --stack" in capsys.readouterr().err
    # one engine per strategy has no P/D shape, no simulator fleet and starts its own engines
    with pytest.raises(SystemExit):
        main(["ab", "--single-engine", "--decode", "1", "--simulate"])
    assert "not with --simulate, --decode" in capsys.readouterr().err
    # a strategy that retains on a decode node has nothing to run on one engine
    with pytest.raises(SystemExit, match="--single-engine: device-ttl retains KV"):
        main(["ab", "--single-engine", "--strategies", "recompute,device-ttl",
              "--out", "/nonexistent/never-written"])


# ----------------------------------------------------------------- discovery ---------
def test_discovery_reads_the_routers_healthz_and_the_pages_it_can_reach() -> None:
    with _client(_router_routes()) as http:
        st = discover(http, "device-ttl", ROUTER, model_name="fallback")
    assert (st.model_name, st.max_model_len, st.topology) == ("served", 2048, "1P1D")
    assert [e.name for e in st.engines] == ["prefill-0"]       # D's page is not reachable
    assert st.decode_metrics == ("http://d.test:5601",)         # lease port + 1
    assert st.indexer == IDX and st.block_size == 16
    assert st.prefix_caching == {"prefill-0": True}
    assert st.source == "discovered from the router's /healthz"
    assert any("decode-0: vLLM metrics" in n and "--engine-metrics" in n for n in st.notes)


def test_a_router_without_lease_endpoints_or_models_still_discovers() -> None:
    routes = _router_routes(lease_endpoint=None, indexer=False)
    del routes[f"{ROUTER}/v1/models"]
    with _client(routes) as http:
        st = discover(http, "recompute", ROUTER, model_name="fallback")
    assert st.model_name == "fallback" and st.max_model_len is None
    assert st.decode_metrics == () and st.indexer is None


def test_given_pages_are_read_for_what_they_export() -> None:
    routes = _router_routes()
    routes["http://d2.test:9/metrics"] = _text(LEASE_PAGE + TIER_PAGE)
    routes["http://x.test:9/metrics"] = _text("something_else 1.0\n")
    given = [MetricsPage(P), MetricsPage("http://other.test:7", "decode"),
             MetricsPage("http://d2.test:9"), MetricsPage("http://x.test:9")]
    routes["http://other.test:7/metrics"] = _text(P_PAGE)
    with _client(routes) as http:
        st = discover(http, "tiered", ROUTER, given)
    assert [(e.name, e.role) for e in st.engines] == [("prefill-0", "prefill"),
                                                     ("other.test:7", "decode")]
    assert st.decode_metrics == ("http://d2.test:9",)
    assert st.host_metrics == ("http://d2.test:9",)
    assert st.source == "given (--engine-metrics)"
    assert any("x.test:9: no vllm:" in n for n in st.notes)


@pytest.mark.parametrize(("routes", "why"), [
    ({f"{ROUTER}/healthz": _json({"status": "ok"})}, "/healthz does not list instances"),
    ({}, "no kvtier router answers"),
    ({f"{ROUTER}/healthz": _json(_healthz(status=503), 503)}, "cannot serve"),
    ({f"{ROUTER}/healthz": _text("<html>")}, "no kvtier router answers"),
])
def test_a_router_that_cannot_be_used_is_a_clear_error(routes, why) -> None:
    with _client(routes) as http, pytest.raises(StackError, match=why):
        discover(http, "recompute", ROUTER)


def test_lease_metrics_are_the_lease_port_plus_one() -> None:
    assert lease_metrics_url("tcp://10.0.0.5:7600") == "http://10.0.0.5:7601"
    assert lease_metrics_url("tcp://*:7600") == "http://127.0.0.1:7601"
    assert lease_metrics_url("ipc:///tmp/lease") is None


# ----------------------------------------------------------------- checks and notes --
def _stack(**kw: object) -> RunningStack:
    base: dict = {"strategy": "device-ttl", "url": ROUTER, "model_name": "m",
                  "max_model_len": None,
                  "instances": (Endpoint("prefill-0", "prefill", P),
                                Endpoint("decode-0", "decode", D)),
                  "engines": (), "decode_metrics": (), "host_metrics": (), "indexer": None,
                  "source": "discovered from the router's /healthz"}
    return RunningStack(**{**base, **kw})


def test_verify_says_what_matches_what_differs_and_what_it_cannot_see() -> None:
    st = _stack(capabilities={"decode-0": {"lease": "ok", "params_feed": None}},
                prefix_caching={"prefill-0": True})
    v = verify(builtin("device-ttl"), st)
    assert "indexer: stack no, device-ttl no" in v["matches"]
    assert "decode leases: stack yes, device-ttl no" in v["differs"]
    assert "prefill prefix caching: stack yes, device-ttl no" in v["differs"]
    assert "device retention and its TTL" in v["not_verified"]
    unknown = verify(builtin("tiered-adaptive"), _stack())
    assert "decode leases" in unknown["not_verified"]


def test_a_refused_reset_is_a_note_not_a_crash() -> None:
    answers = iter([{"success": False}, {"success": True}])
    routes = {f"{P}/reset_prefix_cache": lambda r: httpx.Response(200, json=next(answers)),
              f"{D}/reset_prefix_cache": lambda r: httpx.Response(404)}
    with _client(routes) as http:
        notes = reset_prefix_caches(http, _stack(), wait_s=5.0)
    assert notes == ["decode-0: prefix cache not reset (/reset_prefix_cache answered 404: "
                     "vLLM serves it only with VLLM_SERVER_DEV_MODE=1)"]
    with _client({f"{P}/reset_prefix_cache": _json({"success": False})}) as http:
        notes = reset_prefix_caches(http, _stack(), wait_s=0.0)
    assert "blocks still held" in notes[0]


def test_host_bytes_from_the_tiers_else_the_indexer() -> None:
    routes = {"http://t.test:1/metrics": _text(TIER_PAGE),
              f"{IDX}/v1/pods": _json({"pods": {"a": {"blocks_stored": 5, "blocks_removed": 2}}})}
    with _client(routes) as http:
        assert host_bytes(http, _stack(host_metrics=("http://t.test:1",)), 100) == 4096
        assert host_bytes(http, _stack(indexer=IDX), 100) == 300
        assert host_bytes(http, _stack(), 100) == 0


def test_the_report_section_names_each_stack_and_its_notes() -> None:
    st = _stack(capabilities={"decode-0": {"lease": "none", "params_feed": None}},
                notes=("decode-0: vLLM metrics not readable",))
    meta = {"stacks": {"device-ttl": {**st.describe(), "verified": verify(builtin("device-ttl"),
                                                                          st),
                                      "run_notes": ["prefill-0: prefix cache not reset"]}}}
    text = "\n".join(stacks_markdown(meta))
    assert "## Running stacks" in text and f"router {ROUTER}, 1P1D" in text
    assert "Not verified: " in text and "buffered" in text
    assert "- prefill-0: prefix cache not reset" in text and "not readable" in text
    assert stacks_markdown({}) == []


# ----------------------------------------------------------------- the streamed turn -
def _sse(*events: object, done: bool = True) -> Callable[[httpx.Request], httpx.Response]:
    body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
    body += b"data: [DONE]\n\n" if done else b""
    return lambda _: httpx.Response(200, content=body, headers={
        "content-type": "text/event-stream", "x-kvtier-reuse": "dp_read; tokens=64",
        "x-kvtier-outcome": "full"})


def _chunk(ids: list[int]) -> dict:
    return {"choices": [{"index": 0, "text": "x", "token_ids": ids}]}


def test_a_streamed_turn_gives_ids_reuse_and_the_first_tokens_time() -> None:
    seen: list[dict] = []

    def answer(r: httpx.Request) -> httpx.Response:
        seen.append(json.loads(r.content))
        return _sse({"choices": [{"index": 0, "text": "", "prompt_token_ids": [1, 2]}]},
                    _chunk([7]), _chunk([8, 9]))(r)

    with _client({f"{ROUTER}/v1/completions": answer}) as c:
        c.base_url = httpx.URL(ROUTER)
        ids, reuse, first = stream_turn(c, "m", "cid", "rid", [1, 2], 3)
    assert ids == [7, 8, 9] and first is not None
    assert (reuse.path, reuse.tokens, reuse.outcome) == (ReusePath.DP_READ, 64, Outcome.FULL)
    assert seen[0]["stream"] is True and seen[0]["ignore_eos"] is True
    for events, err in (((_chunk([7]), {"error": {"message": "boom"}}), "boom"),):
        with _client({f"{ROUTER}/v1/completions": _sse(*events)}) as c:
            c.base_url = httpx.URL(ROUTER)
            with pytest.raises(StreamError, match=err):
                stream_turn(c, "m", "cid", "rid", [1], 1)
    with _client({f"{ROUTER}/v1/completions": _sse(_chunk([7]), done=False)}) as c:
        c.base_url = httpx.URL(ROUTER)
        with pytest.raises(StreamError, match="without"):
            stream_turn(c, "m", "cid", "rid", [1], 1)


# ----------------------------------------------------------------- the command -------
@pytest.fixture
def two_routers() -> Iterator[list[str]]:
    """Two real routers (no params feed, no leases: the streamed answers come buffered), each
    in front of its own pair of fake engines served over HTTP."""
    import contextlib

    from kvtier.router.config import RouterConfig
    from kvtier.router.server import RouterServer
    from kvtier.runtime import ServerThread
    from tests.fakes.engine import server_app

    with contextlib.ExitStack() as es:
        urls = []
        for k in range(2):
            p = es.enter_context(ServerThread(server_app(8, 0.0, f"p{k}")))
            d = es.enter_context(ServerThread(server_app(8, 0.0, f"d{k}")))
            cfg = RouterConfig.model_validate({"prefill": [p.url], "decode": [d.url],
                                               "port": 0, "log_json": False})
            urls.append(es.enter_context(RouterServer(cfg)).url)
        yield urls


def test_kvtier_ab_against_two_running_routers_writes_the_report(two_routers, tmp_path) -> None:
    from kvtier.cli import main

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
        "hidden_size": 64, "max_position_embeddings": 512}))
    out = tmp_path / "ab"
    rc = main(["ab", "--stack", f"device-ttl={two_routers[0]}",
               "--stack", f"recompute={two_routers[1]}", "--model", str(model),
               "--conversations", "2", "--turns", "3", "--time-scale", "0.01",
               "--out", str(out), "--no-progress"])
    assert rc == 0
    doc = read_raw(out)
    assert [r["strategy"] for r in doc["results"]] == ["device-ttl", "recompute"]
    for r in doc["results"]:
        assert len(r["turns"]) == 6 and all(t["ok"] for t in r["turns"]), r["turns"]
        assert r["meta"]["device_blocks_source"].startswith("decode KV in use")
    meta = doc["meta"]
    assert meta["mode"] == "live" and "running stacks: device-ttl 1P1D" in meta["topology"]
    assert "--stack device-ttl=" in meta["command"]
    stacks = meta["stacks"]
    assert set(stacks) == {"device-ttl", "recompute"}
    # the fake engines serve no /metrics and no /reset_prefix_cache: notes, not a crash
    assert any("VLLM_SERVER_DEV_MODE" in n for n in stacks["recompute"]["run_notes"])
    assert any("not readable" in n for n in stacks["device-ttl"]["notes"])
    assert meta["measurement"]["ttft_s"].startswith("running stacks")
    md = (out / "report.md").read_text()
    assert md.index("## Running stacks") < md.index("## Summary")
