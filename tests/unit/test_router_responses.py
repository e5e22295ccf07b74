"""The Responses API through the router (router/responses.py): whole-input requests through
P/D with reuse, follow-ups by ``previous_response_id`` and streams on one instance with
response-id affinity per tenant, engine transfer params never shown."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from fastapi.testclient import TestClient

from kvtier.router.app import create_app
from kvtier.router.config import RouterConfig
from tests.fakes.engine import D_URL, P_URL, FakeEngines

D1_URL = "http://d1.test:8004"


def make(**cfg: Any) -> Iterator[tuple[TestClient, FakeEngines]]:
    fake = FakeEngines()
    config = RouterConfig.model_validate({"prefill": [P_URL], "decode": [D_URL, D1_URL],
                                          "log_json": False, **cfg})
    with TestClient(create_app(config, transport=fake, health_checks=False)) as c:
        yield c, fake


def test_a_follow_up_goes_where_its_previous_response_is_stored() -> None:
    for c, fake in make():
        first = c.post("/v1/responses", json={"model": "tiny", "input": "hi"})
        assert first.status_code == 200
        body = first.json()
        assert "kv_transfer_params" not in body
        rid = body["id"]
        host = rid.split("_")[1]
        for _ in range(3):  # round robin would move it; affinity does not
            r = c.post("/v1/responses", json={"model": "tiny", "input": "more",
                                              "previous_response_id": rid})
            assert r.status_code == 200 and r.json()["id"].split("_")[1] == host
        got = c.get(f"/v1/responses/{rid}")
        assert got.status_code == 200 and got.json()["id"] == rid
        # what reached the engines: follow-ups passed through carry no transfer params
        sent = [x for x in fake.calls if x.path == "/v1/responses"
                and x.body.get("previous_response_id")]
        assert len(sent) == 3 and all("kv_transfer_params" not in x.body for x in sent)


def test_another_tenants_response_is_not_found() -> None:
    for c, _ in make(api_keys=["ka", "kb"]):
        rid = c.post("/v1/responses", json={"model": "tiny", "input": "hi"},
                     headers={"authorization": "Bearer ka"}).json()["id"]
        for call in (lambda h: c.get(f"/v1/responses/{rid}", headers=h),
                     lambda h: c.post("/v1/responses", headers=h, json={
                         "model": "tiny", "input": "x", "previous_response_id": rid})):
            assert call({"authorization": "Bearer kb"}).status_code == 404
            assert call({"authorization": "Bearer ka"}).status_code == 200
        assert c.post("/v1/responses", json={"model": "tiny", "input": "x"}).status_code == 401


def test_bad_requests_are_refused() -> None:
    for c, _ in make():
        assert c.post("/v1/responses", content=b"{nope").status_code == 400
        assert c.post("/v1/responses", json={"input": "no model"}).status_code == 400
        r = c.post("/v1/responses", json={"model": "tiny", "input": "x",
                                          "kv_transfer_params": {"remote_host": "6.6.6.6"}})
        assert r.status_code == 400


def test_a_stream_is_relayed_without_engine_params_and_its_id_remembered() -> None:
    for c, _ in make():
        with c.stream("POST", "/v1/responses",
                      json={"model": "tiny", "input": "hi", "stream": True}) as r:
            assert r.status_code == 200
            text = "".join(r.iter_text())
        assert text.count("event: response.output_text.delta") == 3
        assert "response.completed" in text and "kv_transfer_params" not in text
        rid = text.split('"id": "', 1)[1].split('"', 1)[0] if '"id": "' in text else \
            text.split('"id":"', 1)[1].split('"', 1)[0]
        assert c.get(f"/v1/responses/{rid}").status_code == 200


def _responses_pd(fake: FakeEngines) -> list[Any]:
    return [x for x in fake.calls if x.path == "/v1/responses"]


def test_a_whole_input_conversation_goes_through_pd_and_reads_the_decode_kv() -> None:
    for c, fake in make():
        turn1 = [{"role": "user", "content": "hello there, a longer first prompt"}]
        r = c.post("/v1/responses", json={"model": "tiny", "input": turn1,
                                          "instructions": "be brief", "conversation_id": "r1"})
        assert r.status_code == 200, r.text
        body = r.json()
        # the client sees none of what the router asked the engines for
        for key in ("kv_transfer_params", "input_messages", "output_messages"):
            assert key not in body
        pre, dec = _responses_pd(fake)
        assert pre.url == P_URL and pre.body["max_output_tokens"] == 1
        assert pre.body["store"] is False and pre.body["enable_response_messages"] is True
        assert pre.kvp["do_remote_decode"] is True and "conversation_id" not in pre.body
        assert dec.url in (D_URL, D1_URL) and dec.kvp["remote_engine_id"] == "P"
        assert r.headers["x-kvtier-reuse"] == "none; tokens=0"
        # the answer is stored on its decode instance: GET finds it there
        assert c.get(f"/v1/responses/{body['id']}").status_code == 200
        turn2 = [*turn1, {"role": "assistant", "content": "abc"},
                 {"role": "user", "content": "and now?"}]
        r2 = c.post("/v1/responses", json={"model": "tiny", "input": turn2,
                                           "instructions": "be brief", "conversation_id": "r1"})
        assert r2.status_code == 200
        assert r2.headers["x-kvtier-reuse"].startswith("dp_read; tokens=")
        pre2 = _responses_pd(fake)[-2]
        assert pre2.kvp["remote_engine_id"] == "D" and pre2.kvp.get("do_remote_decode")


def test_an_unnamed_responses_conversation_continues_by_content() -> None:
    for c, _ in make():
        turn1 = [{"role": "user", "content": "an unnamed conversation, first turn"}]
        assert c.post("/v1/responses", json={"model": "tiny", "input": turn1}).status_code == 200
        turn2 = [*turn1, {"role": "user", "content": "second"}]
        r = c.post("/v1/responses", json={"model": "tiny", "input": turn2})
        assert r.headers["x-kvtier-reuse"].startswith("dp_read; tokens=")


def test_a_prompt_rendered_unlike_tokenize_is_prefilled_again_without_reuse() -> None:
    """The proof ran on /tokenize's rendering; the prefill's own prompt ids differ in the
    part it read from D: that read is not trusted, the prefill runs again without it."""
    for c, fake in make():
        turn1 = [{"role": "user", "content": "a prompt the engine renders the same way"}]
        c.post("/v1/responses", json={"model": "tiny", "input": turn1, "conversation_id": "m"})
        fake.responses_render_prefix = [5]
        n = len(_responses_pd(fake))
        turn2 = [*turn1, {"role": "user", "content": "next"}]
        r = c.post("/v1/responses", json={"model": "tiny", "input": turn2,
                                          "conversation_id": "m"})
        assert r.status_code == 200
        legs = _responses_pd(fake)[n:]
        assert [x.url for x in legs][:2] == [P_URL, P_URL]  # prefilled twice
        assert legs[0].kvp.get("remote_engine_id") == "D"     # first with D's KV
        assert "remote_engine_id" not in legs[1].kvp          # then without
        assert r.headers["x-kvtier-reuse"] == "none; tokens=0"
        assert 'reason="render_mismatch"' in c.get("/metrics").text


def test_inputs_the_router_cannot_render_get_no_reuse_but_an_answer() -> None:
    for c, fake in make():
        items = [{"type": "function_call_output", "call_id": "c1", "output": "42"}]
        for _ in range(2):
            r = c.post("/v1/responses", json={"model": "tiny", "input": items,
                                              "conversation_id": "t"})
            assert r.status_code == 200 and r.headers["x-kvtier-reuse"] == "none; tokens=0"
        assert not [x for x in fake.calls if x.path == "/tokenize"]
