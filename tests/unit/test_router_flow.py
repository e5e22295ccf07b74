"""The P/D flow against fake engines (tests/fakes): reuse headers, the reuse counter, and
the retry policy as the flow applies it. No sockets: the app runs in Starlette's TestClient
and reaches the engines through an httpx transport."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from kvtier.ids import ReusePath
from kvtier.router.app import create_app
from kvtier.router.config import RouterConfig
from kvtier.router.flow import Router
from tests.fakes.engine import BLOCK_SIZE, D_URL, GEN, IDX_URL, P2_URL, P_URL, FakeEngines
from tests.helpers import wait_until

PROMPT = list(range(1, 11))  # 10 tokens: 2 full blocks + 2


class Stack:
    def __init__(self, client: TestClient, fake: FakeEngines) -> None:
        self.client, self.fake = client, fake
        self.router: Router = client.app.state.router  # type: ignore[attr-defined]

    def complete(self, prompt: list[int], conv: str | None = "c1",
                 **extra: Any) -> Any:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 3, **extra}
        if conv is not None:
            body["conversation_id"] = conv
        return self.client.post("/v1/completions", json=body)

    def reuse_count(self, path: ReusePath) -> float:
        v = self.router.metrics.registry.get_sample_value("kvtier_router_reuse_total",
                                                          {"path": path.value})
        return v or 0.0

    def metric(self, name: str, **labels: str) -> float:
        return self.router.metrics.registry.get_sample_value(name, labels) or 0.0


def make(fake: FakeEngines | None = None, **cfg: Any) -> Iterator[Stack]:
    fake = fake or FakeEngines()
    config = RouterConfig.model_validate({
        "prefill": cfg.pop("prefill", [P_URL]), "decode": [D_URL], "log_json": False,
        "block_size": BLOCK_SIZE, **cfg})
    with TestClient(create_app(config, transport=fake, health_checks=False)) as c:
        yield Stack(c, fake)


@pytest.fixture()
def stack() -> Iterator[Stack]:
    yield from make()


def reuse_of(r: Any) -> tuple[str, str]:
    return r.headers["x-kvtier-reuse"], r.headers["x-kvtier-outcome"]


# ---- the headers -----------------------------------------------------------------------
def test_first_turn_reuses_nothing(stack: Stack) -> None:
    r = stack.complete(PROMPT)
    assert r.status_code == 200
    assert reuse_of(r) == ("none; tokens=0", "none")
    assert stack.reuse_count(ReusePath.NONE) == 1


def test_next_turn_reads_the_decode_nodes_kv(stack: Stack) -> None:
    stack.complete(PROMPT)
    r = stack.complete([*PROMPT, *GEN, 7, 7])
    # D computed KV for the prompt and all but the last generated token.
    covered = len(PROMPT) + len(GEN) - 1
    assert reuse_of(r) == (f"dp_read; tokens={covered}", "full")
    assert stack.fake.prefills()[-1].kvp["remote_engine_id"] == "D"
    assert stack.reuse_count(ReusePath.DP_READ) == 1
    assert stack.metric("kvtier_router_reused_tokens_total") == covered


def test_edited_history_is_trimmed_to_whole_blocks(stack: Stack) -> None:
    stack.complete(PROMPT)
    edited = [*PROMPT, *GEN, 7]
    edited[9] = 500  # in the third block: the first two (8 tokens) still match
    r = stack.complete(edited)
    assert reuse_of(r) == ("dp_read; tokens=8", "trimmed")


def test_history_edited_in_the_first_block_is_stale(stack: Stack) -> None:
    stack.complete(PROMPT)
    r = stack.complete([500, *PROMPT[1:], *GEN, 7])
    assert reuse_of(r) == ("none; tokens=0", "stale")
    assert "remote_engine_id" not in stack.fake.prefills()[-1].kvp


def test_expired_kv_is_reported_expired() -> None:
    for s in make(decode_kv_ttl_s=0.05, ttl_margin_s=0.0):
        s.complete(PROMPT)
        time.sleep(0.1)
        assert len(s.router.store) == 0  # the gauges' read purged it ...
        r = s.complete([*PROMPT, *GEN, 7])
        assert reuse_of(r) == ("none; tokens=0", "expired")  # ... and it is still "expired"
        assert s.metric("kvtier_router_params_dropped_total", reason="expired") == 1


def test_indexer_paths_local_and_p2p() -> None:
    fake = FakeEngines(lookup=[{"pod": "prefill-0", "matched_tokens": 8}])
    # no implicit sessions: the second identical prompt would continue the first
    for s in make(fake, indexer=IDX_URL, implicit_sessions=False):
        assert reuse_of(s.complete(PROMPT, conv=None)) == ("local; tokens=8", "none")
        fake.lookup = [{"pod": "prefill-0", "matched_tokens": 4}]
        fake.source = {"pod": "prefill-1", "matched_tokens": 8, "p2p_host": "10.0.0.2",
                       "p2p_port": 7000}
        assert reuse_of(s.complete(PROMPT, conv=None)) == ("p2p; tokens=8", "none")
        assert s.fake.prefills()[-1].kvp["remote_kv_source"]["num_tokens"] == 8
        assert (s.reuse_count(ReusePath.LOCAL), s.reuse_count(ReusePath.P2P)) == (1, 1)


def test_one_indexer_call_per_request_even_when_the_prefill_is_retried() -> None:
    src = {"pod": "prefill-1", "matched_tokens": 8, "p2p_host": "10.0.0.2", "p2p_port": 7000}
    fake = FakeEngines(lookup=[{"pod": "prefill-0", "matched_tokens": 4}], source=src)
    fake.fail(P_URL, "connect")  # prefill-0 is gone: the leg is retried on prefill-1
    for s in make(fake, indexer=IDX_URL, prefill=[P_URL, P2_URL], implicit_sessions=False):
        r = s.complete(PROMPT, conv=None)
        assert r.status_code == 200
        assert [p for p, _ in fake.indexer_calls] == ["/v1/route"]
        # prefill-1 holds the source itself: it is not told to pull from itself
        assert fake.prefills()[-1].url == P2_URL
        assert "remote_kv_source" not in fake.prefills()[-1].kvp


def test_a_source_is_offered_only_when_it_gains_over_the_target() -> None:
    src = {"pod": "prefill-1", "matched_tokens": 8, "p2p_host": "10.0.0.2", "p2p_port": 7000}
    # the target already holds 8 on some tier: the peer adds nothing
    fake = FakeEngines(lookup=[{"pod": "prefill-0", "matched_tokens": 8}], source=src)
    for s in make(fake, indexer=IDX_URL, implicit_sessions=False):
        assert reuse_of(s.complete(PROMPT, conv=None)) == ("local; tokens=8", "none")
    fake = FakeEngines(lookup=[{"pod": "prefill-0", "matched_tokens": 4}], source=src)
    for s in make(fake, indexer=IDX_URL, implicit_sessions=False, min_cached_token_delta=8):
        assert reuse_of(s.complete(PROMPT, conv=None)) == ("local; tokens=4", "none")


def test_a_chat_request_is_tokenized_once_and_routed_by_the_indexer() -> None:
    src = {"pod": "prefill-1", "matched_tokens": 8, "p2p_host": "10.0.0.2", "p2p_port": 7000}
    fake = FakeEngines(source=src)
    for s in make(fake, indexer=IDX_URL, implicit_sessions=False):
        msgs = [{"role": "user", "content": "hello there, a chat turn"}]
        r = s.client.post("/v1/chat/completions", json={"model": "tiny", "messages": msgs})
        assert r.status_code == 200 and r.headers["x-kvtier-reuse"] == "p2p; tokens=8"
        assert [c.path for c in fake.calls if c.path == "/tokenize"] == ["/tokenize"]
        assert [p for p, _ in fake.indexer_calls] == ["/v1/route"]
        sent = fake.indexer_calls[0][1]
        assert sent["token_ids"] == [ord(ch) for ch in msgs[0]["content"]]
        assert "remote_kv_source" in fake.prefills()[-1].kvp


def test_an_indexer_without_route_is_unavailable_and_the_request_is_served() -> None:
    # /v1/route is the router's only indexer call: an indexer that 404s it is counted as
    # unavailable (no /v1/lookup or /v1/source fallback) and each request is served anyway
    src = {"pod": "prefill-1", "matched_tokens": 8, "p2p_host": "10.0.0.2", "p2p_port": 7000}
    fake = FakeEngines(lookup=[{"pod": "prefill-0", "matched_tokens": 4}], source=src)
    asked: list[str] = []

    class WithoutRoute(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            if request.url.host == "idx.test":
                asked.append(request.url.path)
                return httpx.Response(404, json={"error": "not found"})
            return await fake.handle_async_request(request)

    config = RouterConfig.model_validate({
        "prefill": [P_URL], "decode": [D_URL], "log_json": False, "block_size": BLOCK_SIZE,
        "indexer": IDX_URL, "implicit_sessions": False})
    with TestClient(create_app(config, transport=WithoutRoute(), health_checks=False)) as c:
        s = Stack(c, fake)
        assert reuse_of(s.complete(PROMPT, conv=None)) == ("none; tokens=0", "none")
        assert reuse_of(s.complete(PROMPT, conv=None)) == ("none; tokens=0", "none")
        assert asked == ["/v1/route", "/v1/route"]
        assert s.metric("kvtier_router_indexer_unavailable_total", call="route") == 2
        assert "remote_kv_source" not in fake.prefills()[-1].kvp


def _cost(p2p_setup_s: float) -> dict[str, Any]:
    return {"kv_bytes_per_token": 2048, "prefill_b_s_per_token": 1e-3,
            "reads": {"dp_read": {"setup_s": 0.0, "bytes_per_s": 1e12},
                      "p2p": {"setup_s": p2p_setup_s, "bytes_per_s": 1e12}}}


def test_with_a_cost_model_the_router_hands_over_only_the_path_that_pays() -> None:
    # The same decision the CostAwareConnector and the simulator make (kvtier.cost.decide).
    src = {"pod": "prefill-1", "matched_tokens": 8, "p2p_host": "10.0.0.2", "p2p_port": 7000}
    fake = FakeEngines(lookup=[{"pod": "prefill-0", "matched_tokens": 4}], source=src)
    for s in make(fake, indexer=IDX_URL, cost_model=_cost(p2p_setup_s=0.0)):
        assert reuse_of(s.complete(PROMPT, conv=None)) == ("p2p; tokens=8", "none")
        assert s.fake.prefills()[-1].kvp["remote_kv_source"]["num_tokens"] == 8
    # 1 s of setup to save 4 ms of compute: the peer is not asked
    fake = FakeEngines(lookup=[{"pod": "prefill-0", "matched_tokens": 4}], source=src)
    for s in make(fake, indexer=IDX_URL, cost_model=_cost(p2p_setup_s=1.0)):
        assert reuse_of(s.complete(PROMPT, conv=None)) == ("local; tokens=4", "none")
        assert "remote_kv_source" not in s.fake.prefills()[-1].kvp


def test_a_cost_model_file_is_read_once_and_bad_files_are_refused(tmp_path: Any) -> None:
    f = tmp_path / "cost.json"
    f.write_text(json.dumps(_cost(0.5)))
    cfg = RouterConfig.model_validate({"prefill": [P_URL], "decode": [D_URL],
                                       "cost_model": str(f)})
    assert cfg.cost_model is not None and cfg.cost_model.reads["p2p"].setup_s == 0.5
    with pytest.raises(ValueError, match="cannot read"):
        RouterConfig.model_validate({"prefill": [P_URL], "decode": [D_URL],
                                     "cost_model": str(tmp_path / "missing.json")})


def test_cost_refit_learns_from_the_prefill_legs_it_times() -> None:
    # configured: a prefill costs 2 s; the fake engines answer in milliseconds
    cost = {**_cost(p2p_setup_s=0.5), "prefill_a_s": 2.0}
    for s in make(cost_model=cost, cost_refit=True, cost_refit_window=8,
                  cost_refit_min_samples=3):
        assert s.metric("kvtier_router_cost_model_seconds", term="prefill_fixed") == 2.0
        for i in range(4):
            assert s.complete([i + 1, *PROMPT], conv=f"c{i}").status_code == 200
        assert s.metric("kvtier_router_cost_refits_total") >= 1
        model = s.router.cost.model
        assert model is not None and model.prefill_a_s < 0.5
        assert s.metric("kvtier_router_cost_model_seconds", term="prefill_fixed") == \
            model.prefill_a_s
        assert s.router.cost.online is not None and s.router.cost.online.seen == 4
    # without cost_refit the configured model stays
    for s in make(cost_model=cost):
        for i in range(4):
            s.complete([i + 1, *PROMPT], conv=f"c{i}")
        assert s.router.cost.model is not None and s.router.cost.model.prefill_a_s == 2.0
        assert s.metric("kvtier_router_cost_refits_total") == 0


def test_a_refit_reaches_the_adaptive_hold_policy() -> None:
    cfg = RouterConfig.model_validate({
        "instances": [{"name": "p", "url": P_URL, "role": "prefill"},
                      {"name": "d", "url": D_URL, "role": "decode",
                       "lease": "tcp://127.0.0.1:1"}],
        "cost_model": _cost(0.0), "cost_refit": True, "retention": "adaptive"})
    r = Router(cfg)
    assert r.retention.policy is not None and r.retention.policy.cost == cfg.cost_model
    for i in range(cfg.cost_refit_min_samples):
        r.cost.prefill_leg(200 + 10 * i, ReusePath.NONE, 0, 0.05 + 0.001 * i)
    assert r.cost.model is not cfg.cost_model
    assert r.retention.policy.cost is r.cost.model


def test_cost_refit_needs_a_cost_model() -> None:
    with pytest.raises(ValueError, match="cost_refit needs a cost_model"):
        RouterConfig.model_validate({"prefill": [P_URL], "decode": [D_URL], "cost_refit": True})
    with pytest.raises(ValueError, match="cannot exceed"):
        RouterConfig.model_validate({"prefill": [P_URL], "decode": [D_URL],
                                     "cost_model": _cost(0.0), "cost_refit": True,
                                     "cost_refit_window": 8, "cost_refit_min_samples": 9})


@pytest.mark.parametrize("capture", ["buffered", "passthrough"])
def test_streaming_answers_carry_the_headers(capture: str) -> None:
    for s in make(stream_capture=capture):
        s.complete(PROMPT)
        r = s.complete([*PROMPT, *GEN, 7], stream=True)
        assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
        assert r.headers["content-type"].startswith("text/event-stream")
        assert reuse_of(r) == (f"dp_read; tokens={len(PROMPT) + 2}", "full")


def test_chat_answers_carry_the_headers(stack: Stack) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hello there"}]}
    r = stack.client.post("/v1/chat/completions", json=body,
                          headers={"x-conversation-id": "chat-1"})
    assert r.status_code == 200 and reuse_of(r) == ("none; tokens=0", "none")


def test_direct_mode_reuses_nothing(stack: Stack) -> None:
    stack.complete(PROMPT)
    r = stack.complete([*PROMPT, *GEN, 7], n=2)
    assert reuse_of(r) == ("none; tokens=0", "none")
    assert not stack.fake.prefills()[1:]
    assert len(stack.router.store) == 1  # left for a later P/D turn


def test_a_decode_error_after_a_prefill_carries_its_reuse(stack: Stack) -> None:
    stack.complete(PROMPT)
    stack.fake.fail(D_URL, 400)
    r = stack.complete([*PROMPT, *GEN, 7])
    assert r.status_code == 400
    assert reuse_of(r) == (f"dp_read; tokens={len(PROMPT) + 2}", "full")


def test_no_prefill_answer_means_no_headers_on_the_error(stack: Stack) -> None:
    stack.fake.fail(P_URL, 400)
    r = stack.complete(PROMPT)
    assert r.status_code == 400 and "x-kvtier-reuse" not in r.headers


# ---- the retry policy, as the flow applies it ---------------------------------------------
def test_prefill_5xx_keeps_the_reuse_for_one_retry(stack: Stack) -> None:
    stack.complete(PROMPT)
    stack.fake.fail(P_URL, 503)
    r = stack.complete([*PROMPT, *GEN, 7])
    assert reuse_of(r)[0].startswith("dp_read;")
    assert [bool(c.kvp.get("remote_engine_id") == "D") for c in stack.fake.prefills()[1:]] \
        == [True, True]
    assert stack.metric("kvtier_router_retries_total", leg="prefill", action="elsewhere") == 1


def test_prefill_timeout_drops_the_reuse(stack: Stack) -> None:
    stack.complete(PROMPT)
    stack.fake.fail(P_URL, "timeout")
    r = stack.complete([*PROMPT, *GEN, 7])
    # Proven in full, but the read may have consumed D's blocks: recomputed.
    assert reuse_of(r) == ("none; tokens=0", "full")
    assert stack.metric("kvtier_router_params_dropped_total", reason="rejected") == 1


def test_prefill_refusing_the_reuse_is_retried_without_it(stack: Stack) -> None:
    stack.complete(PROMPT)
    stack.fake.fail(P_URL, 422)
    r = stack.complete([*PROMPT, *GEN, 7])
    assert r.status_code == 200 and reuse_of(r) == ("none; tokens=0", "stale")
    assert stack.metric("kvtier_router_retries_total", leg="prefill", action="elsewhere") == 0


def test_prefill_failing_everywhere_is_recomputed_in_direct_mode() -> None:
    for s in make(prefill=[P_URL, P2_URL], max_retries=1):
        s.complete(PROMPT)
        s.fake.fail(P_URL, "connect")
        s.fake.fail(P2_URL, "connect")
        r = s.complete([*PROMPT, *GEN, 7])
        assert r.status_code == 200 and reuse_of(r) == ("none; tokens=0", "full")
        assert s.metric("kvtier_router_retries_total", leg="prefill", action="recompute") == 1
        assert s.fake.completions()[-1].url == D_URL  # direct mode on the decode node


def test_decode_5xx_reuses_the_prefills_blocks_once(stack: Stack) -> None:
    stack.fake.fail(D_URL, 503, 503)
    r = stack.complete(PROMPT, conv=None)
    assert r.status_code == 200
    decodes = [c for c in stack.fake.completions(D_URL)]
    assert [bool(c.kvp) for c in decodes] == [True, True, False]
    assert stack.metric("kvtier_router_retries_total", leg="decode", action="elsewhere") == 2


def test_direct_mode_failing_everywhere_is_a_502() -> None:
    for s in make(max_retries=0):
        s.fake.fail(D_URL, "connect")
        s.fake.fail(P_URL, "connect")
        r = s.complete(PROMPT, n=2)
        assert r.status_code == 502 and r.json()["error"]["type"] == "upstream_error"
        assert s.metric("kvtier_router_upstream_errors_total", leg="direct",
                        kind="connect") == 1


def test_a_failed_refit_is_logged_once_not_per_leg(monkeypatch, caplog) -> None:
    from kvtier.cost import online
    from kvtier.cost.model import CostModel
    from kvtier.router.costs import RouterCost
    from kvtier.router.metrics import RouterMetrics

    def boom(*a: Any, **k: Any) -> Any:
        raise ValueError("singular")
    monkeypatch.setattr(online, "fit_turns", boom)
    rc = RouterCost(CostModel.model_validate(_cost(0.0)), RouterMetrics(), refit=True,
                    min_samples=3)
    with caplog.at_level("WARNING", logger="kvtier.router.costs"):
        for i in range(10):
            rc.prefill_leg(100 + i, ReusePath.NONE, 0, 0.05)
    # tried at the 3rd leg, next at the 11th: one failure, one warning
    assert [r.getMessage() for r in caplog.records] == [
        "cost refit failed; keeping the model in use: refit over 3 samples failed: singular"]
    assert rc.online is not None and rc.online.attempts == 1
    assert rc.model is not None and rc.model.prefill_b_s_per_token == 1e-3


def test_a_blocked_event_loop_is_logged_with_its_line_and_counted(caplog):
    """A synchronous call on the router's loop (here, in the upstream transport) stalls every
    request; the watchdog logs the line while it lasts and the metric counts it."""

    class Blocking(FakeEngines):
        async def handle_async_request(self, request: Any) -> Any:
            if request.url.path == "/v1/completions":
                time.sleep(0.6)  # noqa: ASYNC251 - the blocking line a report must name
            return await super().handle_async_request(request)

    with caplog.at_level("WARNING", logger="kvtier.watchdog"):
        for s in make(Blocking(), loop_stall_warn_s=0.2):
            assert s.complete(PROMPT).status_code == 200
            assert wait_until(  # the lambda is polled here, within the iteration
                lambda: s.metric("kvtier_router_event_loop_stall_seconds_count") >= 1,  # noqa: B023
                5, 0.05)
            assert s.metric("kvtier_router_event_loop_stall_seconds_sum") >= 0.4
    during = [r.getMessage() for r in caplog.records if "has not turned" in r.getMessage()]
    assert during and "time.sleep(0.6)" in during[0], during


def test_the_watchdog_can_be_turned_off():
    for s in make(loop_stall_warn_s=0):
        assert s.router.watchdog is None
        assert s.complete(PROMPT).status_code == 200
