"""The Responses API through the router (router/responses.py): one instance per request,
response-id affinity per tenant, engine transfer params never shown, streams relayed."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from fastapi.testclient import TestClient
from kvtier.router.app import create_app
from kvtier.router.config import RouterConfig

from tests.unit.router_fakes import D_URL, P_URL, FakeEngines

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
        # what reached the engines: the allow-list of headers, no client transfer params
        sent = [x for x in fake.calls if x.path == "/v1/responses"]
        assert all("kv_transfer_params" not in x.body for x in sent)


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
